#!/bin/bash
# elastic.py on live SGLang: two patched servers serve Relax-shaped rollouts, a third joins under load and the
# first drains and leaves (see elastic_live.py). On a GPU machine, from the checkout root, with the SGLang
# bundle as .sgl/ and lorapub's extra wheels as .whl/ (docs/gpu-acceptance.md, "Reproduce"):
#     bash bench/live_relax/elastic.sh
# In $OUT: elastic.txt (everything printed), elastic.json (every figure: requests by outcome, the engines the
# turns went to in each phase, join and drain times, publications, what each server holds at the end) and the
# servers' logs (gzipped). Exit 0 only when no request failed, e0 was removed and e2 served turns.
# Env: LIVE_RELAX_MAX_LORAS (slots, default 5), LIVE_RELAX_ELASTIC_ARGS (extra elastic.py arguments),
# LIVE_RELAX_BUDGET_S (the whole script's time, default 560 s). Keep the result under
# bench/results/<date>-relax-elastic-live/ with a COMMAND.md saying how it ran.
set -u -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
ROOT=$PWD
SGL=${LORAPUB_SGL_DIR:-.sgl}
export LIVE_RELAX_DEADLINE=$(( S + ${LIVE_RELAX_BUDGET_S:-560} ))
{
  # the bundle, unless an earlier run on this machine unpacked it (a second run need not carry .sgl)
  [ -d /tmp/site/sglang ] || { mkdir -p /tmp/site && xz -dc -T0 "$SGL/site.tar.xz" | tar -x -C /tmp/site; } || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 4
  [ -f "$SGL/triton-cache.tgz" ] && tar -C ~ -xzf "$SGL/triton-cache.tgz"
  export PYTHONPATH=/tmp/site:$ROOT/src:$ROOT PYTHONUNBUFFERED=1
  python3 -m lorapub.sglang_patch check --root /tmp/site/sglang
  echo "setup $(( $(date +%s) - S )) s"
  left=$(( LIVE_RELAX_DEADLINE - $(date +%s) )); [ "$left" -lt 60 ] && left=60
  timeout "$left" python3 bench/live_relax/elastic_live.py
} 2>&1 | tee "$OUT/elastic.txt"
rc=${PIPESTATUS[0]}
for f in "$OUT"/server-*.log; do [ -f "$f" ] && gzip -f "$f"; done
echo "total $(( $(date +%s) - S )) s, rc $rc" | tee -a "$OUT/elastic.txt"
exit "$rc"
