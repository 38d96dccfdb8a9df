#!/usr/bin/env bash
# Builds stock llama-cli, llama-server, llama-bench (and llama-completion) from the llama.cpp source
# inside the pinned llama-cpp-python sdist, linked against the wheel's own libllama / libggml in
# .venv (cmake/llama_tools/CMakeLists.txt: no second llama.cpp compile). Prints the bin directory.
#
# Usage: scripts/build_llama_tools.sh [-jN]   (default -j2)
# Where: $LLAMAFLASH_TOOLS_CACHE (default ~/.cache/llamaflash, as the model cache: not
# $XDG_CACHE_HOME, which the test session points at a fresh directory)/llama-tools-<version>/{src,build}.
# A finished build is reused while its stamp matches: the sha256 of the wheel's libllama.so and of
# this script and cmake/llama_tools/CMakeLists.txt. Like pip's wheel cache it holds a build of pinned
# third-party sources (test fixtures, not llamaflash), so CI keeps it across runs (a fresh build takes
# ~25 min on 2 shared cores); delete the directory to redo it.
# LLAMAFLASH_LLAMA_CPP_SDIST: a local copy of the sdist (.tar.gz) to use instead of downloading it.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS="${1:--j2}"
VERSION=0.3.36
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  echo "build_llama_tools: no .venv here; run scripts/setup.sh first" >&2
  exit 1
fi
CACHE="${LLAMAFLASH_TOOLS_CACHE:-$HOME/.cache/llamaflash}"
ROOT="$CACHE/llama-tools-$VERSION"
LIB_DIR="$("$PY" -c 'import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))')"
STAMP="$ROOT/build/bin/.built-against"
WANT="$(cat "$LIB_DIR/libllama.so" scripts/build_llama_tools.sh cmake/llama_tools/CMakeLists.txt | sha256sum | cut -d' ' -f1) $LIB_DIR"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$ROOT/build/bin/llama-server" ]; then
  echo "$ROOT/build/bin"
  exit 0
fi

SRC="$ROOT/src/llama.cpp"
if [ ! -f "$SRC/include/llama.h" ]; then
  echo "[build_llama_tools] llama.cpp source of llama-cpp-python $VERSION -> $SRC" >&2
  "$PY" - "$VERSION" "$ROOT/src" <<'PYEOF'
import os, sys, tarfile, tempfile
from pathlib import Path
sys.path.insert(0, "bench/lab")
import llama_sdist  # standard library only; verifies the sdist's sha256

version, dest = sys.argv[1], Path(sys.argv[2])
with tempfile.TemporaryDirectory() as tmp:
    sdist = llama_sdist.obtain_sdist(version, Path(tmp), local=os.environ.get("LLAMAFLASH_LLAMA_CPP_SDIST"))
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    staging = dest.with_name(dest.name + ".partial")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = "llama.cpp/" + m.name[len(prefix):]
        tar.extractall(staging, members=members, filter="data")
    staging.rename(dest)
PYEOF
fi

echo "[build_llama_tools] configuring and building ($JOBS) against $LIB_DIR" >&2
# the build directory is shared by every checkout (CI clones elsewhere): a cache configured from another
# source directory is dropped (CMake refuses it), the objects stay
rm -rf "$ROOT/build/CMakeCache.txt" "$ROOT/build/CMakeFiles"
cmake -S cmake/llama_tools -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_SRC="$SRC" -DLLAMA_LIB_DIR="$LIB_DIR" >"$ROOT/configure.log" 2>&1 \
  || { tail -30 "$ROOT/configure.log" >&2; exit 1; }
cmake --build "$ROOT/build" "$JOBS" --target llama-cli llama-server llama-bench llama-completion >"$ROOT/build.log" 2>&1 \
  || { grep -m20 -B2 -A8 "error" "$ROOT/build.log" >&2 || tail -30 "$ROOT/build.log" >&2; exit 1; }
echo "$WANT" >"$STAMP"
echo "$ROOT/build/bin"
