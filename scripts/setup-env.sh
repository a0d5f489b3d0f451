#!/usr/bin/env bash
# Creates .venv (seeing the system site-packages, so a machine that already has torch
# keeps its own) and installs dfvg into it. torch is pinned to 2.13.0 only when it is
# missing: that version is a local CPU wheel here, while an unpinned torch would pull a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ "$extras" = dev ] && ! command -v verilator >/dev/null; then
  # The RTL tests lint generated Verilog with Verilator (Debian package).
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing verilator (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq verilator >/dev/null
  else
    echo "setup: verilator is missing; install it with: sudo apt-get install -y verilator" >&2
    exit 1
  fi
fi
python3 -m venv --system-site-packages .venv
py=.venv/bin/python
"$py" -m pip install -q --upgrade pip >/dev/null
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "setup: torch not found, installing torch==2.13.0 (CPU)"
  "$py" -m pip install -q torch==2.13.0
fi
"$py" -m pip install -q -e ".${extras:+[$extras]}"
echo "setup: ready ($("$py" -c 'import torch, transformers, amaranth; print("torch", torch.__version__, "| transformers", transformers.__version__, "| amaranth", amaranth.__version__)'))"
