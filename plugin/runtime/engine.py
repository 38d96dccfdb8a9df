"""The native engine's configuration for a dense FFN model: one typed configuration, built once.

The configuration is ``_native.EngineConfig`` (csrc/model/engine_config.h), a C++ struct with named, typed
fields, built here once from the checked sidecar (:func:`~llamaflash.files.sidecar.validate_pair`) and, for
flash offload, the planner's :class:`~llamaflash.planning.planner.OffloadPlan`:

  layers        one ``_native.LayerSpec`` per served layer (the sidecar layout with the base model's
                offsets resolved, and the layer's threshold: < 0 runs it dense)
  sidecar_path, base_path, activation
  verify        check every row read against the sidecar's checksums (integrity section; a failed
                check at open raises SidecarIntegrityError)
  sparse        ``_native.SparseConfig``: enabled (the sparse lane loaded and used), max_tokens,
                cluster_size, up_by_ggml
  offload       None in memory; else ``_native.OffloadConfig``: stream_gate, cold_slots,
                prefetch_layers, prefetch_min_prob, queue_depth, direct, engine, hot and
                cluster_prob (one array per served layer), draft_copy (the sidecar's draft copy kept
                resident for speculative self-drafts)

It is the dense part of the plan (runtime/model_plan.py); ``llamaflash.Llama`` and the tools' library
open it through the plan (``_native.open_plan``, csrc/backend/plan_reader.h), which calls
``FlashModel::open``. ``_native.FlashModel.open(config)`` opens one directly (converters, tests). It validates it (ValueError naming the field) and loads everything
in order: the dense weights (offload: gate resident or streamed, up and down streamed from the base
file), the sparse lane's views, the neuron cache and its pinned clusters (read now; FlashIoError if a
read fails). Run-time changes after open: ``FlashModel.thresholds`` and ``set_sparse_config``.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from .. import _native
from ..files import plan_keys
from ..files import sidecar_format as fmt
from ..files.sidecar import LayerLayout, SidecarInfo

#: LayerSpec field <- LayerLayout field, where the names differ
_RENAMED = {"down_type": "base_down_type"}
_SPEC_FIELDS = plan_keys.LAYER_LAYOUT_FIELDS


def layer_spec(layout: LayerLayout, threshold: Optional[float]) -> "_native.LayerSpec":
    """The native LayerSpec of a resolved layout (from ``validate_pair``); ``threshold`` None: dense."""
    values = layout.to_dict()  # ValueError unless the base-model offsets are resolved
    spec = _native.LayerSpec()
    for name in _SPEC_FIELDS:
        setattr(spec, name, int(values[_RENAMED.get(name, name)]))
    spec.threshold = -1.0 if threshold is None else float(threshold)
    if layout.draft_type is not None:
        spec.draft_type = int(layout.draft_type)
        spec.draft_row_bytes = int(layout.draft_row_bytes)
        spec.draft_up_offset = int(layout.draft_up_offset)
        spec.draft_down_t_offset = int(layout.draft_down_t_offset)
        spec.draft_checksum_offset = int(layout.draft_checksum_offset or 0)
        spec.draft_up_name = fmt.draft_up_tensor_name(layout.layer)
        spec.draft_down_t_name = fmt.draft_down_t_tensor_name(layout.layer)
    spec.checksum_offset = int(values["checksum_offset"] or 0)
    spec.base_down_checksum_offset = int(values["down_checksum_offset"] or 0)
    spec.bundle_name = fmt.bundle_tensor_name(layout.layer)
    spec.down_t_name = fmt.down_t_tensor_name(layout.layer)
    spec.base_gate_name = fmt.base_ffn_gate_name(layout.layer)
    spec.base_up_name = fmt.base_ffn_up_name(layout.layer)
    spec.base_down_name = fmt.base_ffn_down_name(layout.layer)
    return spec


def sparse_config(
    enabled: bool, max_tokens: int = 1, cluster_size: int = 32, up_by_ggml: bool = False
) -> "_native.SparseConfig":
    return _native.SparseConfig(
        enabled=enabled, max_tokens=int(max_tokens), cluster_size=int(cluster_size), up_by_ggml=bool(up_by_ggml)
    )


def offload_config(plan: Any, engine: str = "auto", direct: bool = True) -> "_native.OffloadConfig":
    """The offload part of the configuration from an OffloadPlan (or any object with its fields)."""
    o = _native.OffloadConfig()
    o.stream_gate = bool(getattr(plan, "stream_gate", False))
    o.cold_slots = int(plan.cold_slots)
    o.prefetch_layers = int(plan.prefetch_layers)
    o.prefetch_min_prob = float(plan.prefetch_min_prob)
    o.queue_depth = int(plan.queue_depth)
    o.direct = bool(direct)
    o.engine = engine
    o.hot = list(plan.hot_clusters)
    o.cluster_prob = list(plan.cluster_prob)
    o.draft_copy = bool(getattr(plan, "draft_copy", False))
    return o


def engine_config(
    info: SidecarInfo,
    model_path: str | os.PathLike,
    thresholds: Optional[Sequence[float]],
    sparse: "_native.SparseConfig",
    offload: Optional["_native.OffloadConfig"] = None,
    verify: bool = True,
) -> "_native.EngineConfig":
    """The whole configuration; ``thresholds`` None: every layer dense (the sparse lane is not used).
    ``verify``: check what is read against the sidecar's row checksums (csrc/io/integrity.h)."""
    config = _native.EngineConfig()
    config.verify = bool(verify)
    per_layer = thresholds if thresholds is not None else [None] * len(info.layers)
    if len(per_layer) != len(info.layers):
        raise ValueError(f"{len(per_layer)} thresholds for {len(info.layers)} served layers")
    config.layers = [layer_spec(layout, t) for layout, t in zip(info.layers, per_layer)]
    config.sidecar_path = str(info.path)
    config.base_path = os.fspath(model_path)
    config.activation = info.activation
    config.sparse = sparse
    config.offload = offload
    return config
