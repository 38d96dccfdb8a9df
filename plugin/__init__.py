"""llamaflash: sparse, flash-offloaded FFN inference for GGUF models, as a llama-cpp-python plugin.

    from llamaflash import Llama          # instead of: from llama_cpp import Llama

Importing the package loads llama-cpp-python's ggml (through ``llama_cpp``) and registers the
llamaflash ggml backend with it, so it must be imported before models are loaded.
"""
from __future__ import annotations

import llama_cpp as _llama_cpp  # noqa: F401  (loads libggml*.so before the extension links to them)

from . import _native

_native.register_backend()

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
