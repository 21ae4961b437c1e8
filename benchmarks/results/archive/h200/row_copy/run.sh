# Run on the H200 from the repo root, after the install line of shared/tools/device-wheels.
# .before: `git archive 3b0ed80 src | tar -x -C .before`; the after side was the working tree
# at 2c9f649, 2e0de0b or 3c200f2 (today: `python benchmarks/experiments/probe_tree.py
# row_copy .after` builds 3c200f2's src). Phases: the worker_phases probe rebased onto the
# copier (_tick("copy_wait") after its wait, "fin_small"/"fin_obs" inside finish, and
# RLCOLLECT_PROBE_CPU_COPY=1 to have LocalEnd.copier return None); that rebase is not kept.
run() {  # $1: tree holding src/rlcollect, $2: out dir; extra env as given
  mkdir -p $2
  PYTHONPATH=$PWD/.site:$1/src python3 benchmarks/experiments/profile_vector_worker.py \
    --envs 64 --batch 32 --threads 16 --seconds 4 --warmup 1 --switch-intervals "" \
    --backends worker --out $2 > $2/log 2>&1
}
RLCOLLECT_PROBE_DIR=$OUT/ph_gpu run .probe/after $OUT/ph_gpu
RLCOLLECT_PROBE_CPU_COPY=1 RLCOLLECT_PROBE_DIR=$OUT/ph_cpu run .probe/after $OUT/ph_cpu
run .before $OUT/ab_before_1; run .after $OUT/ab_after_1          # likewise pairs 3-6
PYTHONPATH=$PWD/.site:.after/src python3 benchmarks/experiments/profile_vector_worker.py \
  --envs 64 --batch 32 --threads 16 --seconds 5 --warmup 1.5 --switch-intervals "" \
  --backends worker --rounds 5 --out $OUT/rounds5
python3 -m pytest -q -m cuda -p no:cacheprovider tests > $OUT/pytest_cuda.log 2>&1
