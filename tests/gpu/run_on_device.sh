#!/usr/bin/env bash
# Live-SGLang acceptance on a GPU machine that reaches no package registry.
# Carried into the checkout: .sgl/site.tar.xz (SGLang 0.5.17 and what it needs beyond the image),
# .sgl/triton-cache.tgz (optional), .whl/*.whl (lorapub's own needs the image lacks),
# .rtr/sglang_router.tar.xz (optional: the SGLang router, for the router section).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
S=$(date +%s)
SGL=${LORAPUB_SGL_DIR:-.sgl}  # .sgl-lite: the same bundle with its shared objects stripped (fits beside the router)
xz -dc -T0 "$SGL/site.tar.xz" | tar -x -C /tmp/site || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 4
# Relax's image: SGLang 0.5.17 with Relax's own patch (carried as .relax/v0.5.17.patch, never committed), then
# lorapub's patch tool on that tree (its diff form checked and applied on a copy) and the acceptance on it.
if [ -n "${LORAPUB_GPU_RELAX:-}" ] && [ -f .relax/v0.5.17.patch ]; then
  (cd /tmp/site/sglang && patch -p3 -s --fuzz=0 < "$OLDPWD/.relax/v0.5.17.patch") || exit 7
  echo "relax patch applied: $(grep -c '^+++ ' .relax/v0.5.17.patch) files"
  PYTHONPATH=/tmp/site:$PWD/src python3 -m lorapub.sglang_patch verify
  PYTHONPATH=/tmp/site:$PWD/src python3 -m lorapub.sglang_patch check
  rm -rf /tmp/sgl-diff && mkdir -p /tmp/sgl-diff && cp -r /tmp/site/sglang /tmp/sgl-diff/
  PYTHONPATH=/tmp/site:$PWD/src python3 -m lorapub.sglang_patch apply --root /tmp/sgl-diff/sglang
  PYTHONPATH=/tmp/site:$PWD/src python3 -m lorapub.sglang_patch check --root /tmp/sgl-diff/sglang
fi
[ -f "$SGL/triton-cache.tgz" ] && tar -C ~ -xzf "$SGL/triton-cache.tgz"
if [ -f .rtr/sglang_router.tar.xz ]; then
  xz -dc -T0 .rtr/sglang_router.tar.xz | tar -x -C /tmp/site || exit 6
  export LORAPUB_GPU_ROUTER=1
fi
# Fixtures with the image's own transformers and peft (the bundle's transformers serves SGLang).
env -u PYTHONPATH python3 -c "from tests.gpu.fixtures import build_all; print(build_all('/tmp/fx'))" || exit 5
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
export LORAPUB_GPU_WIRE=${LORAPUB_GPU_WIRE-1}  # the wire-transport section (engine-side staging)
export LORAPUB_GPU_FIXTURES=/tmp/fx LORAPUB_GPU_REPORT="$OUT/report.json"
echo "setup $(( $(date +%s) - S )) s"
timeout "${LORAPUB_GPU_BUDGET_S:-500}" python3 -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" -rA 2>&1 | tail -40
rc=${PIPESTATUS[0]}
python3 - "$OUT/report.json" <<'PY' 2>&1 | tail -60
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({k: r.get(k) for k in ("boot_s", "warm_up_s", "section_seconds")}, default=str))
for name, err in (r.get("errors") or {}).items():
    print("ERROR in", name, err[-1500:])
for k, v in r.get("verdicts", {}).items():
    print("pass" if v else "FAIL", k)
PY
for f in "$OUT"/server-*.log; do [ -f "$f" ] && gzip -f "$f"; done
echo "total $(( $(date +%s) - S )) s, pytest rc $rc"
exit "$rc"
