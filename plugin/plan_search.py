"""The plan search: one pass over candidate layouts (plan_budget.Layout, plain values).

  1. The layouts allowed are listed in order of preference (gate resident first, then the largest
     n_ubatch); the first whose minimum fits the budget and whose compute buffers take at most
     UBATCH_BUDGET_SHARE of it is taken (at the smallest n_ubatch it needs only to fit).
  2. For that layout the neuron cache is sized for every cluster size (plan_clusters.choose_cache)
     and the best predicted decode is kept.
  3. The draft copy is one more layout: the chosen one's n_ubatch with the copy resident and the gate
     resident; draft_plan chooses between the two plans by predicted delivered decode speed.

Another kind of offloaded weight is one more part: its sizes in plan_budget's parts, its choice
beside plan_clusters.choose_cache in :func:`plan_layout`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from .errors import RamBudgetError
from .plan_budget import (UBATCH_BUDGET_SHARE, UBATCH_CHOICES, Layout, PlanRequest, cache_floor_bytes, cold_bytes,
                          least_minimum, make_layout, margin_bytes, minimum_bytes, verify_bytes)
from .plan_clusters import StreamedGate, choose_cache
from .plan_disk import DiskModel, default_disk, disk_source
from .plan_explain import part_reasons, plan_notes
from .plan_llama_share import MiB
from .plan_result import OffloadPlan


def layout_options(req: PlanRequest, stream_options: tuple[bool, ...], ubatches: tuple[int, ...],
                   copy_bytes: int) -> list[Layout]:
    """Every layout of these gate placements and n_ubatch values, in order of preference."""
    return [make_layout(req, u, s, copy_bytes) for s in stream_options for u in ubatches]


def ubatch_options(req: PlanRequest, n_ubatch: int | None) -> tuple[int, ...]:
    """``n_ubatch`` (at most n_ctx) when given, else the UBATCH_CHOICES up to n_ctx (or n_ctx alone)."""
    if n_ubatch is not None:
        return (min(n_ubatch, req.n_ctx),)
    return tuple(u for u in UBATCH_CHOICES if u <= req.n_ctx) or (req.n_ctx,)


def stream_options(stream_gate: bool | None) -> tuple[bool, ...]:
    return (False, True) if stream_gate is None else (bool(stream_gate),)


def choose_layout(req: PlanRequest, layouts: list[Layout]) -> Layout:
    """The first of ``layouts`` (in order of preference) whose minimum fits the budget and whose
    compute buffers take at most UBATCH_BUDGET_SHARE of it (any, at the smallest n_ubatch). Raises
    :class:`RamBudgetError` naming the least budget (of the last, least demanding layout) when none fits."""
    smallest = layouts[-1].n_ubatch
    budget = req.budget_bytes
    fitting = [lay for lay in layouts if least_minimum(req, lay) <= budget and (
        lay.fixed["compute_buffers"] <= UBATCH_BUDGET_SHARE * budget or lay.n_ubatch == smallest)]
    if fitting:
        return fitting[0]
    last = layouts[-1]
    need = math.ceil(least_minimum(req, last) / MiB)
    big = ", ".join(f"{k} {v / MiB:.0f}" for k, v in sorted(last.fixed.items(), key=lambda kv: -kv[1])[:4])
    raise RamBudgetError(
        f"RAM budget {req.budget_mb:g} MiB is below the minimum of {need} MiB that the flash-offload engine "
        f"needs for {Path(req.model_path).name} at n_ctx {req.n_ctx} (n_ubatch {last.n_ubatch}; largest parts "
        f"in MiB: {big}). Raise the budget to at least {need} MiB (--ram-budget-mb {need}), or use a smaller "
        f"n_ctx (the KV cache takes {last.fixed['kv_cache'] / MiB:.1f} MiB at n_ctx {req.n_ctx}).")


def plan_layout(req: PlanRequest, layout: Layout, least_budget: int) -> OffloadPlan:
    """The plan of ``layout``: the neuron cache sized for every cluster size tried, the best predicted
    decode kept (ties: the smaller minimum). ``least_budget``: the least budget of the model and
    settings, reported as is."""
    disk = DiskModel(req.disk if req.disk is not None else default_disk())
    gate = StreamedGate(sum(req.gate_layer_bytes), req.gate_layer_bytes) if layout.stream_gate else None
    rows, choices = [], []
    for table in req.tables:
        low = minimum_bytes(req, layout, table)
        row: dict[str, Any] = {"cluster_size": table.size, "slot_bytes": table.slot_bytes, "minimum_bytes": low}
        rows.append(row)
        if low > req.budget_bytes:
            row["hot_slots"] = None
            continue
        n_hot = min(table.total_clusters, (req.budget_bytes - low) // table.slot_bytes)
        choice = choose_cache(table, n_hot, disk, req.prefetch_layers, gate)
        row.update(hot_slots=int(n_hot), hit_rate=choice.hit_rate, neuron_hit_rate=choice.neuron_hit_rate,
                   flash_bytes_per_token=choice.flash_bytes_per_token, io_bound_tok_s=choice.io_bound_tok_s,
                   prefetch_min_prob=choice.prefetch_min_prob, queue_depth=choice.queue_depth)
        choices.append((choice, low))
    best, low = max(choices, key=lambda c: (c[0].rank, -c[1]))
    table = best.table
    parts = {**layout.fixed, "cold_slots": cold_bytes(req, table), "verify_buffers": verify_bytes(req, table),
             "hot_slots": best.hot_slots * table.slot_bytes}
    parts["margin"] = req.budget_bytes - sum(parts.values())
    spare = parts["margin"] - margin_bytes(sum(layout.fixed.values()) + cache_floor_bytes(req, table))
    reasons = part_reasons(req, layout, best, spare)
    return OffloadPlan(
        model_path=str(req.model_path), sidecar_path=str(req.sidecar_path), budget_bytes=req.budget_bytes,
        minimum_bytes=low, least_budget_bytes=least_budget, parts=parts,
        reasons={k: reasons[k] for k in parts}, cluster_size=table.size, slot_bytes=table.slot_bytes,
        hot_slots=best.hot_slots, cold_slots=table.cold_slots(req.prefetch_layers),
        total_clusters=table.total_clusters, queue_depth=best.queue_depth, prefetch_layers=req.prefetch_layers,
        prefetch_min_prob=best.prefetch_min_prob, n_ctx=req.n_ctx, n_batch=layout.n_ubatch,
        n_ubatch=layout.n_ubatch, layers=[lay.layer for lay in req.info.layers],
        hot_clusters=[np.flatnonzero(h).astype(np.int32) for h in best.pinned], cluster_prob=table.prob,
        hit_rate=best.hit_rate, neuron_hit_rate=best.neuron_hit_rate,
        flash_bytes_per_token=best.flash_bytes_per_token, io_bound_tok_s=best.io_bound_tok_s,
        disk_source=disk_source(req.disk), candidates=rows, notes=plan_notes(req, layout),
        stream_gate=layout.stream_gate, draft_copy=layout.draft_copy)


def plan_without_copy(req: PlanRequest) -> OffloadPlan:
    """The plan with the draft copy left on disk."""
    layouts = layout_options(req, stream_options(req.stream_gate), ubatch_options(req, req.n_ubatch), 0)
    layout = choose_layout(req, layouts)
    return plan_layout(req, layout, min(least_minimum(req, lay) for lay in layouts))


def copy_layout(req: PlanRequest, n_ubatch: int, copy_bytes: int) -> Layout:
    """The draft copy's layout at ``n_ubatch`` (gate resident: a self-draft never waits for flash);
    raises RamBudgetError when it does not fit."""
    return choose_layout(req, layout_options(req, (False,), ubatch_options(req, n_ubatch), copy_bytes))


def plan_with_copy(req: PlanRequest, copy_bytes: int) -> OffloadPlan:
    """The plan with the draft copy resident, at the given n_ubatch or else the one the plan without
    the copy chooses (prefill numerics depend on the ubatch size, and the copy, used by drafts only,
    must not change a token)."""
    n_ubatch = req.n_ubatch
    if n_ubatch is None:
        free = dataclasses.replace(req, stream_gate=None)
        n_ubatch = choose_layout(free, layout_options(free, (False, True), ubatch_options(free, None), 0)).n_ubatch
    layout = copy_layout(req, n_ubatch, copy_bytes)
    return plan_layout(req, layout, least_minimum(req, layout))
