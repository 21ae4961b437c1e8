python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
mkdir -p $OUT/ab $OUT/prof
uname -r; id -u
prof() {  # tree name extra-args
  PYTHONPATH=$PWD/.site:$1 timeout 100 python3 benchmarks/experiments/profile_vector_worker.py --envs 64 --batch 32 --threads 16 --seconds 4 --warmup 1 --switch-intervals "" --backends worker $3 --out $OUT/prof/$2 > $OUT/prof/$2.log 2>&1
  grep -E "driver" $OUT/prof/$2.log | sort | uniq -c | head -3
  python3 - $OUT/prof/$2/profile_vector_worker.json $2 <<'PY'
import json,sys
r=json.load(open(sys.argv[1]))
for k,v in r.items():
    if k=="config": continue
    v=v[-1]
    w=v.get("worker_us_per_batch") or {}
    print(sys.argv[2], k, round(v.get("fps",0)), {a:round(b,1) for a,b in w.items() if isinstance(b,(int,float))})
PY
}
run() {
  PYTHONPATH=$PWD/.site:$1 timeout 120 python3 benchmarks/experiments/interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 8 --window 1.5 --lead 0.5 --out $OUT/ab/$2 > $OUT/ab/$2.log 2>&1
  grep -E "driver" $OUT/ab/$2.log | sort | uniq -c | head -3
  python3 -c "import json;s=json.load(open('$OUT/ab/$2/interleaved_vector.json'))['summary'];print('$2', round(s['collector/hand_loop']['median'],3), round(s['collector/env_only']['median'],3), s['collector_ahead_of_hand_loop'])"
}
D=$PWD/.probe/drv/src
prof $PWD/.before/src base
RLC_DRIVER_SLICE_US=100 prof $D slice100
RLC_DRIVER_NICE=-5 prof $D nice-5
prof $PWD/.before/src envnice1 "--env-nice 1"
RLC_DRIVER_SLICE_US=100 run $D slice100_1
run $PWD/.before/src base_1
