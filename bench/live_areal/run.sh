#!/bin/bash
# bench/areal_side_by_side.py on live SGLang 0.5.17 (see live.py): AReaL's path on two stock servers,
# lorapub's on two patched ones, one GPU. On a GPU machine, from the checkout root, with the SGLang
# bundle as .sgl/ and lorapub's extra wheels as .whl/ (docs/gpu-acceptance.md, "Reproduce"), and AReaL
# 1.0.4 under .cache/areal/1.0.4 (.ci/install's areal step) or as .areal/areal-min.tar.xz (pack.sh: the part
# of it the machine lacks, small enough to carry beside the checkout):
#   bash bench/live_areal/run.sh
# In $OUT: areal.txt (everything printed), areal-areal.json and areal-lorapub.json (every figure), the
# servers' logs (gzipped). Env: LIVE_AREAL_PATHS (which paths run, in order; default "areal lorapub"),
# LIVE_AREAL_ARGS (extra side-by-side arguments, given to every path's run: not the place for --paths),
# LIVE_AREAL_BUDGET_S (the whole script's time, default 1100 s).
set -u -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
ROOT=$PWD
SGL=${LORAPUB_SGL_DIR:-.sgl}
export LIVE_AREAL_DEADLINE=$(( S + ${LIVE_AREAL_BUDGET_S:-1100} ))
{
  if [ -f .areal/areal-min.tar.xz ]; then  # pack.sh's part of AReaL, unpacked again whenever it changed
    sum=$(sha256sum .areal/areal-min.tar.xz | cut -d' ' -f1)
    stamp=.cache/areal/1.0.4/.pack-sha256  # only a folder made from a pack has it: .ci/install's is never replaced
    if [ ! -f .cache/areal/1.0.4/.complete ] || { [ -f "$stamp" ] && [ "$(cat "$stamp")" != "$sum" ]; }; then
      if [ -f "$stamp" ]; then rm -rf .cache/areal/1.0.4; fi
      mkdir -p .cache/areal/1.0.4 && xz -dc .areal/areal-min.tar.xz | tar -x -C .cache/areal/1.0.4 \
        && echo "$sum" > "$stamp" && touch .cache/areal/1.0.4/.complete || exit 2
    fi
  fi
  [ -f .cache/areal/1.0.4/.complete ] || { echo "AReaL 1.0.4 is not under .cache/areal/1.0.4 (bench/live_areal/pack.sh)"; exit 2; }
  # the bundle, unless an earlier run on this machine unpacked it (a second run need not carry .sgl)
  [ -d /tmp/site/sglang ] || { mkdir -p /tmp/site && xz -dc -T0 "$SGL/site.tar.xz" | tar -x -C /tmp/site; } || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 4
  if ls .areal/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .areal/*.whl || exit 4; fi
  [ -f "$SGL/triton-cache.tgz" ] && tar -C ~ -xzf "$SGL/triton-cache.tgz"
  export PYTHONPATH=/tmp/site:$ROOT/src:$ROOT PYTHONUNBUFFERED=1
  python3 -m lorapub.sglang_patch verify --root /tmp/site/sglang
  echo "setup $(( $(date +%s) - S )) s"
  left=$(( LIVE_AREAL_DEADLINE - $(date +%s) )); [ "$left" -lt 60 ] && left=60
  timeout "$left" python3 bench/live_areal/live.py
} 2>&1 | tee "$OUT/areal.txt"
rc=${PIPESTATUS[0]}
for f in "$OUT"/server-*.log; do [ -f "$f" ] && gzip -f "$f"; done
echo "total $(( $(date +%s) - S )) s, rc $rc" | tee -a "$OUT/areal.txt"
exit "$rc"
