python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
R=$OUT/r; mkdir -p $R
trap 'tar -C $OUT -czf $OUT/call3.tgz r; rm -rf $R' EXIT
export PYTHONPATH=$PWD/.site
IV="interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 8 --window 1.5 --lead 0.5"
PV="profile_vector_worker.py --envs 64 --batch 32 --threads 16 --seconds 4 --warmup 1 --switch-intervals '' --backends worker"
for i in 5 6 7; do
  python3 benchmarks/experiments/on_tree.py --tree src --name head_$i --out $R/ab --timeout 110 $IV
done
python3 benchmarks/experiments/on_tree.py --tree src --name head_1 --out $R/prof --timeout 100 profile_vector_worker.py --envs 64 --batch 32 --threads 16 --seconds 4 --warmup 1 --switch-intervals "" --backends worker
