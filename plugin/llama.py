"""`llamaflash.Llama`: a drop-in replacement for `llama_cpp.Llama` that serves FFN layers from a sidecar.

Layering (as in llama-cpp-python): `llamaflash._native` (C++ core and ggml backend) → this module,
which owns the native FlashModel for the lifetime of the llama.cpp model → the public `Llama`.

Everything `llama_cpp.Llama` accepts and does keeps working. Added keyword arguments:
  sidecar_path   path of the sidecar GGUF; default `<model stem>.flash.gguf` beside the model. With
                 no sidecar the model runs exactly as stock llama-cpp-python (said once, as a warning).
  flash_mode     "dense": the exact dense lane (bit-identical to stock); None / "auto": the best
                 lane available (today: "dense").
  ram_budget_mb  reserved for the flash-offload engine; must be None in this version.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import llama_cpp

from . import _native
from . import gguf_model
from .errors import LlamaflashError, SidecarNotFoundError
from .sidecar import SidecarInfo, default_sidecar_path, validate_pair

FLASH_MODES = ("auto", "dense")


class LlamaflashWarning(UserWarning):
    """Something llamaflash wants the user to know, that does not stop the model from running."""


_warned_no_sidecar = False


def _warn_no_sidecar(model_path: str, expected: Path) -> None:
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


def _resolve_mode(flash_mode: Optional[str]) -> str:
    mode = "auto" if flash_mode is None else flash_mode
    if mode not in FLASH_MODES:
        raise ValueError(f"flash_mode={flash_mode!r} is not supported; use one of {', '.join(FLASH_MODES)} (or None)")
    return "dense" if mode == "auto" else mode


class Llama(llama_cpp.Llama):
    """`llama_cpp.Llama` with the FFN layers served by llamaflash (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        *args: Any,
        sidecar_path: Optional[str] = None,
        flash_mode: Optional[str] = None,
        ram_budget_mb: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        self._flash: Optional[_native.FlashModel] = None
        self._flash_info: Optional[SidecarInfo] = None
        self._flash_sidecar: Optional[Path] = None
        self._flash_mode = _resolve_mode(flash_mode)
        self._flash_args = {"sidecar_path": sidecar_path, "flash_mode": flash_mode, "ram_budget_mb": ram_budget_mb}
        if ram_budget_mb is not None:
            raise ValueError(
                "ram_budget_mb needs the flash-offload engine, which this llamaflash version does not have yet; "
                "pass ram_budget_mb=None (the whole model is kept in memory)"
            )

        sidecar = self._find_sidecar(os.fspath(model_path), sidecar_path)
        if sidecar is None:
            self._flash_mode = "stock"
            super().__init__(model_path, *args, **kwargs)
            return

        # Everything that can be wrong with the files is found here, before llama.cpp starts.
        info = validate_pair(model_path, sidecar)
        flash = _native.FlashModel([layer.to_dict() for layer in info.layers], str(sidecar), os.fspath(model_path))
        flash.load_dense_weights()

        _native.begin_model_load(flash)
        try:
            super().__init__(model_path, *args, **kwargs)
        finally:
            _native.end_model_load()

        expected = 3 * len(info.layers)
        if flash.bound_count != expected:
            self.close()
            raise LlamaflashError(
                f"llama.cpp placed {flash.bound_count} of the {expected} FFN weights of '{model_path}' on the "
                f"llamaflash device; the model cannot be served. Check that llama_cpp was not given tensor "
                f"overrides for FFN weights, or run without a sidecar."
            )
        self._flash = flash
        self._flash_info = info
        self._flash_sidecar = Path(sidecar)

    @staticmethod
    def _find_sidecar(model_path: str, sidecar_path: Optional[str]) -> Optional[Path]:
        base = gguf_model.read_base_model(model_path)
        if sidecar_path is not None:
            path = Path(sidecar_path)
            if not path.exists():
                raise SidecarNotFoundError(
                    f"sidecar '{path}' does not exist; create it with `llamaflash convert {model_path} -o {path}` "
                    f"or leave sidecar_path unset to run without one"
                )
            return path
        if not base.ffn_layers:
            return None  # no classic FFN (e.g. state-space models): pass through untouched
        path = default_sidecar_path(model_path)
        if not path.exists():
            _warn_no_sidecar(model_path, path)
            return None
        return path

    # -- llamaflash additions -------------------------------------------------------------------

    @property
    def flash_mode(self) -> str:
        """The lane in use: "dense", or "stock" when no sidecar is loaded."""
        return self._flash_mode

    def flash_stats(self) -> Dict[str, Any]:
        """Counters since load (or the last reset): layers served, FFN evaluations, tokens, time."""
        stats: Dict[str, Any] = {
            "mode": self._flash_mode,
            "sidecar": str(self._flash_sidecar) if self._flash_sidecar else None,
            "layers_served": 0,
            "ffn_evals": 0,
            "tokens": 0,
            "graph_splits": 0,
            "dense_lane_calls": 0,
            "compute_seconds": 0.0,
            "prepare_seconds": 0.0,
            "resident_ffn_bytes": 0,
        }
        if self._flash is not None:
            stats.update(self._flash.stats())
            stats["layers_served"] = len(self._flash.served_layers)
            stats["resident_ffn_bytes"] = self._flash.resident_bytes
        return stats

    def reset_flash_stats(self) -> None:
        if self._flash is not None:
            self._flash.reset_stats()

    # -- lifetime and pickling ------------------------------------------------------------------

    def close(self) -> None:
        if hasattr(self, "_stack"):  # absent when __init__ refused the input before llama.cpp started
            super().close()
        # after llama.cpp freed its buffers (and with them the registry's references)
        self._flash = None

    def __getstate__(self):
        state = super().__getstate__()
        state.update(self._flash_args)
        return state
