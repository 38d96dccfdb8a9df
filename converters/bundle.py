"""The bundle stage: neuron-major FFN weights of each served layer (sidecar format v1).

For served layer L with neuron order ``order`` (identity unless a previous stage chose a
hot-first order), the stage plans three tensors (see ``docs/SIDECAR.md``):

* ``blk.L.ffn_bundle`` (I8, n_ff × bundle_stride): row k = base gate row order[k] then
  base up row order[k], bytes copied unchanged (lossless, original ggml types), zero
  padded to ``bundle_stride`` (:func:`llamaflash.files.sidecar_format.bundle_stride`);
* ``blk.L.ffn_down_t`` (n_ff × n_embd): row k = base down column order[k], dequantized and
  requantized to Q8_0 (F16 when n_embd is not a multiple of 32);
* ``blk.L.ffn_order`` (I32, n_ff): the order itself;

and appends the layer's entries of the per-layer metadata arrays.
"""

from __future__ import annotations

from collections.abc import Mapping

import gguf
import numpy as np

from llamaflash.converters.writer import PlannedTensor, SidecarPlan
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_model import BaseModelInfo, FfnLayer, read_tensor_rows
from llamaflash.files.sidecar_format import DEFAULT_DOWN_T, DOWN_T_CHOICES


def bundle_stride(ffn: FfnLayer) -> int:
    """Bytes per bundle row of ``ffn`` (see :func:`llamaflash.files.sidecar_format.bundle_stride`)."""
    return fmt.bundle_stride(
        ffn.gate.row_bytes,
        ffn.up.row_bytes,
        gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ffn.gate.ggml_type)][1],
        gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ffn.up.ggml_type)][1],
    )


_NAMED = {
    "f16": gguf.GGMLQuantizationType.F16,
    "q6_k": gguf.GGMLQuantizationType.Q6_K,
    "q5_k": gguf.GGMLQuantizationType.Q5_K,
    "q4_k": gguf.GGMLQuantizationType.Q4_K,
    "q5_0": gguf.GGMLQuantizationType.Q5_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}


def down_t_type(n_embd: int, choice: str = DEFAULT_DOWN_T, base_type: int | None = None) -> gguf.GGMLQuantizationType:
    """ggml type of the stored transposed down (rows of n_embd values) for ``choice`` (see
    :data:`DOWN_T_CHOICES`); a type whose blocks do not divide n_embd falls back to Q8_0, then F16."""
    if choice not in DOWN_T_CHOICES:
        raise ValueError(f"down_t_type {choice!r}: use one of {', '.join(DOWN_T_CHOICES)}")
    wanted = None
    if choice == "base" and base_type is not None:
        wanted = gguf.GGMLQuantizationType(base_type)
    elif choice == "auto":
        wanted = gguf.GGMLQuantizationType.Q4_K
    elif choice in _NAMED:
        wanted = _NAMED[choice]
    if wanted is not None and n_embd % gguf.GGML_QUANT_SIZES[wanted][0] == 0:
        return wanted
    if n_embd % fmt.DOWN_T_Q8_0_BLOCK == 0:
        return gguf.GGMLQuantizationType.Q8_0
    return gguf.GGMLQuantizationType.F16


class BundleStage:
    """Plans the bundle, transposed down and order tensors of every served layer.

    ``orders`` maps a layer index to its neuron order (a permutation of range(n_ff));
    layers not in it get the identity order.
    """

    #: The oldest sidecar format version that can hold what this stage plans.
    min_format_version = 1

    def __init__(self, orders: Mapping[int, np.ndarray] | None = None, down_t: str = DEFAULT_DOWN_T) -> None:
        self._orders = dict(orders or {})
        self._down_t = down_t

    def plan_layer(self, model: BaseModelInfo, ffn: FfnLayer, plan: SidecarPlan) -> None:
        """Add layer ``ffn.layer``'s tensors and per-layer values to ``plan``."""
        order = self._order(ffn)
        stride = bundle_stride(ffn)
        dt_type = down_t_type(ffn.n_embd, self._down_t, ffn.down.ggml_type)

        plan.append_layer_value(fmt.KEY_N_FF, ffn.n_ff)
        plan.append_layer_value(fmt.KEY_GATE_TYPES, ffn.gate.ggml_type)
        plan.append_layer_value(fmt.KEY_UP_TYPES, ffn.up.ggml_type)
        plan.append_layer_value(fmt.KEY_DOWN_TYPES, ffn.down.ggml_type)
        plan.append_layer_value(fmt.KEY_DOWN_T_TYPES, int(dt_type))
        plan.append_layer_value(fmt.KEY_BUNDLE_STRIDES, stride)

        plan.add_tensor(
            PlannedTensor(
                name=fmt.bundle_tensor_name(ffn.layer),
                ggml_type=gguf.GGMLQuantizationType.I8,
                shape=(ffn.n_ff, stride),
                produce=lambda: build_bundle(model, ffn, order, stride),
                layer=ffn.layer,
            )
        )
        plan.add_tensor(
            PlannedTensor(
                name=fmt.down_t_tensor_name(ffn.layer),
                ggml_type=dt_type,
                shape=(ffn.n_ff, ffn.n_embd),
                produce=lambda: build_down_t(model, ffn, order, dt_type),
                layer=ffn.layer,
            )
        )
        plan.add_tensor(
            PlannedTensor(
                name=fmt.order_tensor_name(ffn.layer),
                ggml_type=gguf.GGMLQuantizationType.I32,
                shape=(ffn.n_ff,),
                produce=lambda: order,
                layer=ffn.layer,
            )
        )

    def _order(self, ffn: FfnLayer) -> np.ndarray:
        order = self._orders.get(ffn.layer)
        if order is None:
            return np.arange(ffn.n_ff, dtype=np.int32)
        order = np.asarray(order, dtype=np.int32)
        if order.shape != (ffn.n_ff,) or not np.array_equal(np.sort(order), np.arange(ffn.n_ff)):
            raise ValueError(f"layer {ffn.layer}: neuron order is not a permutation of range({ffn.n_ff})")
        return order


def build_bundle(model: BaseModelInfo, ffn: FfnLayer, order: np.ndarray, stride: int) -> np.ndarray:
    """The bundle of ``ffn`` as an int8 array (n_ff, stride); see the module docstring."""
    gate = read_tensor_rows(model.path, ffn.gate)
    up = read_tensor_rows(model.path, ffn.up)
    g, u = ffn.gate.row_bytes, ffn.up.row_bytes
    rows = np.zeros((ffn.n_ff, stride), dtype=np.uint8)
    rows[:, :g] = gate[order]
    rows[:, g : g + u] = up[order]
    return rows.view(np.int8)


def build_down_t(
    model: BaseModelInfo, ffn: FfnLayer, order: np.ndarray, dtype: gguf.GGMLQuantizationType
) -> np.ndarray:
    """The transposed, reordered, requantized down of ``ffn``: ``dtype`` data of logical
    shape (n_ff, n_embd) (raw block bytes for Q8_0)."""
    raw = np.asarray(read_tensor_rows(model.path, ffn.down))
    down = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ffn.down.ggml_type))  # (n_embd, n_ff)
    down_t = np.ascontiguousarray(down.reshape(ffn.n_embd, ffn.n_ff).T[order], dtype=np.float32)
    if dtype in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0):
        return gguf.quants.quantize(down_t, dtype)
    from llamaflash import _native  # ggml's own quantizer: gguf-py has none for K-quants

    return _native.quantize_rows(int(dtype), down_t)
