#!/bin/bash
# Where a 264 MB adapter's preparation spends its time on a GPU machine, with no server running
# (stages.py says what it times and why). From the checkout root, with the SGLang bundle as .sgl/ and
# lorapub's extra wheels as .whl/ (docs/gpu-acceptance.md, "Reproduce"):   bash bench/live_prepare/run.sh
# One to five minutes (each line is printed as it is measured); in $OUT: stages.txt (everything printed)
# and stages.json (every repetition). Env: LIVE_PREPARE_ARGS (extra stages.py arguments; default "--reps 2 --busy 12"),
# LIVE_PREPARE_BUDGET_S (default 420). Keep the result under
# bench/results/<date>-prepare-stages/ with a COMMAND.md saying how it ran.
set -u -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
SGL=${LORAPUB_SGL_DIR:-.sgl}
{
  # the bundle, unless an earlier run on this machine unpacked it
  [ -d /tmp/site/sglang ] || { mkdir -p /tmp/site && xz -dc -T0 "$SGL/site.tar.xz" | tar -x -C /tmp/site; } || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 4
  echo "setup $(( $(date +%s) - S )) s"
  PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 timeout "${LIVE_PREPARE_BUDGET_S:-420}" \
    python3 bench/live_prepare/stages.py --json "$OUT/stages.json" ${LIVE_PREPARE_ARGS:---reps 2 --busy 12}
} 2>&1 | tee "$OUT/stages.txt"
rc=${PIPESTATUS[0]}
echo "total $(( $(date +%s) - S )) s, rc $rc" | tee -a "$OUT/stages.txt"
exit "$rc"
