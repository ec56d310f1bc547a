#!/bin/bash
# Pack the part of AReaL 1.0.4 that the live side-by-side imports and the accelerator machine lacks, into
# .areal/areal-min.tar.xz (about 4 MB; never committed), from .ci/install's .cache/areal/1.0.4. The machine's
# image and the SGLang bundle already hold torch, transformers, tokenizers, huggingface_hub, openai, httpx and
# the rest (measured: the imports of a CPU side-by-side run, `python3 -X importtime`). AReaL imports numba
# only for its training-side sequence packing (areal/utils/seqpack.py, one @numba.njit), which rollouts never
# call: numba and llvmlite (210 MB) are left out and a stand-in whose njit returns the function unchanged
# takes their place. uvloop comes as the wheel for the machine's Python. run.sh unpacks them on the machine.
set -eu
SRC=.cache/areal/1.0.4
[ -f "$SRC/.complete" ] || { echo "run .ci/install first (its areal step)"; exit 2; }
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
for p in areal aiofiles colorlog einops hydra omegaconf lark tenacity torchdata; do cp -r "$SRC/$p" "$TMP/"; done
cp -r "$SRC"/antlr4* "$TMP/" 2>/dev/null || true
mkdir -p "$TMP/numba"
cat > "$TMP/numba/__init__.py" <<'PY'
"""A stand-in for numba on a machine that lacks it: AReaL imports numba for training-side sequence packing
only (areal/utils/seqpack.py), which the rollout side-by-side never calls. njit returns the function as is."""


def njit(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


jit = njit
PY
find "$TMP" -name __pycache__ -prune -exec rm -rf {} +
rm -rf .areal && mkdir -p .areal
tar -C "$TMP" -c . | xz -9 -T2 > .areal/areal-min.tar.xz
# uvloop is compiled: the wheel for the machine's Python (3.12), installed by run.sh beside the bundle
python3 -m pip download -q uvloop==0.22.1 --only-binary=:all: --no-deps --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .areal
ls -l .areal
