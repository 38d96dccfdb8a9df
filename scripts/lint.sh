#!/usr/bin/env bash
# Format and lint: ruff (Python: lint rules and formatter configured in pyproject.toml) and clang-format
# (C++: .clang-format), both pinned below and installed from PyPI into .venv. Without arguments it
# checks and fails on any difference (what .ci/run runs); `--fix` applies the formatters and the safe
# lint fixes in place.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.6
CLANG_FORMAT_VERSION=23.1.5
[ -x .venv/bin/python ] || { echo "lint: no .venv here; run scripts/setup.sh first" >&2; exit 2; }
if ! .venv/bin/ruff --version 2>/dev/null | grep -qx "ruff $RUFF_VERSION" ||
   ! .venv/bin/clang-format --version 2>/dev/null | grep -q "version $CLANG_FORMAT_VERSION"; then
  .venv/bin/python -m pip install -q "ruff==$RUFF_VERSION" "clang-format==$CLANG_FORMAT_VERSION"
fi
mapfile -t CXX < <(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'bench/*.cpp' 'tests/*.cpp')
if [ "${1:-}" = "--fix" ]; then
  .venv/bin/ruff check --fix .
  .venv/bin/ruff format .
  .venv/bin/clang-format -i "${CXX[@]}"
else
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  .venv/bin/clang-format --dry-run --Werror "${CXX[@]}"
fi
