#!/usr/bin/env bash
# Creates .venv (seeing the system site-packages, so a machine that already has torch
# keeps its own) and installs dfvg into it. torch is pinned to 2.13.0 only when it is
# missing: that version is a local CPU wheel here, while an unpinned torch would pull a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv --system-site-packages .venv
py=.venv/bin/python
"$py" -m pip install -q --upgrade pip >/dev/null
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "setup: torch not found, installing torch==2.13.0 (CPU)"
  "$py" -m pip install -q torch==2.13.0
fi
"$py" -m pip install -q -e ".${extras:+[$extras]}"
echo "setup: ready ($("$py" -c 'import torch, transformers, amaranth; print("torch", torch.__version__, "| transformers", transformers.__version__, "| amaranth", amaranth.__version__)'))"
