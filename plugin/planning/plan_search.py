"""The plan search: of the layouts that fit the budget (plan_budget.Layout, plain values), the one
whose plan predicts the fastest decode.

  1. Every layout allowed (the gate resident or streamed; each n_ubatch of UBATCH_CHOICES up to n_ctx)
     whose least minimum fits the budget is a candidate. Of one gate placement the smallest n_ubatch
     leaves the most memory to pinned clusters, so its plan predicts that placement's fastest decode;
     it is planned (:func:`plan_layout`: the neuron cache sized for every cluster size, the best
     kept). A streamed gate is planned too unless its gate reads alone take longer than the whole
     predicted token of the resident gate's plan.
  2. The plan with the highest predicted decode wins the gate placement (decode_speed's token without
     speculation: the longer of its reads and its compute, the reads' CPU side included; then the I/O
     bound; ties: the resident gate; in step 1 the cluster size is chosen the same way). Then prefill
     and decode are weighed: of its n_ubatch and the larger ones of its gate placement (prefill
     streams the offloaded FFN once per n_ubatch prompt tokens, prefill_speed), the one whose plan
     predicts the shortest request (TTFT of ``prompt_tokens`` + prefill_speed.REQUEST_DECODE_TOKENS
     decoded) is taken. A caller's ``n_ubatch`` is the only candidate.
  3. The draft copy is one more layout: the chosen one's n_ubatch with the copy resident and the gate
     resident; draft_plan chooses between the two plans by predicted delivered decode speed.

More memory never predicts a slower request of the same gate placement: for one layout a larger
budget only pins more clusters (fewer reads), and every layout that fits a smaller budget fits a
larger one. The decode alone may be predicted a little slower where a larger budget first affords a
larger n_ubatch (its compute buffers take memory from pinned clusters): ``ubatch_choice`` says what
the smallest n_ubatch would pin and predict, and a caller's ``n_ubatch`` fixes it. The draft copy is
weighed after (planner, draft_plan).

Another kind of offloaded weight is one more part: its sizes in plan_budget's parts, its choice
beside plan_clusters.choose_cache in :func:`plan_layout`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import RamBudgetError
from . import decode_speed, draft_plan, prefill_speed
from .plan_budget import (
    UBATCH_CHOICES,
    Layout,
    PlanRequest,
    cache_floor_bytes,
    cold_bytes,
    least_minimum,
    make_layout,
    margin_bytes,
    minimum_bytes,
    prompt_bytes,
    verify_bytes,
)
from .plan_clusters import GATE_READ_DEPTH, StreamedGate, choose_cache
from .plan_disk import DiskModel, default_disk, disk_source
from .plan_explain import gate_note, part_reasons, plan_notes, ubatch_note
from .plan_llama_share import MiB
from .plan_result import OffloadPlan

#: The tie-breaker's share: a larger n_ubatch is taken where its plan predicts at least this share of
#: the best plan's decode (and I/O bound): prefill speed for at most 1% of predicted decode.
DECODE_TIE_SHARE = 0.99


def layout_options(
    req: PlanRequest, stream_options: tuple[bool, ...], ubatches: tuple[int, ...], copy_bytes: int
) -> list[Layout]:
    """Every layout of these gate placements and n_ubatch values (gate placement first, n_ubatch
    largest first)."""
    return [make_layout(req, u, s, copy_bytes) for s in stream_options for u in ubatches]


def ubatch_options(req: PlanRequest, n_ubatch: int | None) -> tuple[int, ...]:
    """``n_ubatch`` (at most n_ctx) when given, else the UBATCH_CHOICES up to n_ctx (or n_ctx alone)."""
    if n_ubatch is not None:
        return (min(n_ubatch, req.n_ctx),)
    return tuple(u for u in UBATCH_CHOICES if u <= req.n_ctx) or (req.n_ctx,)


def stream_options(stream_gate: bool | None) -> tuple[bool, ...]:
    return (False, True) if stream_gate is None else (bool(stream_gate),)


def fitting_layouts(req: PlanRequest, layouts: list[Layout]) -> list[Layout]:
    """The ``layouts`` whose least minimum fits the budget. Raises :class:`RamBudgetError` naming the
    least budget of the least demanding layout (the last) when none does."""
    fitting = [lay for lay in layouts if least_minimum(req, lay) <= req.budget_bytes]
    if fitting:
        return fitting
    last = layouts[-1]
    need = math.ceil(least_minimum(req, last) / MiB)
    big = ", ".join(f"{k} {v / MiB:.0f}" for k, v in sorted(last.fixed.items(), key=lambda kv: -kv[1])[:4])
    raise RamBudgetError(
        f"RAM budget {req.budget_mb:g} MiB is below the minimum of {need} MiB that the flash-offload engine "
        f"needs for {Path(req.model_path).name} at n_ctx {req.n_ctx} (n_ubatch {last.n_ubatch}; largest parts "
        f"in MiB: {big}). Raise the budget to at least {need} MiB (--ram-budget-mb {need}), or use a smaller "
        f"n_ctx (the KV cache takes {last.fixed['kv_cache'] / MiB:.1f} MiB at n_ctx {req.n_ctx})."
    )


def io_key(plan: OffloadPlan) -> float:
    """The plan's I/O-bound decode (inf: nothing is read from flash)."""
    return math.inf if plan.io_bound_tok_s is None else plan.io_bound_tok_s


