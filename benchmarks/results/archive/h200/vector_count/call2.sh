python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
R=$OUT/r; mkdir -p $R
trap 'tar -C $OUT -czf $OUT/call2.tgz r; rm -rf $R' EXIT
export PYTHONPATH=$PWD/.site
PYTHONPATH=$PWD/.site:$PWD/src timeout 300 python3 -m pytest -q -m cuda tests -p no:cacheprovider > $R/pytest_cuda.log 2>&1; echo "rc=$?"
tail -3 $R/pytest_cuda.log
IV="interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 8 --window 1.5 --lead 0.5"
for i in 1 2 3 4; do
  python3 benchmarks/experiments/on_tree.py --tree src --name head_$i --out $R/ab --timeout 110 $IV
done
