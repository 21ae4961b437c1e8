# run on the device from the repo root, after the install line
for variant in uva; do
  d=$OUT/phases_$variant; mkdir -p $d
  if [ $variant = host ]; then export RLCOLLECT_PROBE_HOST_GATHER=1; else unset RLCOLLECT_PROBE_HOST_GATHER; fi
  RLCOLLECT_PROBE_DIR=$d PYTHONPATH=$PWD/.site:$PWD/.probe/src python benchmarks/experiments/profile_vector_worker.py --envs 64 --batch 32 --threads 16 --seconds 5 --warmup 1.5 --switch-intervals "" --backends worker --rounds 2 --out $d 2>&1 | grep -E '^(env_only|hand_loop|process)|fps' 
  python3 -c "
import json,glob
for f in sorted(glob.glob('$d/phases-*.json')):
    d=json.load(open(f)); c=d['calls']
    print('$variant', f.split('/')[-1], {k: round(v/c/1e3,1) for k,v in d['ns'].items()})
"
done
