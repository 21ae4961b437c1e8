# Run on the H200 from the repo root, after the install line of shared/tools/device-wheels.
# .before: `git archive a346093 src | tar -x -C .before`. The probe trees .probe/before and
# .probe/after: each side's src/ with benchmarks/experiments/probes/worker_phases.patch
# applied (today `python benchmarks/experiments/probe_tree.py worker_phases .probe/after`).
run() {  # $1: tree holding src/rlcollect, $2: out dir; extra env as given
  mkdir -p $2
  PYTHONPATH=$PWD/.site:$1/src python3 benchmarks/experiments/profile_vector_worker.py \
    --envs 64 --batch 32 --threads 16 --seconds 4 --warmup 1 --switch-intervals "" \
    --backends worker --out $2 > $2/log 2>&1
}
# phases (probe worker_phases; the per-receive means are summed from $d/phases-*.json)
for v in before after; do RLCOLLECT_PROBE_DIR=$OUT/ph_$v run .probe/$v $OUT/ph_$v; done
# interleaved A/B, no probe
for r in 1 2 3 4; do run .before $OUT/ab_before_$r; run . $OUT/ab_after_$r; done
# five rounds on the committed tree (b276495)
PYTHONPATH=$PWD/.site:$PWD/src python3 benchmarks/experiments/profile_vector_worker.py \
  --envs 64 --batch 32 --threads 16 --seconds 5 --warmup 1.5 --switch-intervals "" \
  --backends worker --rounds 5 --out $OUT/rounds5
python3 -m pytest -q -m cuda -p no:cacheprovider tests > $OUT/pytest_cuda.log 2>&1
