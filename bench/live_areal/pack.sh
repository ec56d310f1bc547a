#!/bin/bash
# Pack the part of AReaL 1.0.4 that the live side-by-side imports and the accelerator machine lacks, into
# .areal/ (about 1.3 MB; never committed), from .ci/install's .cache/areal/1.0.4; then check it (check_pack.py).
# run.sh unpacks it on the machine. The machine's image and the SGLang bundle already hold torch, transformers,
# tokenizers, huggingface_hub, openai, httpx, numba, uvloop, aiofiles, einops, click, jinja2 and the rest; what
# they lack:
#   areal-min.tar.xz  AReaL itself and the pure-Python packages its import chain needs (colorlog, hydra,
#                     omegaconf, lark, tenacity, torchdata), and a stand-in for ray (standin/ray beside this
#                     script): AReaL imports ray at module level for its Ray launcher, scheduler, RPC and
#                     name_resolve backends (reached from `import areal` through areal.api.cli_args), which the
#                     side-by-side never uses; the real Ray is 65 MB and compiled. The stand-in defines what
#                     those imports touch and raises, naming itself, at anything Ray would do.
#   *.whl             flask 3.1.3 and what it needs beyond the image (itsdangerous, blinker, and werkzeug, whose
#                     version in the image is unknown): areal.infra.controller.rollout_controller imports flask.
#                     Pure-Python wheels; run.sh installs them ahead of the image.
# A live attempt (2026-12-07) failed at `import flask`, then at `import ray`, before any request: this CPU
# machine has both installed, so an import-time listing here missed them. check_pack.py now runs the CPU
# side-by-side with only the standard library, the image's packages, the bundle's, the checkout and this pack
# importable (the pack's own modules taken from it, never from this machine); pack.sh fails if it does not pass.
# numba needs no stand-in any more: the image has it, and run.sh's AReaL folder comes after the image on the
# path, so the image's numba would win over a packed one anyway (AReaL only decorates with @numba.njit at import).
set -eu
cd "$(dirname "$0")/../.."
SRC=.cache/areal/1.0.4
[ -f "$SRC/.complete" ] || { echo "run .ci/install first (its areal step)"; exit 2; }
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
for p in areal colorlog hydra omegaconf lark tenacity torchdata; do cp -r "$SRC/$p" "$TMP/"; done
cp -r bench/live_areal/standin/ray "$TMP/"
find "$TMP" -name __pycache__ -prune -exec rm -rf {} +
rm -rf .areal && mkdir -p .areal
tar -C "$TMP" -c . | xz -9 -T2 > .areal/areal-min.tar.xz
# flask and what it needs beyond the image, for the machine's Python (3.12); pure Python, versions that fit together
python3 -m pip download -q flask==3.1.3 itsdangerous==2.2.0 blinker==1.9.0 werkzeug==3.1.8 \
  --only-binary=:all: --no-deps --python-version 3.12 -d .areal
ls -l .areal
du -sh .areal
python3 bench/live_areal/check_pack.py
