"""llamaflash: sparse, flash-offloaded FFN inference for GGUF models, as a llama-cpp-python plugin.

    from llamaflash import Llama          # instead of: from llama_cpp import Llama

Importing the package loads llama-cpp-python's ggml (through ``llama_cpp``). The llamaflash ggml
backend is registered with it when the first model served by llamaflash loads; a model that runs as
stock (no sidecar, or the default measured stock faster on this machine) leaves llama.cpp untouched.
"""
from __future__ import annotations

import llama_cpp as _llama_cpp  # noqa: F401  (loads libggml*.so before the extension links to them)

from . import _native  # noqa: F401

from .errors import (  # noqa: E402
    BaseModelError,
    LlamaflashError,
    SidecarError,
    SidecarFormatError,
    SidecarMismatchError,
    SidecarNotFoundError,
    SidecarVersionError,
)
from .llama import FLASH_MODES, Llama, LlamaflashWarning  # noqa: E402

__version__ = "0.1.0"

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
