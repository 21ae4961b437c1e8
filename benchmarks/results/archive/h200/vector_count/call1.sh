python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
git log --oneline -1 2>/dev/null || echo "no git"
R=$OUT/r; mkdir -p $R
trap 'tar -C $OUT -czf $OUT/call1.tgz r; rm -rf $R' EXIT
export PYTHONPATH=$PWD/.site:$PWD/src
timeout 570 python3 -m benchmarks gpu --part 5 --out $R/suite > $R/suite.log 2>&1; echo "rc=$?"
tail -5 $R/suite.log
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/r/suite/vector_throughput.json"))
for k, v in d["summary"].items(): print(round(v["frames_per_second"]["median"]), k)
for k, v in d["ratios"].items(): print([round(x, 3) for x in v["per_repeat"]], k)
PY
