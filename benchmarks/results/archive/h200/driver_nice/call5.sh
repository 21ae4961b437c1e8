python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
mkdir -p $OUT/ab $OUT/prof
uname -r; id -u
run() {
  PYTHONPATH=$PWD/.site:$1 timeout 110 python3 benchmarks/experiments/interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 6 --window 1.5 --lead 0.5 --backend thread --out $OUT/ab/$2 > $OUT/ab/$2.log 2>&1
  grep -E "driver" $OUT/ab/$2.log | sort | uniq -c | head -3
  python3 -c "import json;s=json.load(open('$OUT/ab/$2/interleaved_vector.json'))['summary'];print('$2', round(s['collector/hand_loop']['median'],3), round(s['collector/env_only']['median'],3), s['collector_ahead_of_hand_loop'])"
}
D=$PWD/.probe/drv/src
RLC_DRIVER_NICE=-5 run $D thr_nice5_1
run $PWD/.before/src thr_base_1
