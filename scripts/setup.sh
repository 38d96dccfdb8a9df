#!/usr/bin/env bash
# Sets up a virtual environment in .venv with llamaflash installed (and its test extras).
# llama-cpp-python==0.3.36 compiles llama.cpp on first install (~9 min on 2 cores); pip caches the
# built wheel, so later setups take a minute. Usage: scripts/setup.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install ".[test]"
.venv/bin/python -c "import llamaflash, llama_cpp; print('llamaflash', llamaflash.__version__, 'with llama-cpp-python', llama_cpp.__version__)"
