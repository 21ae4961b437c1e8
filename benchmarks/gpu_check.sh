#!/usr/bin/env bash
# The one-call GPU check (issue 59): what anyone who gets a GPU machine runs first.
#
#   benchmarks/gpu_check.sh [OUT] [options of python -m benchmarks.check]
#
# OUT: where the summary, the JSON and the logs go (default $OUT, else build/gpu_check).
# Installs the wheels in .whl/ into .site/ where tensordict, gymnasium or ale-py do not
# import, then runs benchmarks/check.py: the CUDA tests, the key throughput rows, a Pong
# training smoke and the frame replay's GPU sample times, each within its budget, the
# whole within --deadline-s (540 s), counted from this script's start. The summary is
# always printed. On a copied tree without .git, name the commit:
#   RLCOLLECT_BENCH_COMMIT=<sha> benchmarks/gpu_check.sh
# On a CPU machine, the plumbing alone: benchmarks/gpu_check.sh /tmp/check --dry-run
set -u
started=$(date +%s)
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu_check}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    out=$1
    shift
fi
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
[ -d .site ] && export PYTHONPATH=$PWD/.site:$PYTHONPATH

probe="import tensordict, gymnasium, ale_py"
install_ok=1
if "$python" -c "$probe" 2>/dev/null; then
    note="packages import already: nothing installed"
elif [ -d .whl ]; then
    t0=$(date +%s)
    # bounded like every part: a stuck install must not eat the call
    if timeout -k 5 60 "$python" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target .site .whl/*.whl >"$out/install.log" 2>&1; then
        note="installed $(ls .whl/*.whl | wc -l) wheels from .whl/ in $(($(date +%s) - t0)) s"
    else
        install_ok=0
        note="pip install from .whl/ failed (install.log)"
    fi
    export PYTHONPATH=$PWD/.site:$PYTHONPATH
    "$python" -c "$probe" >>"$out/install.log" 2>&1 || { install_ok=0; note="$note; still missing"; }
else
    install_ok=0
    note="tensordict/gymnasium/ale-py do not import and there is no .whl/ (carry it)"
fi
echo "== install: $note"

# The check bounds each part itself; this outer bound is the last resort (no summary).
bound=()
command -v timeout >/dev/null && bound=(timeout -k 10 600)
exec "${bound[@]}" "$python" -m benchmarks.check --out "$out" --started "$started" \
    --install "$note" --install-ok "$install_ok" "$@"
