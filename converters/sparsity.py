"""The sparsity stage (sidecar format v2): what the converter decided for each served layer.

From a layer's :class:`~llamaflash.converters.analysis.LayerAnalysis` and the chosen operating
point, :func:`decide_layer` makes a :class:`LayerDecision`: the threshold, the neuron order and
the per-neuron statistics. :class:`SparsityStage` (a
:class:`~llamaflash.converters.pipeline.ConverterStage`) then plans, per served layer, the tensors
``blk.L.ffn_freq`` and ``blk.L.ffn_mag`` and the per-layer metadata arrays; the same orders go to
the :class:`~llamaflash.converters.bundle.BundleStage`, so bundles, down_t rows and statistics
share one order.

Selection is gate-first in every layer (gate rows of all n_ff neurons, then up and down_t rows of
the active ones: exact). The retired per-layer selection and predictor arrays that formats 2 and 3
require are written with their "gate-first, no predictor" values
(:data:`~llamaflash.files.sidecar_format.LEGACY_SELECTION_VALUES`) so that older readers accept the file;
this reader ignores them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import gguf
import numpy as np

from llamaflash.converters.analysis import LayerAnalysis, hot_first_order
from llamaflash.converters.bundle import DEFAULT_DOWN_T, down_t_type
from llamaflash.converters.writer import PlannedTensor, SidecarPlan
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_model import BaseModelInfo, FfnLayer, ggml_row_bytes


@dataclass
class LayerDecision:
    """Everything the sidecar records for one served layer (arrays in *bundle* order)."""

    layer: int
    level: float  # target sparsity of the operating point
    threshold: float
    sparsity: float  # reached on held-out calibration tokens
    ffn_rel_error: float  # gate-first, held-out
    order: np.ndarray  # int32 (n_ff,): base neuron at bundle position k
    freq: np.ndarray  # float32 (n_ff,), non-increasing
    mag: np.ndarray  # float32 (n_ff,)
    bytes_gate: float = 0.0  # expected bytes per token read by gate-first selection


def layer_bytes(ffn: FfnLayer, down_t: str = DEFAULT_DOWN_T) -> dict[str, int]:
    """Row sizes of ``ffn`` that gate-first selection reads: gate, up and down_t rows."""
    return {
        "gate": ffn.gate.row_bytes,
        "up": ffn.up.row_bytes,
        "down_t": ggml_row_bytes(int(down_t_type(ffn.n_embd, down_t, ffn.down.ggml_type)), ffn.n_embd),
    }


def decide_layer(
    an: LayerAnalysis,
    ffn: FfnLayer,
    level: float,
    bundle_order: str = fmt.BUNDLE_ORDER_BASE,
    down_t: str = DEFAULT_DOWN_T,
) -> LayerDecision:
    """The decision for ``an`` at operating point ``level`` (one of ``an.levels``); bundles in
    ``bundle_order`` ("base": identity, "hot": most frequently active first)."""
    i = an.level_index(level)
    if bundle_order == fmt.BUNDLE_ORDER_HOT:
        order = hot_first_order(an.freq[i], an.mag)
    elif bundle_order == fmt.BUNDLE_ORDER_BASE:
        order = np.arange(an.n_ff, dtype=np.int32)
    else:
        raise ValueError(f"unknown bundle order {bundle_order!r}")
    rows = layer_bytes(ffn, down_t)
    active = 1.0 - an.sparsity_heldout[i]
    bytes_gate = an.n_ff * rows["gate"] + active * an.n_ff * (rows["up"] + rows["down_t"])
    return LayerDecision(
        layer=an.layer,
        level=float(level),
        threshold=float(an.thresholds[i]),
        sparsity=float(an.sparsity_heldout[i]),
        ffn_rel_error=float(an.ffn_error[i]),
        order=order,
        freq=an.freq[i][order].astype(np.float32),
        mag=an.mag[order].astype(np.float32),
        bytes_gate=float(bytes_gate),
    )


class SparsityStage:
    """Plans the v2 per-layer content from ``decisions`` (layer index → :class:`LayerDecision`)."""

    min_format_version = fmt.SPARSITY_FORMAT_VERSION

    def __init__(self, decisions: Mapping[int, LayerDecision]) -> None:
        self._decisions = dict(decisions)

    @property
    def orders(self) -> dict[int, np.ndarray]:
        """The neuron orders, for the :class:`~llamaflash.converters.bundle.BundleStage`."""
        return {layer: d.order for layer, d in self._decisions.items()}

    def plan_layer(self, model: BaseModelInfo, ffn: FfnLayer, plan: SidecarPlan) -> None:
        d = self._decisions[ffn.layer]
        if d.order.shape != (ffn.n_ff,) or d.freq.shape != (ffn.n_ff,) or d.mag.shape != (ffn.n_ff,):
            raise ValueError(f"layer {ffn.layer}: decision arrays do not have n_ff={ffn.n_ff} entries")
        plan.append_layer_float(fmt.KEY_THRESHOLDS, d.threshold)
        plan.append_layer_float(fmt.KEY_SPARSITY_REACHED, d.sparsity)
        plan.append_layer_float(fmt.KEY_FFN_REL_ERROR, d.ffn_rel_error)
        for key, value in fmt.LEGACY_SELECTION_VALUES.items():  # required by older readers, ignored here
            if key in fmt.LEGACY_PER_LAYER_UINT_KEYS:
                plan.append_layer_value(key, value)
            else:
                plan.append_layer_float(key, value)

        f32 = gguf.GGMLQuantizationType.F32
        freq, mag = d.freq.astype(np.float32), d.mag.astype(np.float32)
        plan.add_tensor(PlannedTensor(fmt.freq_tensor_name(ffn.layer), f32, (ffn.n_ff,), lambda: freq, layer=ffn.layer))
        plan.add_tensor(
            PlannedTensor(fmt.magnitude_tensor_name(ffn.layer), f32, (ffn.n_ff,), lambda: mag, layer=ffn.layer)
        )
