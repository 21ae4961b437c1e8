python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
git log --oneline -1 2>/dev/null || echo "tree 555e92d"
export PYTHONPATH=$PWD/.site:$PWD/src
timeout 400 python3 -m pytest -q -m cuda tests -p no:cacheprovider > $OUT/pytest_cuda.log 2>&1; echo "rc=$?"
tail -4 $OUT/pytest_cuda.log
timeout 120 python3 -m pytest -q tests/collector/test_atari_vector.py -k "outranks or raised" -p no:cacheprovider > $OUT/pytest_nice.log 2>&1; echo "rc=$?"
tail -4 $OUT/pytest_nice.log
timeout 60 python3 -m pytest -q tests/test_examples.py -k "may_be_raised" -p no:cacheprovider >> $OUT/pytest_nice.log 2>&1; echo "rc=$?"; tail -2 $OUT/pytest_nice.log
