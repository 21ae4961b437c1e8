python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
R=$OUT/r; mkdir -p $R/ab $R/srv $R/prof
trap 'tar -C $OUT -czf $OUT/call2.tgz r; rm -rf $R' EXIT
run() {  # tree name
  PYTHONPATH=$PWD/.site:$1 timeout 110 python3 benchmarks/experiments/interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 8 --window 1.5 --lead 0.5 --out $R/ab/$2 > $R/ab/$2.log 2>&1
  echo "rc=$? $2"
  python3 -c "import json;s=json.load(open('$R/ab/$2/interleaved_vector.json'))['summary'];print('$2', round(s['collector/hand_loop']['median'],3), round(s['collector/env_only']['median'],3), s['collector_ahead_of_hand_loop'])" 2>&1 | tail -1
}
srv() {  # name args
  PYTHONPATH=$PWD/.site:$PWD/src timeout 100 python3 benchmarks/experiments/server_nice.py $2 --windows 10 --seconds 3 --out $R/srv/$1 > $R/srv/$1.log 2>&1
  echo "rc=$? srv $1"; grep -E "median|window|nice" $R/srv/$1.log | tail -30
}
T=$PWD/src
PYTHONPATH=$PWD/.site:$T timeout 100 python3 benchmarks/experiments/profile_vector_worker.py --envs 64 --batch 32 --threads 16 --seconds 4 --warmup 1 --switch-intervals "" --backends worker --out $R/prof/final > $R/prof/final.log 2>&1
echo "rc=$? prof"; tail -25 $R/prof/final.log
run $T final_4
run $PWD/.before/src before_2
run $T final_5
srv e16 "--envs 16"
srv e64 "--envs 64 --envs-per-worker 4 --worker-splits 2"
