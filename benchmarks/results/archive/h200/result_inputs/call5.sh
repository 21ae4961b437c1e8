python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD/src
mkdir -p $OUT/step $OUT/ab $OUT/tests
timeout 100 python3 benchmarks/experiments/step_against_hand.py --out $OUT/step 2>&1 | tail -12
timeout 100 python3 benchmarks/experiments/step_against_hand.py --env-load --out $OUT/step 2>&1 | tail -12
timeout 150 python3 -m pytest -q -m cuda tests/inference/test_cuda.py -k "bound_to_its_inputs or in_each_worker" > $OUT/tests/pytest_lean.log 2>&1; tail -1 $OUT/tests/pytest_lean.log
run() {
  PYTHONPATH=$PWD/.site:$1 timeout 150 python3 benchmarks/experiments/interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 8 --window 1.5 --lead 0.5 --out $OUT/ab/$2 > $OUT/ab/$2.log 2>&1
  python3 -c "import json;s=json.load(open('$OUT/ab/$2/interleaved_vector.json'))['summary'];print('$2', round(s['collector/hand_loop']['median'],3), round(s['collector/env_only']['median'],3), s['collector_ahead_of_hand_loop'])"
}
run $PWD/src lean_1
run $PWD/.before/src before_4
run $PWD/src lean_2
