"""llamaflash: sparse, flash-offloaded FFN inference for GGUF models, as a llama-cpp-python plugin.

    from llamaflash import Llama          # instead of: from llama_cpp import Llama

Importing the package is cheap: it loads neither llama-cpp-python nor the native extension. The
first access to ``Llama``, ``FLASH_MODES`` or ``LlamaflashWarning`` imports :mod:`llamaflash.runtime.llama`,
which loads llama-cpp-python's ggml (through ``llama_cpp``) and then the extension. The llamaflash
ggml backend is registered with ggml when the first model served by llamaflash loads; a model that
runs as stock (no sidecar, or the default measured stock faster on this machine) leaves llama.cpp
untouched.

The extensions ``llamaflash._native`` (and ``llamaflash._native_testing``) link to the
``libggml*.so`` that ``llama_cpp`` ships and must be loaded after ``llama_cpp``: ``from llamaflash
import _native`` (and ``from . import _native`` inside the package) goes through this module's
``__getattr__``, which imports ``llama_cpp`` first.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    BaseModelError,
    LlamaflashError,
    SidecarError,
    SidecarFormatError,
    SidecarMismatchError,
    SidecarNotFoundError,
    SidecarVersionError,
)

__version__ = "0.1.0"

#: Names served by :mod:`llamaflash.runtime.llama`, imported on first access.
_FROM_LLAMA = ("Llama", "FLASH_MODES", "LlamaflashWarning")
#: The extension modules: loaded after ``llama_cpp``.
_EXTENSIONS = ("_native", "_native_testing")

__all__ = [
    "Llama",
    "FLASH_MODES",
    "LlamaflashWarning",
    "LlamaflashError",
    "BaseModelError",
    "SidecarError",
    "SidecarFormatError",
    "SidecarMismatchError",
    "SidecarNotFoundError",
    "SidecarVersionError",
]


def __getattr__(name: str) -> Any:
    if name in _FROM_LLAMA:
        value = getattr(importlib.import_module(".runtime.llama", __name__), name)
        globals()[name] = value
        return value
    if name in _EXTENSIONS:
        import llama_cpp  # noqa: F401  (loads libggml*.so before the extension links to them)

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FROM_LLAMA))
