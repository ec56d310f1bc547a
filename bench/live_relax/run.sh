#!/bin/bash
# driver.py's Relax-shaped rollouts on live SGLang: two patched servers on one GPU (see live.py).
# On a GPU machine, from the checkout root, with the SGLang bundle as .sgl/ and lorapub's extra wheels
# as .whl/ (docs/gpu-acceptance.md, "Reproduce", says how to make them):   bash bench/live_relax/run.sh
# With .relax/v0.5.17.patch present (Relax's SGLang patch; it is not part of this repository), the
# bundle's SGLang is patched with it before the servers boot. lorapub.sglang_patch's verify and check
# show which build the run serves (0.5.17+relax when Relax's patch is in).
# In $OUT: relax.txt (everything printed), relax.json (every figure) and the servers' logs (gzipped).
# Env: LIVE_RELAX_MAX_LORAS (the servers' LoRA slots, default 5), LIVE_RELAX_ARGS (extra driver.py
# arguments), LIVE_RELAX_BUDGET_S (the whole script's time, default 530 s).
set -u -o pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
ROOT=$PWD
SGL=${LORAPUB_SGL_DIR:-.sgl}
export LIVE_RELAX_DEADLINE=$(( S + ${LIVE_RELAX_BUDGET_S:-530} ))
{
  mkdir -p /tmp/site && xz -dc -T0 "$SGL/site.tar.xz" | tar -x -C /tmp/site || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 4
  [ -f "$SGL/triton-cache.tgz" ] && tar -C ~ -xzf "$SGL/triton-cache.tgz"
  export PYTHONPATH=/tmp/site:$ROOT/src:$ROOT PYTHONUNBUFFERED=1
  if [ -f .relax/v0.5.17.patch ]; then
    echo "applying .relax/v0.5.17.patch to /tmp/site/sglang (patch -p3)"
    if command -v patch >/dev/null; then
      (cd /tmp/site/sglang && patch -p3 -s --forward < "$ROOT/.relax/v0.5.17.patch") || exit 5
    else
      (cd /tmp/site/sglang && git apply -p3 "$ROOT/.relax/v0.5.17.patch") || exit 5
    fi
  fi
  for c in verify check; do
    echo "\$ python3 -m lorapub.sglang_patch $c --root /tmp/site/sglang"
    python3 -m lorapub.sglang_patch "$c" --root /tmp/site/sglang
  done
  echo "setup $(( $(date +%s) - S )) s"
  left=$(( LIVE_RELAX_DEADLINE - $(date +%s) )); [ "$left" -lt 60 ] && left=60
  timeout "$left" python3 bench/live_relax/live.py
} 2>&1 | tee "$OUT/relax.txt"
rc=${PIPESTATUS[0]}
for f in "$OUT"/server-*.log; do [ -f "$f" ] && gzip -f "$f"; done
echo "total $(( $(date +%s) - S )) s, rc $rc" | tee -a "$OUT/relax.txt"
exit "$rc"