def mean_active(req: PlanRequest) -> float:
    """decode_speed.active_fraction of the pair, from the cluster table's sums of frequencies."""
    return sum(float(s.sum()) for s in req.tables[0].sumf) / sum(lay.n_ff for lay in req.info.layers)


def decode_key(req: PlanRequest, plan: OffloadPlan) -> tuple[float, float]:
    """What the search maximizes: the predicted decode without speculation (decode_speed's token,
    compute and reads), then the I/O bound."""
    return decode_speed.plan_token_time(plan, req.info, active=mean_active(req)).tok_s, io_key(plan)


def choice_decode(req: PlanRequest, layout: Layout, choice: Any) -> float:
    """decode_speed's tok/s of the cache ``choice`` (plan_clusters.CacheChoice) beside ``layout``."""
    gate, updown = decode_speed.ffn_row_bytes(req.info)
    io = choice.io_bound_tok_s
    flash = choice.flash_bytes_per_token if io is not None else 0.0
    return decode_speed.offload_token_time(
        io_seconds=0.0 if io is None else 1.0 / io,
        llama_bytes=layout.fixed.get("llama_weights", 0),
        n_layers=len(req.info.layers),
        gate_bytes=gate,
        updown_bytes=updown,
        active_fraction=mean_active(req),
        flash_bytes=flash,
        read_layers=choice.read_layers,
        cluster_bytes=max(flash - (gate if layout.stream_gate else 0.0), 0.0),
    ).tok_s


def gate_read_seconds(req: PlanRequest, disk: DiskModel) -> float:
    """Device seconds per token of a streamed gate's reads alone (one large read per layer)."""
    return float(disk.seconds(np.array(req.gate_layer_bytes, dtype=float), GATE_READ_DEPTH).sum())


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
        row.update(
            hot_slots=int(n_hot),
            hit_rate=choice.hit_rate,
            neuron_hit_rate=choice.neuron_hit_rate,
            flash_bytes_per_token=choice.flash_bytes_per_token,
            io_bound_tok_s=choice.io_bound_tok_s,
            prefetch_min_prob=choice.prefetch_min_prob,
            queue_depth=choice.queue_depth,
        )
        choices.append((choice_decode(req, layout, choice), choice, low))
    _, best, low = max(choices, key=lambda c: (c[0], c[1].rank, -c[2]))
    table = best.table
    parts = {
        **layout.fixed,
        "cold_slots": cold_bytes(req, table),
        "verify_buffers": verify_bytes(req, table),
    }
    if prompt_bytes(req, table, layout):
        parts["prompt_buffers"] = prompt_bytes(req, table, layout)
    parts["hot_slots"] = best.hot_slots * table.slot_bytes
    parts["margin"] = req.budget_bytes - sum(parts.values())
    spare = parts["margin"] - margin_bytes(sum(layout.fixed.values()) + cache_floor_bytes(req, table, layout))
    reasons = part_reasons(req, layout, best, spare)
    return OffloadPlan(
        model_path=str(req.model_path),
        sidecar_path=str(req.sidecar_path),
        budget_bytes=req.budget_bytes,
        minimum_bytes=low,
        least_budget_bytes=least_budget,
        parts=parts,
        reasons={k: reasons[k] for k in parts},
        cluster_size=table.size,
        slot_bytes=table.slot_bytes,
        hot_slots=best.hot_slots,
        cold_slots=table.cold_slots(req.prefetch_layers),
        total_clusters=table.total_clusters,
        queue_depth=best.queue_depth,
        prefetch_layers=req.prefetch_layers,
        prefetch_min_prob=best.prefetch_min_prob,
        n_ctx=req.n_ctx,
        n_batch=layout.n_ubatch,
        n_ubatch=layout.n_ubatch,
        layers=[lay.layer for lay in req.info.layers],
        hot_clusters=[np.flatnonzero(h).astype(np.int32) for h in best.pinned],
        cluster_prob=table.prob,
        hit_rate=best.hit_rate,
        neuron_hit_rate=best.neuron_hit_rate,
        flash_bytes_per_token=best.flash_bytes_per_token,
        io_bound_tok_s=best.io_bound_tok_s,
        read_layers_per_token=best.read_layers,
        disk_source=disk_source(req.disk),
        candidates=rows,
        notes=plan_notes(req),
        stream_gate=layout.stream_gate,
        draft_copy=layout.draft_copy,
        flash_attn=req.flash_attn,
    )


