#!/bin/bash
# Decode gaps on live SGLang while an adapter is loaded: stock server beside lorapub's patched one.
# On a GPU machine, from the checkout root, with the SGLang bundle as .sgl/ and lorapub's extra wheels
# as .whl/ (docs/gpu-acceptance.md, "Reproduce", says how to make them):   bash bench/live_load_gap/run.sh
# Builds a 4B-shaped random Qwen3 and 264 MB r=64 adapters (A, B, B32 = B in fp32), boots the
# servers (STALL_ORDER, stock and patched by default), measures each in turn (STALL_REPS=3 loads of B, STALL_REPS32=2 of B32, each against a control as long as
# its load and first use), then prints
# the summary. About 400 s on one H200; in $OUT: summary.txt and results.tgz (JSON per
# server, token events, server logs and their lorapub lines).
set -u -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
SGL=${LORAPUB_SGL_DIR:-.sgl}
mkdir -p /tmp/site && xz -dc -T0 "$SGL/site.tar.xz" | tar -x -C /tmp/site || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 4
export LORAPUB_SRC="$PWD/src" STALL_SITE=/tmp/site
env -u PYTHONPATH PYTHONUNBUFFERED=1 STALL_TOTAL_S=$((${LORAPUB_GAP_BUDGET_S:-565} - ($(date +%s) - S))) \
  timeout $((${LORAPUB_GAP_BUDGET_S:-565} + 15)) python3 "$here/driver.py"
rc=$?
python3 "$here/summarize.py" "$OUT" | tee "$OUT/summary.txt"
for f in "$OUT"/server_*.log; do [ -f "$f" ] && grep -a "lorapub" "$f" > "${f%.log}.lorapub.txt"; done
# everything but the summary in one archive (JSON per server, token events, server logs)
(cd "$OUT" && tar -czf results.tgz --remove-files $(ls | grep -v -e '^summary.txt$' -e '^results.tgz$'))
echo "total $(( $(date +%s) - S )) s, driver rc $rc"
exit $rc
