"""What `llamaflash.Llama` tells the user while loading, without stopping: :class:`LlamaflashWarning`
once per process for a model without a sidecar and once per sidecar without checksums, and one stderr
line per distinct message for the lane a default chose."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from ..files.sidecar import SidecarInfo


class LlamaflashWarning(UserWarning):
    """Something llamaflash wants the user to know, that does not stop the model from running."""


_warned_no_sidecar = False


def warn_no_sidecar(model_path: str, expected: Path) -> None:
    global _warned_no_sidecar
    if _warned_no_sidecar:
        return
    _warned_no_sidecar = True
    warnings.warn(
        f"llamaflash: no sidecar for '{model_path}' (looked for '{expected}'); running as stock "
        f"llama-cpp-python without acceleration. Create one with `llamaflash convert {model_path}`.",
        LlamaflashWarning,
        stacklevel=3,
    )


_said: set = set()
_warned_unchecked: set = set()


def warn_unchecked(info: SidecarInfo, model_path: str) -> None:
    """Once per sidecar per process: a sidecar without checksums is served unchecked."""
    key = str(info.path)
    if key in _warned_unchecked:
        return
    _warned_unchecked.add(key)
    warnings.warn(
        f"llamaflash: sidecar '{info.path}' (format {info.format_version}) has no checksums, so the weights read "
        f"from it and from the model are not verified; `llamaflash convert {model_path} --force` re-creates it "
        f"with them",
        LlamaflashWarning,
        stacklevel=4,
    )


def say_once(message: str) -> None:
    """One line on stderr per distinct message per process (the default lane's decision)."""
    if message not in _said:
        _said.add(message)
        print(message, file=sys.stderr)