def near_best(req: PlanRequest, candidate: OffloadPlan, best: OffloadPlan) -> bool:
    """Whether ``candidate`` predicts at least DECODE_TIE_SHARE of ``best``'s decode (:func:`decode_key`)."""
    return decode_key(req, candidate)[0] >= DECODE_TIE_SHARE * decode_key(req, best)[0]


def request_key(req: PlanRequest, plan: OffloadPlan) -> float:
    """The predicted time of the request n_ubatch is chosen for (prefill_speed.request_seconds): TTFT
    of ``req.prompt_tokens`` at the plan's n_ubatch and gate placement, plus the decode."""
    ttft = prefill_speed.predict(req, plan.n_ubatch, plan.stream_gate).ttft_s
    return prefill_speed.request_seconds(ttft, decode_key(req, plan)[0])


def weigh_prefill(
    req: PlanRequest, best: OffloadPlan, fitting: list[Layout], least_budget: int, copy_bytes: int = 0
) -> OffloadPlan:
    """Of ``best`` (the smallest n_ubatch of its gate placement: its fastest decode) and the plans of
    the larger n_ubatch of that placement, the one of the shortest predicted request
    (:func:`request_key`: TTFT of ``req.prompt_tokens`` + the decode). The larger n_ubatch are planned
    with ``best``'s cluster size alone, the one taken with every cluster size. ``copy_bytes`` (a draft
    copy that may be kept, gate resident): where the copy wins draft_plan's choice at ``best``'s
    n_ubatch, an n_ubatch is a candidate only where the copy's layout fits too."""
    one_size = dataclasses.replace(req, tables=tuple(t for t in req.tables if t.size == best.cluster_size))
    larger = sorted(
        (lay for lay in fitting if lay.stream_gate == best.stream_gate and lay.n_ubatch > best.n_ubatch),
        key=lambda lay: lay.n_ubatch,
    )
    with_copy = False
    if copy_bytes and not best.stream_gate:
        base = make_layout(req, best.n_ubatch, False, copy_bytes)
        if least_minimum(req, base) <= req.budget_bytes:
            with_copy = draft_plan.choose_draft_copy(req.info, best, plan_layout(req, base, least_budget)).draft_copy
    taken, taken_key = None, request_key(req, best)
    for lay in larger:
        if least_minimum(one_size, lay) > req.budget_bytes:
            break
        if with_copy and least_minimum(req, make_layout(req, lay.n_ubatch, False, copy_bytes)) > req.budget_bytes:
            break
        key = request_key(req, plan_layout(one_size, lay, least_budget))
        if key < taken_key:
            taken, taken_key = lay, key
    return best if taken is None else plan_layout(req, taken, least_budget)


def best_plan(req: PlanRequest, fitting: list[Layout], least_budget: int, copy_bytes: int = 0) -> OffloadPlan:
    """The plan of the fastest predicted decode among the ``fitting`` layouts, then the largest n_ubatch
    near it (see the module docstring; ``copy_bytes``: :func:`prefill_tie_break`)."""
    disk = DiskModel(req.disk if req.disk is not None else default_disk())
    plans: list[OffloadPlan] = []
    for stream in (False, True):
        mine = [lay for lay in fitting if lay.stream_gate == stream]
        if not mine:
            continue
        if stream and plans and 1.0 / decode_key(req, plans[0])[0] <= gate_read_seconds(req, disk):
            continue  # the gate's reads alone take longer than the resident gate's whole token
        plans.append(plan_layout(req, mine[-1], least_budget))  # the smallest n_ubatch of this placement
    best = max(plans, key=lambda p: (decode_key(req, p), not p.stream_gate))  # max keeps the first of equals
    best = weigh_prefill(req, best, fitting, least_budget, copy_bytes)
    if best.stream_gate and req.stream_gate is None:
        resident = plans[0] if not plans[0].stream_gate else None
        best = dataclasses.replace(best, notes=best.notes + [gate_note(req, best, resident)])
    return best


