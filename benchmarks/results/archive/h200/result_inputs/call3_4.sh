python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD/src
mkdir -p $OUT/step
timeout 100 python3 benchmarks/experiments/step_against_hand.py --out $OUT/step 2>&1 | tail -8
timeout 100 python3 benchmarks/experiments/step_against_hand.py --env-load --out $OUT/step 2>&1 | tail -8
