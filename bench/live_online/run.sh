#!/bin/bash
# bench/run.py's online figures on live SGLang (two patched servers on one GPU; see driver.py).
# On a GPU machine, from the checkout root, with the SGLang bundle as .sgl/ and lorapub's extra wheels
# as .whl/ (docs/gpu-acceptance.md, "Reproduce", says how to make them):   bash bench/live_online/run.sh
# In $OUT: bench.txt (what bench/run.py printed), online.json, timeline.png (where matplotlib is
# installed) and the servers' logs (gzipped).
set -u -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
SGL=${LORAPUB_SGL_DIR:-.sgl}
mkdir -p /tmp/site && xz -dc -T0 "$SGL/site.tar.xz" | tar -x -C /tmp/site || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 4
[ -f "$SGL/triton-cache.tgz" ] && tar -C ~ -xzf "$SGL/triton-cache.tgz"
echo "setup $(( $(date +%s) - S )) s"
PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 timeout "${LORAPUB_ONLINE_BUDGET_S:-540}" \
  python3 bench/live_online/driver.py 2>&1 | tee "$OUT/bench.txt"
rc=${PIPESTATUS[0]}
for f in "$OUT"/server-*.log; do [ -f "$f" ] && gzip -f "$f"; done
echo "total $(( $(date +%s) - S )) s, rc $rc"
exit "$rc"