def with_ubatch_trade(req: PlanRequest, plan: OffloadPlan) -> OffloadPlan:
    """``plan`` with its predicted prefill (``prefill``: prefill_speed.PrefillPrediction of
    ``req.prompt_tokens``) and ``ubatch_choice``: the plan's n_ubatch, pinned clusters, predicted
    decode, TTFT and request time, and, unless the caller fixed n_ubatch, the same for every n_ubatch of
    the plan's gate placement and cluster size that fits (``alternatives``; None where it does not fit),
    with a note where the plan's n_ubatch is not the smallest (decode traded for prefill)."""
    pre = prefill_speed.predict(req, plan.n_ubatch, plan.stream_gate)
    decode = decode_key(req, plan)[0]
    choice: dict[str, Any] = {
        "n_ubatch": plan.n_ubatch,
        "hot_slots": plan.hot_slots,
        "io_bound_tok_s": plan.io_bound_tok_s,
        "decode_tok_s": decode,
        "prompt_tokens": req.prompt_tokens,
        "ttft_s": pre.ttft_s,
        "request_s": prefill_speed.request_seconds(pre.ttft_s, decode),
        "request_decode_tokens": prefill_speed.REQUEST_DECODE_TOKENS,
    }
    plan = dataclasses.replace(plan, prefill=pre.to_dict())
    if req.n_ubatch is not None:
        return dataclasses.replace(plan, ubatch_choice={**choice, "given": True})
    one_size = dataclasses.replace(req, tables=tuple(t for t in req.tables if t.size == plan.cluster_size))
    copy = plan.parts.get("draft_copy", 0)
    alternatives = []
    for u in ubatch_options(req, None):
        if u == plan.n_ubatch:
            alternatives.append(
                {k: choice[k] for k in ("n_ubatch", "hot_slots", "decode_tok_s", "ttft_s", "request_s")}
            )
            continue
        layout = make_layout(req, u, plan.stream_gate, copy)
        if least_minimum(one_size, layout) > req.budget_bytes:
            alternatives.append({"n_ubatch": u, "hot_slots": None})
            continue
        alt = plan_layout(one_size, layout, plan.least_budget_bytes)
        ttft = prefill_speed.predict(req, u, plan.stream_gate).ttft_s
        tok_s = decode_key(req, alt)[0]
        alternatives.append(
            {
                "n_ubatch": u,
                "hot_slots": alt.hot_slots,
                "decode_tok_s": tok_s,
                "ttft_s": ttft,
                "request_s": prefill_speed.request_seconds(ttft, tok_s),
            }
        )
    choice["alternatives"] = alternatives
    smallest = next((a for a in reversed(alternatives) if a.get("hot_slots") is not None), None)
    notes = plan.notes
    if smallest is not None and smallest["n_ubatch"] < plan.n_ubatch:
        notes = notes + [ubatch_note(choice, smallest)]
    return dataclasses.replace(plan, ubatch_choice=choice, notes=notes)


def plan_without_copy(req: PlanRequest, copy_bytes: int = 0) -> OffloadPlan:
    """The plan with the draft copy left on disk; ``copy_bytes``: a draft copy the caller may keep
    instead at the same n_ubatch (prefill's tie-breaker then keeps that plan near its best too)."""
    layouts = layout_options(req, stream_options(req.stream_gate), ubatch_options(req, req.n_ubatch), 0)
    least = min(least_minimum(req, lay) for lay in layouts)
    return best_plan(req, fitting_layouts(req, layouts), least, copy_bytes)


def copy_layout(req: PlanRequest, n_ubatch: int, copy_bytes: int) -> Layout:
    """The draft copy's layout at ``n_ubatch`` (gate resident: a self-draft never waits for flash);
    raises RamBudgetError when it does not fit."""
    return fitting_layouts(req, layout_options(req, (False,), ubatch_options(req, n_ubatch), copy_bytes))[0]


def plan_with_copy(req: PlanRequest, copy_bytes: int) -> OffloadPlan:
    """The plan with the draft copy resident, at the given n_ubatch or else the one the plan without
    the copy chooses (prefill numerics depend on the ubatch size, and the copy, used by drafts only,
    must not change a token)."""
    n_ubatch = req.n_ubatch
    if n_ubatch is None:
        n_ubatch = plan_without_copy(dataclasses.replace(req, stream_gate=None), copy_bytes).n_ubatch
    layout = copy_layout(req, n_ubatch, copy_bytes)
    return plan_layout(req, layout, least_minimum(req, layout))
