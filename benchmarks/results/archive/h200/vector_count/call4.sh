python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD/src
for cfg in "thread thread" "process_slots thread" "process_slots worker"; do
  timeout 75 python3 .probe/s49/startup.py $cfg cuda 2>&1 | grep -v Warn | tail -2
done
