python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD/src
mkdir -p $OUT/ab $OUT/prof $OUT/tests
prof() {
  PYTHONPATH=$PWD/.site:$1 timeout 100 python3 benchmarks/experiments/profile_vector_worker.py --envs 64 --batch 32 --threads 16 --seconds 4 --warmup 1 --switch-intervals "" --backends worker --out $OUT/prof/$2 > $OUT/prof/$2.log 2>&1
  grep -E '"recv_to_send"' $OUT/prof/$2.log | tr '\n' ' '; echo " $2"
}
run() {
  PYTHONPATH=$PWD/.site:$1 timeout 120 python3 benchmarks/experiments/interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 8 --window 1.5 --lead 0.5 --out $OUT/ab/$2 > $OUT/ab/$2.log 2>&1
  python3 -c "import json;s=json.load(open('$OUT/ab/$2/interleaved_vector.json'))['summary'];print('$2', round(s['collector/hand_loop']['median'],3), round(s['collector/env_only']['median'],3), s['collector_ahead_of_hand_loop'])"
}
prof $PWD/src v4
prof $PWD/.before/src before
run $PWD/src v4_1
run $PWD/.before/src before_5
timeout 70 python3 -m pytest -q -m cuda tests/inference/test_cuda.py -k "bound_to_its_inputs or in_each_worker" > $OUT/tests/pytest_v4.log 2>&1; tail -1 $OUT/tests/pytest_v4.log
