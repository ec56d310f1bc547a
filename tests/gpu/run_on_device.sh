#!/usr/bin/env bash
# Runs the GPU acceptance on an accelerator machine that reaches no registry.
# Wheels for what its image lacks travel in carry/wheels (built by `pip download`).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
  python3 -V; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python3 -c "import sglang" 2>&1 | tail -1 || true
} > "$OUT/env.txt" 2>&1
# module -> carried wheels it needs (installed only where the image lacks the module)
declare -A WHEELS=(
  [pyrsistent]="pyrsistent-*" [attrs]="attrs-*" [safetensors]="safetensors-*" [peft]="peft-*"
  [aiohttp]="aiohttp-* multidict-* yarl-* frozenlist-* aiosignal-* propcache-* aiohappyeyeballs-*"
)
for mod in "${!WHEELS[@]}"; do
  if ! python3 -c "import $mod" 2>/dev/null; then
    echo "carried wheels for $mod" >> "$OUT/env.txt"
    for pat in ${WHEELS[$mod]}; do
      python3 -m pip install -q --no-index --no-deps carry/wheels/$pat.whl >> "$OUT/env.txt" 2>&1
    done
  fi
done
python3 -c "import peft; print('peft', peft.__version__)" >> "$OUT/env.txt" 2>&1
export PYTHONPATH="$PWD/src:$PWD"
if python3 -c "import pytest" 2>/dev/null; then
  LORAPUB_GPU_REPORT="$OUT/report.json" python3 -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" 2>&1 | tail -15
else
  python3 -m tests.gpu.acceptance --device cuda --out "$OUT/report.json" 2>&1 | tail -20
fi
cat "$OUT/env.txt"
