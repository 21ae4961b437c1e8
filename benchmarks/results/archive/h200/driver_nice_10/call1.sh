python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
mkdir -p $OUT/ab $OUT/srv
uname -r; id -u; nproc
run() {  # tree name
  PYTHONPATH=$PWD/.site:$1 timeout 110 python3 benchmarks/experiments/interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 8 --window 1.5 --lead 0.5 --out $OUT/ab/$2 > $OUT/ab/$2.log 2>&1
  echo "rc=$? $2"
  python3 -c "import json;s=json.load(open('$OUT/ab/$2/interleaved_vector.json'))['summary'];print('$2', round(s['collector/hand_loop']['median'],3), round(s['collector/env_only']['median'],3), s['collector_ahead_of_hand_loop'])" 2>&1 | tail -1
}
T=$PWD/src
run $T final_1
run $T final_2
run $PWD/.before/src before_1
run $T final_3
PYTHONPATH=$PWD/.site:$T timeout 100 python3 benchmarks/experiments/server_nice.py --envs 16 --windows 10 --seconds 3 --out $OUT/srv/e16 > $OUT/srv/e16.log 2>&1
echo "rc=$? srv16"; tail -15 $OUT/srv/e16.log
