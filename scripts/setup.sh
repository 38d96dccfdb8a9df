#!/usr/bin/env bash
# Sets up a virtual environment in .venv with llamaflash installed (and its test extras).
# llama-cpp-python==0.3.36 compiles llama.cpp on first install (~9 min on 2 cores); pip caches the
# built wheel, so later setups take a minute. Usage: scripts/setup.sh [python]
#
# LLAMAFLASH_BUILD_CACHE (optional): directory for build-time downloads (ggml headers); default
# ~/.cache/llamaflash. .ci/run points it at an empty temporary directory on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
LLAMA_CPP_PYTHON_VERSION=0.3.36

# Preflight, before the long compile: a C++ compiler, and the ggml headers the plugin is compiled
# against (downloaded here once, so a missing network fails in seconds, not after 9 minutes).
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then
  echo "llamaflash setup: no C++ compiler found (c++ / g++). Install one, e.g. 'apt-get install g++'." >&2
  exit 1
fi
if ! "$PY" -c 'import venv' >/dev/null 2>&1; then
  echo "llamaflash setup: '$PY' has no venv module. Install it, e.g. 'apt-get install python3-venv'." >&2
  exit 1
fi
CACHE="${LLAMAFLASH_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llamaflash}"
echo "[setup] ggml headers of llama-cpp-python $LLAMA_CPP_PYTHON_VERSION -> $CACHE"
"$PY" cmake/fetch_ggml_headers.py "$LLAMA_CPP_PYTHON_VERSION" "$CACHE/ggml-headers-$LLAMA_CPP_PYTHON_VERSION"

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# AMX: llama.cpp built with -march=native on a CPU with AMX compiles ggml-cpu's AMX kernels, and those
# of this pinned version crash with "Illegal instruction" on their first tile load (the tile
# configuration is built on the stack and optimised away; upstream llama.cpp PR 26954). On such a CPU
# llama.cpp is compiled without AMX (every other native instruction set kept): explicit -mno-amx-*
# flags win over -march=native whatever their order. A wheel pip cached from an AMX build is rebuilt.
NO_AMX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if echo | "${CXX:-c++}" -march=native -dM -E -x c++ - 2>/dev/null | grep -q __AMX_INT8__; then
  echo "[setup] this CPU has AMX: llama.cpp is compiled without its AMX kernels ($NO_AMX_FLAGS)"
  export CFLAGS="${CFLAGS:-} $NO_AMX_FLAGS" CXXFLAGS="${CXXFLAGS:-} $NO_AMX_FLAGS"
fi
has_amx_build() {
  .venv/bin/python -c "import llama_cpp, sys; sys.exit(0 if b'AMX_INT8 = 1' in llama_cpp.llama_print_system_info() else 1)" 2>/dev/null
}
if ! .venv/bin/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON_VERSION')" >/dev/null 2>&1 || has_amx_build; then
  echo "[setup] installing llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (compiles llama.cpp once: ~9 min on 2 cores; cached by pip afterwards)"
  .venv/bin/python -m pip install -q "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  if has_amx_build; then
    echo "[setup] pip's cached llama-cpp-python wheel has the AMX kernels: rebuilding it without them"
    .venv/bin/python -m pip cache remove llama_cpp_python >/dev/null 2>&1 || true  # pip may run without a cache
    .venv/bin/python -m pip install -q --force-reinstall --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  fi
fi
echo "[setup] building and installing llamaflash"
LLAMAFLASH_BUILD_CACHE="$CACHE" .venv/bin/python -m pip install ".[test]"
.venv/bin/python -c "import llamaflash, llama_cpp; print('llamaflash', llamaflash.__version__, 'with llama-cpp-python', llama_cpp.__version__)"
