#!/usr/bin/env bash
# Developer loop: reinstall llamaflash into .venv from this checkout after an edit (no dependency
# resolution, no build isolation: reuses the venv's build tools and the incremental build tree in
# build/). Serialized with a lock so that several shells editing the tree never install at once.
# Needs a .venv made by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/llamaflash-dev-install.lock \
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation .
