"""The draft-copy stage: a compact low-bit copy of every served neuron's up and down_t rows.

Under a RAM budget a speculative self-draft may only use what is resident (it must never wait for
flash). The draft copy lets it compute every neuron, from fewer bits: per served layer L with neuron
order ``order``, two tensors of type ``draft_types[L]`` (see ``docs/SIDECAR.md``, "Draft copy"):

* ``blk.L.ffn_draft_up``     (n_ff × n_embd): row k = base up row order[k], dequantized and requantized;
* ``blk.L.ffn_draft_down_t`` (n_ff × n_embd): row k = base down column order[k], likewise;
* ``blk.L.ffn_draft_crc`` (I32, n_ff × 2): the CRC-32C of each row of the two (the integrity section's
  algorithm), checked when the engine loads the copy;

Only drafts read them; verified tokens never do, so the copy costs memory and conversion time, not
quality. Qwen2.5-1.5B Q4_K_M with Q2_K: 504 B per row, 2 x 28 x 8960 rows = 253 MB (the up/down_t rows
the engine serves from flash are 864 + 864 B).
"""

from __future__ import annotations

import gguf
import numpy as np

from llamaflash.converters.integrity import row_checksums
from llamaflash.converters.writer import PlannedTensor, SidecarPlan
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_model import BaseModelInfo, FfnLayer, read_tensor_rows

_Q = gguf.GGMLQuantizationType
_NAMED = {"q2_k": _Q.Q2_K, "q3_k": _Q.Q3_K, "q4_k": _Q.Q4_K, "q4_0": _Q.Q4_0}


def draft_type(n_embd: int, choice: str = fmt.DEFAULT_DRAFT) -> gguf.GGMLQuantizationType | None:
    """The draft copy's ggml type for rows of ``n_embd`` values under ``choice`` (one of
    :data:`~llamaflash.files.sidecar_format.DRAFT_CHOICES`); None: no draft copy. Raises ValueError for an
    unknown choice or a named type whose blocks do not divide n_embd."""
    if choice not in fmt.DRAFT_CHOICES:
        raise ValueError(f"draft_type {choice!r}: use one of {', '.join(fmt.DRAFT_CHOICES)}")
    if choice == "none":
        return None
    if choice == "auto":
        for t in (_Q.Q2_K, _Q.Q4_0):
            if n_embd % gguf.GGML_QUANT_SIZES[t][0] == 0:
                return t
        return None
    wanted = _NAMED[choice]
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    if n_embd % block:
        raise ValueError(
            f"draft_type {choice!r}: its {block}-value blocks do not divide n_embd {n_embd}; "
            f"use --draft-type auto or a type with smaller blocks (q4_0)"
        )
    return wanted


class DraftCopyStage:
    """Plans the draft copy of every served layer (nothing, not even the key, when the type is None)."""

    min_format_version = fmt.SPARSITY_FORMAT_VERSION

    def __init__(self, orders: dict[int, np.ndarray] | None, dtype: gguf.GGMLQuantizationType) -> None:
        self._orders = dict(orders or {})
        self._dtype = dtype

    def plan_layer(self, model: BaseModelInfo, ffn: FfnLayer, plan: SidecarPlan) -> None:
        order = self._orders.get(ffn.layer)
        order = np.arange(ffn.n_ff, dtype=np.int32) if order is None else np.asarray(order, dtype=np.int32)
        dtype = self._dtype
        plan.append_layer_value(fmt.KEY_DRAFT_TYPES, int(dtype))
        plan.add_tensor(
            PlannedTensor(
                name=fmt.draft_up_tensor_name(ffn.layer),
                ggml_type=dtype,
                shape=(ffn.n_ff, ffn.n_embd),
                produce=lambda: build_draft_up(model, ffn, order, dtype),
                layer=ffn.layer,
            )
        )
        plan.add_tensor(
            PlannedTensor(
                name=fmt.draft_down_t_tensor_name(ffn.layer),
                ggml_type=dtype,
                shape=(ffn.n_ff, ffn.n_embd),
                produce=lambda: build_draft_down_t(model, ffn, order, dtype),
                layer=ffn.layer,
            )
        )
        # row checksums of the very bytes written (the integrity section's algorithm)
        seen: dict[int, np.ndarray] = {}
        for column, name in enumerate((fmt.draft_up_tensor_name(ffn.layer), fmt.draft_down_t_tensor_name(ffn.layer))):
            plan.observe_tensor(
                name,
                lambda data, column=column, n=ffn.n_ff: seen.__setitem__(column, row_checksums(data.reshape(n, -1))),
            )

        def table() -> np.ndarray:
            if len(seen) != 2:
                raise RuntimeError(f"layer {ffn.layer}: draft copy not written before its checksums")
            return np.stack([seen[0], seen[1]], axis=1).astype(np.uint32).view(np.int32)

        plan.add_tensor(
            PlannedTensor(
                name=fmt.draft_checksum_tensor_name(ffn.layer),
                ggml_type=gguf.GGMLQuantizationType.I32,
                shape=(ffn.n_ff, 2),
                produce=table,
                layer=ffn.layer,
            )
        )


def _requantize(rows: np.ndarray, dtype: gguf.GGMLQuantizationType) -> np.ndarray:
    from llamaflash import _native  # ggml's own quantizer: gguf-py has none for K-quants

    return _native.quantize_rows(int(dtype), np.ascontiguousarray(rows, dtype=np.float32))


def build_draft_up(
    model: BaseModelInfo, ffn: FfnLayer, order: np.ndarray, dtype: gguf.GGMLQuantizationType
) -> np.ndarray:
    """The draft up rows of ``ffn`` (n_ff, n_embd) in ``dtype``, bundle order."""
    raw = np.asarray(read_tensor_rows(model.path, ffn.up))
    up = gguf.quants.dequantize(raw, _Q(ffn.up.ggml_type)).reshape(ffn.n_ff, ffn.n_embd)
    return _requantize(up[order], dtype)


def build_draft_down_t(
    model: BaseModelInfo, ffn: FfnLayer, order: np.ndarray, dtype: gguf.GGMLQuantizationType
) -> np.ndarray:
    """The draft down_t rows of ``ffn`` (n_ff, n_embd) in ``dtype``, bundle order."""
    raw = np.asarray(read_tensor_rows(model.path, ffn.down))
    down = gguf.quants.dequantize(raw, _Q(ffn.down.ggml_type)).reshape(ffn.n_embd, ffn.n_ff)
    return _requantize(down.T[order], dtype)
