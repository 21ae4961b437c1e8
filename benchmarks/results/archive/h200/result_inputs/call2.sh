set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD/src
mkdir -p $OUT/ab $OUT/tests $OUT/prof
timeout 150 python3 -m pytest -q -m cuda tests/inference/test_cuda.py -k "bound_to_its_inputs or in_each_worker" > $OUT/tests/pytest_overlap.log 2>&1; tail -2 $OUT/tests/pytest_overlap.log
run() {
  PYTHONPATH=$PWD/.site:$1 timeout 150 python3 benchmarks/experiments/interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 8 --window 1.5 --lead 0.5 --out $OUT/ab/$2 > $OUT/ab/$2.log 2>&1
  tail -3 $OUT/ab/$2.log | head -1
}
prof() {
  PYTHONPATH=$PWD/.site:$1 timeout 120 python3 benchmarks/experiments/profile_vector_worker.py --envs 64 --batch 32 --threads 16 --seconds 4 --warmup 1 --switch-intervals "" --backends worker --out $OUT/prof/$2 > $OUT/prof/$2.log 2>&1
  grep -i -E "recv.?->.?send|recv_to_send|worker/hand" $OUT/prof/$2.log | head -6
}
run $PWD/src overlap_1
prof $PWD/src overlap
prof $PWD/.before/src before
run $PWD/.before/src before_3
