"""What `llamaflash.Llama`'s own keyword arguments accept and mean: type and range checks, the
flash mode, and the sparsity levels a sidecar was calibrated for (used by plugin/runtime/llama.py)."""

from __future__ import annotations

import difflib
import inspect
import math
import os
from typing import Any, Dict, Optional

import llama_cpp

from ..files.sidecar import SidecarInfo
from .flash_io import ENGINES

FLASH_MODES = ("auto", "dense", "sparse")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_argument_types(
    sidecar_path,
    flash_sparsity,
    flash_max_sparse_tokens,
    flash_dense_up,
    ram_budget_mb,
    flash_io_engine,
    flash_stream_gate,
    flash_draft_copy=None,
    flash_verify=True,
) -> None:
    """Every llamaflash argument's type and range, before anything is read: a ValueError naming the
    argument, the value given and what is accepted."""
    if sidecar_path is not None and not isinstance(sidecar_path, (str, os.PathLike)):
        raise ValueError(f"sidecar_path={sidecar_path!r} must be a path (str or os.PathLike) or None")
    if ram_budget_mb is not None and not (_is_number(ram_budget_mb) and ram_budget_mb > 0):
        raise ValueError(
            f"ram_budget_mb={ram_budget_mb!r} must be a positive, finite number of MiB (e.g. 900), "
            f"or None for no budget"
        )
    if flash_sparsity is not None and not (_is_number(flash_sparsity) and 0 <= flash_sparsity < 1):
        raise ValueError(
            f"flash_sparsity={flash_sparsity!r} must be a number in [0, 1) (a level the converter "
            f"calibrated, e.g. 0.3), or None for the sidecar's operating point"
        )
    if (
        isinstance(flash_max_sparse_tokens, bool)
        or not isinstance(flash_max_sparse_tokens, int)
        or flash_max_sparse_tokens < 1
    ):
        raise ValueError(f"flash_max_sparse_tokens={flash_max_sparse_tokens!r} must be an integer >= 1")
    for name, value in (
        ("flash_dense_up", flash_dense_up),
        ("flash_stream_gate", flash_stream_gate),
        ("flash_draft_copy", flash_draft_copy),
    ):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be True, False or None")
    if not isinstance(flash_verify, bool):
        raise ValueError(
            f"flash_verify={flash_verify!r} must be True (check what is read against the sidecar's checksums) or False"
        )
    if flash_io_engine not in ENGINES:
        raise ValueError(f"flash_io_engine={flash_io_engine!r} must be one of {', '.join(ENGINES)}")


#: llamaflash.Llama's own keyword arguments (beside llama_cpp.Llama's).
LLAMAFLASH_KEYWORDS = (
    "sidecar_path",
    "flash_mode",
    "flash_sparsity",
    "flash_max_sparse_tokens",
    "flash_dense_up",
    "ram_budget_mb",
    "flash_io_engine",
    "flash_stream_gate",
    "flash_disk_profile",
    "flash_speculative",
    "flash_batch_invariant",
    "flash_draft_copy",
    "flash_verify",
    "flash_expert_slots",
    "deterministic",
    "flash_prompt_tokens",
)


def _llama_cpp_keywords() -> tuple:
    params = inspect.signature(llama_cpp.Llama.__init__).parameters
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(n for n, p in params.items() if n != "self" and p.kind in named)


def known_keywords() -> frozenset:
    """Every keyword argument llamaflash.Llama takes: llama_cpp.Llama's and its own (empty when
    llama_cpp.Llama.__init__ names no parameters, e.g. replaced by a test double: nothing is known)."""
    own = _llama_cpp_keywords()
    return frozenset(own) | frozenset(LLAMAFLASH_KEYWORDS) if own else frozenset()


def _check_known_keywords(kwargs: Dict[str, Any]) -> None:
    """llama_cpp.Llama accepts and ignores unknown keyword arguments, so a misspelt setting
    (ram_budget=900) would silently run without it: a TypeError naming the closest valid one."""
    known = known_keywords()
    if not known:
        return
    for name in kwargs:
        if name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else " (see help(llamaflash.Llama) for the accepted ones)"
        raise TypeError(f"Llama() got an unexpected keyword argument '{name}'{hint}")


def _check_deterministic(deterministic, flash_batch_invariant, flash_max_sparse_tokens, kwargs) -> None:
    """deterministic=True needs the batch-invariant numerics (plain weights, flash attention) and
    batches of up to MAX_ROWS tokens on one lane: a ValueError for settings that contradict them."""
    from .eval_shapes import MAX_ROWS

    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic={deterministic!r} must be True or False")
    if not deterministic:
        return
    if flash_batch_invariant is False:
        raise ValueError(
            "deterministic=True computes every row with batch-invariant numerics; "
            "leave flash_batch_invariant unset (or True)"
        )
    if kwargs.get("flash_attn") is False:
        raise ValueError(
            "deterministic=True needs flash attention (its rows are batch-invariant up to 7 rows); "
            "leave flash_attn unset or pass flash_attn=True"
        )
    if flash_max_sparse_tokens is not None and flash_max_sparse_tokens < MAX_ROWS:
        raise ValueError(
            f"deterministic=True evaluates batches of up to {MAX_ROWS} tokens, all on one lane: "
            f"flash_max_sparse_tokens={flash_max_sparse_tokens} would send some rows to another; "
            f"leave it unset or give >= {MAX_ROWS}"
        )
    for name in ("n_batch", "n_ubatch"):
        value = kwargs.get(name)
        if value is not None and value < MAX_ROWS:
            raise ValueError(
                f"deterministic=True evaluates batches of up to {MAX_ROWS} tokens: {name}={value} would "
                f"split them; leave it unset or give >= {MAX_ROWS}"
            )


