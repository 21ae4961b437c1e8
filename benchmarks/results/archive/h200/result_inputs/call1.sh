set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD/src
nvidia-smi --query-gpu=name,utilization.gpu --format=csv
mkdir -p $OUT/ab $OUT/tests
timeout 200 python3 -m pytest -q -m cuda tests/inference/test_cuda.py -k "bound_to_its_inputs or in_each_worker or whole_step" > $OUT/tests/pytest_direct.log 2>&1; tail -3 $OUT/tests/pytest_direct.log
run() {  # tree name
  PYTHONPATH=$PWD/.site:$1 timeout 150 python3 benchmarks/experiments/interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 8 --window 1.5 --lead 0.5 --out $OUT/ab/$2 > $OUT/ab/$2.log 2>&1
  tail -4 $OUT/ab/$2.log
}
run $PWD/.before/src before_1
run $PWD/src after_1
run $PWD/src after_2
run $PWD/.before/src before_2
