"""The llamaflash conversion pipeline (installed as ``llamaflash.converters``).

``convert(model_path)`` turns a base model GGUF into its sidecar; see
:mod:`llamaflash.converters.pipeline`. The write path is :mod:`.writer`, the FFN re-layout
stage :mod:`.bundle`.
"""

from llamaflash.converters.pipeline import convert

__all__ = ["convert"]