def deterministic_kv_type(header) -> Optional[int]:
    """deterministic=True's KV cache type where the caller gives none: q8_0
    (eval_shapes.DETERMINISTIC_KV_TYPE) where every K and V head row is a whole number of q8_0 blocks
    (32 values; llama.cpp refuses the context otherwise), else None (f16: lone rows past 256 positions
    then get a filler row). ``header``: the base model's parsed GGUF header."""
    from .eval_shapes import DETERMINISTIC_KV_TYPE

    def scalar(key: str):
        v = header.metadata.get(key) if header is not None else None
        return None if v is None else v.value  # an array's value is None

    arch = scalar("general.architecture")
    n_embd, n_head = scalar(f"{arch}.embedding_length"), scalar(f"{arch}.attention.head_count")
    k = scalar(f"{arch}.attention.key_length") or (n_embd // n_head if n_embd and n_head else None)
    v = scalar(f"{arch}.attention.value_length") or k
    if not k or not v or int(k) % 32 or int(v) % 32:
        return None
    return DETERMINISTIC_KV_TYPE


#: ggml types (ids of ggml.h) whose matmuls llamafile's tinyBLAS computes from 2 rows on, where one row
#: takes ggml's vec_dot (other bits): F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, BF16.
TINYBLAS_TYPES = frozenset({0, 1, 2, 3, 6, 7, 8, 20, 30})


def tinyblas_matrix(header, per_row: frozenset = frozenset()) -> Optional[str]:
    """The name of the first matrix the model multiplies by whose type tinyBLAS takes from 2 rows on
    (a router in f32, an f16 or q8_0 projection), else None. The token table counts only where it is
    also the output matrix (no output.weight); matrices in ``per_row`` (llamaflash computes every row
    of them as a lone row) do not count. Where there is one, a row alone and the same row in a batch
    get other bits, so batch-invariant evaluation never decodes a row alone."""
    if header is None:
        return None
    names = {t.name for t in header.tensors}
    for t in header.tensors:
        if sum(1 for d in t.shape if d > 1) < 2 or t.ggml_type not in TINYBLAS_TYPES or t.name in per_row:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # read by rows (get_rows), not multiplied
        return t.name
    return None


def _resolve_mode(flash_mode: Optional[str]) -> str:
    mode = "auto" if flash_mode is None else flash_mode
    if mode not in FLASH_MODES:
        raise ValueError(f"flash_mode={flash_mode!r} is not supported; use one of {', '.join(FLASH_MODES)} (or None)")
    return mode


#: flash_dense_up=None: up·x for every neuron by ggml while the level's sparsity is below this (measured
#: on Qwen2.5-1.5B, 2 threads: ggml's repacked GEMV streams the whole up matrix faster than the
#: kernel's per-row dots of 25-70% of its rows).
DENSE_UP_MAX_SPARSITY = 0.75


def _level_sparsity(info: SidecarInfo, level: Optional[float]) -> float:
    if level is not None:
        return float(level)
    return float(info.sparsity.target) if info.sparsity is not None else 0.0


def _has_sparsity(info: SidecarInfo) -> bool:
    """Whether the sidecar gives the sparse lane something to skip."""
    if info.sparsity is None:
        return False
    return info.activation == "relu" or info.sparsity.target > 0


def sparsity_thresholds(info: SidecarInfo, level: Optional[float]) -> list:
    """Per served layer, the thresholds of `level` (None: the sidecar's operating point; 0: exact
    zeros only). Raises ValueError naming the levels the sidecar has."""
    if info.sparsity is None:
        raise ValueError(
            f"sidecar '{info.path}' is format {info.format_version} and has no sparsity thresholds; "
            f"re-convert it with `llamaflash convert` (format 2) to use the sparse lane"
        )
    if level is None:
        return [float(layer.threshold) for layer in info.layers]
    if level == 0:
        return [0.0 for _ in info.layers]
    levels = info.sparsity.threshold_levels or ()
    for i, v in enumerate(levels):
        if abs(v - level) < 1e-4:
            return [float(layer.threshold_table[i]) for layer in info.layers]
    if abs(info.sparsity.target - level) < 1e-4:
        return [float(layer.threshold) for layer in info.layers]
    have = ", ".join(f"{v:g}" for v in levels) or f"{info.sparsity.target:g} only"
    raise ValueError(
        f"flash_sparsity={level} was not calibrated in '{info.path}' (levels: {have}); "
        f"pick one of those or re-convert with `--sparsity {level}`"
    )
