python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
R=$OUT/r; mkdir -p $R/ab $R/prof
trap 'tar -C $OUT -czf $OUT/call5.tgz r; rm -rf $R' EXIT
run() {  # tree name
  PYTHONPATH=$PWD/.site:$1 timeout 110 python3 benchmarks/experiments/interleaved_vector.py --envs 64 --batch 32 --threads 16 --cycles 8 --window 1.5 --lead 0.5 --out $R/ab/$2 > $R/ab/$2.log 2>&1
  echo "rc=$? $2"
  python3 -c "import json;s=json.load(open('$R/ab/$2/interleaved_vector.json'))['summary'];print('$2', round(s['collector/hand_loop']['median'],3), round(s['collector/env_only']['median'],3), s['collector_ahead_of_hand_loop'])" 2>&1 | tail -1
}
prof() {
  PYTHONPATH=$PWD/.site:$1 timeout 100 python3 benchmarks/experiments/profile_vector_worker.py --envs 64 --batch 32 --threads 16 --seconds 4 --warmup 1 --switch-intervals "" --backends worker --out $R/prof/$2 > $R/prof/$2.log 2>&1
  echo "rc=$? prof $2"; grep -E '"(fps|recv|recv_to_send|send_to_recv|recv_queued)"' $R/prof/$2.log
}
T=$PWD/src; N=$PWD/.probe/n10/src
run $N n10_3
run $T final_7
