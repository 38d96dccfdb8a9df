"""The result of the offload planner: :class:`OffloadPlan`, a plain value (sizes in bytes) that
``llamaflash.Llama`` configures the engine from and ``llamaflash plan`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .plan_explain import explain_plan


@dataclass
class OffloadPlan:
    """A RAM plan for the flash-offload engine; sizes in bytes. ``parts`` (name → bytes, in order)
    sums to ``budget_bytes``; ``reasons`` says why each part has its size. ``minimum_bytes`` is every
    part but ``hot_slots`` with the cold region at its minimum, at this plan's n_ubatch and gate
    placement; ``least_budget_bytes`` the least budget the planner accepts for the model and settings
    (the smallest n_ubatch, the gate streamed when allowed): one number whatever budget was asked.
    ``hot_clusters[i]`` / ``cluster_prob[i]`` belong to ``layers[i]`` (the sidecar's layer order). ``hit_rate``: share of the cluster reads a
    token needs that the hot slots serve; ``neuron_hit_rate``: the same weighted by active neurons;
    ``flash_bytes_per_token``: expected bytes read per decoded token (read-ahead included);
    ``io_bound_tok_s``: decode speed if only the disk limited it (None: nothing is read)."""

    model_path: str
    sidecar_path: str
    budget_bytes: int
    minimum_bytes: int
    least_budget_bytes: int  # the one minimum of the model and settings (smallest n_ubatch, gate streamed if allowed)
    parts: dict[str, int]
    reasons: dict[str, str]
    cluster_size: int
    slot_bytes: int
    hot_slots: int
    cold_slots: int
    total_clusters: int
    queue_depth: int
    prefetch_layers: int
    prefetch_min_prob: float
    n_ctx: int
    n_batch: int
    n_ubatch: int
    layers: list[int]
    hot_clusters: list[np.ndarray]
    cluster_prob: list[np.ndarray]
    hit_rate: float
    neuron_hit_rate: float
    flash_bytes_per_token: float
    io_bound_tok_s: float | None
    disk_source: str
    candidates: list[dict[str, Any]] = field(default_factory=list)
    #: the gate is read from flash every token (one layer ahead) instead of resident
    stream_gate: bool = False
    notes: list[str] = field(default_factory=list)
    #: the sidecar's draft copy is kept resident (part ``draft_copy``) for speculative self-drafts
    draft_copy: bool = False
    #: the predicted decode speeds the draft-copy choice compared (draft_plan.DraftChoice.to_dict); {} when
    #: there was no choice to make
    draft_choice: dict[str, Any] = field(default_factory=dict)
    #: how n_ubatch was chosen (plan_search.with_ubatch_trade): the plan's n_ubatch, pinned clusters, I/O
    #: bound, predicted decode and TTFT of ``prompt_tokens`` and the request time it minimizes; ``given``
    #: when the caller fixed it; else ``alternatives``: the same for every n_ubatch that fits
    ubatch_choice: dict[str, Any] = field(default_factory=dict)
    #: predicted prefill of the stated prompt (prefill_speed.PrefillPrediction.to_dict): micro-batches,
    #: bytes streamed per micro-batch and in all, read and compute seconds, ``ttft_s``
    prefill: dict[str, Any] = field(default_factory=dict)
    #: the context runs flash attention (compute_buffers counted without KQ scores, plan_llama_share)
    flash_attn: bool = False
    #: expected served layers per token that read a cluster from flash (plan_clusters.layers_reading;
    #: 0 where every cluster stays resident): decode_speed charges each the read round's CPU cost
    read_layers_per_token: float = 0.0

    def to_dict(self, arrays: bool = True) -> dict[str, Any]:
        """Plain JSON-able dict; ``arrays=False`` replaces the per-layer arrays by per-layer pin counts."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("hot_clusters", "cluster_prob")}
        out["hot_per_layer"] = [int(len(h)) for h in self.hot_clusters]
        if arrays:
            out["hot_clusters"] = [h.tolist() for h in self.hot_clusters]
            out["cluster_prob"] = [np.round(p.astype(float), 6).tolist() for p in self.cluster_prob]
        return out

    def explain(self) -> str:
        """A human-readable table: every part and why, the minimum, the choices, the predictions."""
        return explain_plan(self)
