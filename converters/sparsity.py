"""The sparsity stage (sidecar format v2): what the converter decided for each served layer.

From a layer's :class:`~llamaflash.converters.analysis.LayerAnalysis` and the chosen operating
point, :func:`decide_layer` makes a :class:`LayerDecision`: the threshold, the hot-first neuron
order, the per-neuron statistics, the selection mode and the predictor. :class:`SparsityStage`
(a :class:`~llamaflash.converters.pipeline.ConverterStage`) then plans, per served layer, the
tensors ``blk.L.ffn_freq``, ``blk.L.ffn_mag`` and (rank > 0) ``blk.L.ffn_pred_in`` /
``blk.L.ffn_pred_out``, and the per-layer metadata arrays; the same orders go to the
:class:`~llamaflash.converters.bundle.BundleStage`, so bundles, down_t rows, statistics and
predictor rows all share one order.

Selection mode: gate-first unless predictors were asked for (the converter's default
``selection="gate"`` trains none). With ``selection="auto"``, per layer the mode that moves fewer
bytes per decoded token, among those whose held-out recall is at least ``min_recall``:

* gate-first: gate rows of all n_ff neurons, then up and down_t rows of the active ones
  (exact: recall 1);
* predictor-first: the rank-r factors, then whole bundles + down_t rows of the predicted
  neurons (the predicted fraction includes the false positives).

The rank is the one that minimises the predictor-first bytes under the recall floor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import gguf
import numpy as np

from llamaflash import sidecar_format as fmt
from llamaflash.converters.analysis import LayerAnalysis, hot_first_order
from llamaflash.converters.bundle import DEFAULT_DOWN_T, bundle_stride, down_t_type
from llamaflash.converters.writer import PlannedTensor, SidecarPlan
from llamaflash.gguf_model import BaseModelInfo, FfnLayer, ggml_row_bytes

SELECTION_AUTO = "auto"
SELECTION_CHOICES = (SELECTION_AUTO, fmt.SELECTION_GATE, fmt.SELECTION_PREDICTOR)


@dataclass
class LayerDecision:
    """Everything the sidecar records for one served layer (arrays in *bundle* order)."""

    layer: int
    level: float                  # target sparsity of the operating point
    threshold: float
    sparsity: float               # reached on held-out calibration tokens
    ffn_rel_error: float          # gate-first, held-out
    order: np.ndarray             # int32 (n_ff,): base neuron at bundle position k
    freq: np.ndarray              # float32 (n_ff,), non-increasing
    mag: np.ndarray               # float32 (n_ff,)
    selection: str
    rank: int = 0
    pred_in: np.ndarray | None = None     # (rank, n_embd)
    pred_out: np.ndarray | None = None    # (n_ff, rank), bundle order
    pred_threshold: float = 0.0
    pred_recall: float = 0.0
    pred_precision: float = 0.0
    pred_mass_recall: float = 0.0
    pred_fraction: float = 0.0            # held-out fraction of neurons predicted active
    bytes_gate: float = 0.0               # expected bytes per token, gate-first
    bytes_predictor: float = 0.0          # expected bytes per token, predictor-first (best rank)


def layer_bytes(ffn: FfnLayer, down_t: str = DEFAULT_DOWN_T) -> dict[str, int]:
    """Row sizes of ``ffn`` in the sidecar: gate, up, bundle and down_t rows."""
    return {
        "gate": ffn.gate.row_bytes,
        "up": ffn.up.row_bytes,
        "bundle": bundle_stride(ffn),
        "down_t": ggml_row_bytes(int(down_t_type(ffn.n_embd, down_t, ffn.down.ggml_type)), ffn.n_embd),
    }


def decide_layer(
    an: LayerAnalysis, ffn: FfnLayer, level: float, selection: str = SELECTION_AUTO, min_recall: float = 0.9,
    bundle_order: str = fmt.BUNDLE_ORDER_BASE, down_t: str = DEFAULT_DOWN_T,
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
    n_ff, n_embd = an.n_ff, an.n_embd
    active = 1.0 - an.sparsity_heldout[i]
    bytes_gate = n_ff * rows["gate"] + active * n_ff * (rows["up"] + rows["down_t"])

    def cost(q) -> float:
        return 2 * q.rank * (n_embd + n_ff) + q.predicted[i] * n_ff * (rows["bundle"] + rows["down_t"])

    eligible = [q for q in an.predictors if q.recall[i] >= min_recall]
    if not eligible and selection == fmt.SELECTION_PREDICTOR and an.predictors:
        eligible = [max(an.predictors, key=lambda q: q.recall[i])]  # forced: the best recall there is
    best = min(eligible, key=cost) if eligible else None
    decision = LayerDecision(
        layer=an.layer, level=float(level), threshold=float(an.thresholds[i]),
        sparsity=float(an.sparsity_heldout[i]), ffn_rel_error=float(an.ffn_error[i]),
        order=order, freq=an.freq[i][order].astype(np.float32), mag=an.mag[order].astype(np.float32),
        selection=fmt.SELECTION_GATE, bytes_gate=float(bytes_gate),
    )
    if best is None or selection == fmt.SELECTION_GATE:
        return decision
    q = best
    decision.rank = q.rank
    decision.pred_in = an.pred_in[:q.rank].astype(np.float32)
    decision.pred_out = an.pred_out[order, :q.rank].astype(np.float32)
    decision.pred_threshold = float(q.tau[i])
    decision.pred_recall = float(q.recall[i])
    decision.pred_precision = float(q.precision[i])
    decision.pred_mass_recall = float(q.mass_recall[i])
    decision.pred_fraction = float(q.predicted[i])
    decision.bytes_predictor = float(cost(q))
    if selection == fmt.SELECTION_PREDICTOR or decision.bytes_predictor < bytes_gate:
        decision.selection = fmt.SELECTION_PREDICTOR
    return decision


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
        plan.append_layer_value(fmt.KEY_SELECTION, fmt.SELECTION_CODES[d.selection])
        plan.append_layer_value(fmt.KEY_PRED_RANKS, d.rank)
        plan.append_layer_float(fmt.KEY_PRED_THRESHOLDS, d.pred_threshold)
        plan.append_layer_float(fmt.KEY_PRED_RECALL, d.pred_recall)
        plan.append_layer_float(fmt.KEY_PRED_PRECISION, d.pred_precision)
        plan.append_layer_float(fmt.KEY_FFN_REL_ERROR, d.ffn_rel_error)

        f32, f16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
        freq, mag = d.freq.astype(np.float32), d.mag.astype(np.float32)
        plan.add_tensor(PlannedTensor(fmt.freq_tensor_name(ffn.layer), f32, (ffn.n_ff,),
                                      lambda: freq, layer=ffn.layer))
        plan.add_tensor(PlannedTensor(fmt.magnitude_tensor_name(ffn.layer), f32, (ffn.n_ff,),
                                      lambda: mag, layer=ffn.layer))
        if d.rank:
            pred_in = d.pred_in.astype(np.float16)
            pred_out = d.pred_out.astype(np.float16)
            if pred_in.shape != (d.rank, ffn.n_embd) or pred_out.shape != (ffn.n_ff, d.rank):
                raise ValueError(f"layer {ffn.layer}: predictor factors have the wrong shapes")
            plan.add_tensor(PlannedTensor(fmt.predictor_in_tensor_name(ffn.layer), f16,
                                          (d.rank, ffn.n_embd), lambda: pred_in, layer=ffn.layer))
            plan.add_tensor(PlannedTensor(fmt.predictor_out_tensor_name(ffn.layer), f16,
                                          (ffn.n_ff, d.rank), lambda: pred_out, layer=ffn.layer))
