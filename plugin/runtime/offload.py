"""Flash offload for `llamaflash.Llama`: the plan and the engine configuration from it
(:func:`configure`), the self-draft over the resident clusters (:func:`attach_self_draft`), and the
neuron cache's counters with per-token figures (:func:`stats`).

Order of operations (what `Llama(..., ram_budget_mb=N)` does):
  1. `planner.plan_offload` sizes everything for the budget (or raises `RamBudgetError` naming the
     minimum);
  2. `engine.engine_config` turns the plan into the native configuration's offload part, which
     `llama_load.open_engine` opens, as plan data, before llama.cpp loads the model: offload layout (gate resident, or
     streamed from the base file one layer ahead when the plan says `stream_gate`; up and down
     streamed from the base file for prefill), the sparse lane, the neuron cache with the planner's
     pinned clusters, which are read now;
  3. llama.cpp loads the rest with the plan's batch sizes; decode runs on the sparse lane, whose up and
     down_t rows come from the cache (csrc/offload/neuron_cache.h); `stats` reports what it did.

With ``deterministic=True`` (``whole_layers``) the plan's cache memory holds whole layers instead
(:func:`stream_layers`, csrc/offload/layer_stream.h): every FFN row is computed by the dense lane over
the base model's own up and down (and gate, when streamed) as stock computes a row alone, read from
flash a layer at a time, a few layers pinned; the sparse lane and the self-draft are off.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from .. import _native
from . import engine, speculative

if TYPE_CHECKING:
    from ..files.sidecar import SidecarInfo
    from ..planning.plan_result import OffloadPlan


def configure(
    model_path: str,
    sidecar,
    info: "SidecarInfo",
    header,
    thresholds,
    spec_settings: Optional[speculative.SpeculativeSettings],
    *,
    ram_budget_mb: float,
    n_ctx: int,
    n_ubatch: Optional[int],
    logits_all: bool,
    flash_attn: bool,
    max_sparse_tokens: int,
    stream_gate: Optional[bool],
    disk_profile: Any,
    draft_copy: Optional[bool],
    io_engine: str,
    verify: bool,
    speculation_by_default: bool = False,
    prompt_tokens: Optional[int] = None,
    prompt_pages_freed: bool = True,
    whole_layers: bool = False,
) -> Tuple["OffloadPlan", "_native.EngineConfig", Optional[speculative.SpeculativeSettings], Optional[str]]:
    """Steps 1 and 2: the plan for the budget at llama.cpp's ``n_ctx``, ``n_ubatch`` (None: the plan
    chooses; the plan's n_batch and n_ubatch are what llama.cpp should run with), ``logits_all`` and
    ``flash_attn``, and the engine configuration from it. ``prompt_tokens`` is the prompt length the
    plan weighs (None: DEFAULT_PROMPT_TOKENS); ``prompt_pages_freed``: the host frees a prompt's
    compute pages after it (llamaflash.Llama.eval; planner.plan_offload). Returns the plan, the engine
    configuration, the speculative settings to use and, where speculation that was on only by default
    is turned off (:func:`default_speculation_off`), the reason. ``whole_layers``: the FFN of every
    served layer computed whole and exactly, over the plan's memory as layer slots (:func:`stream_layers`)."""
    from ..planning import disk_probe, planner  # numpy-heavy; only offload needs them
    from ..planning.prefill_speed import DEFAULT_PROMPT_TOKENS

    # the prompt length the plan predicts TTFT for and weighs in n_ubatch: Llama(flash_prompt_tokens=N)
    prompt_tokens = int(prompt_tokens or DEFAULT_PROMPT_TOKENS)
    plan = planner.plan_offload(
        os.fspath(model_path),
        str(sidecar),
        ram_budget_mb,
        n_ctx=int(n_ctx),
        n_ubatch=n_ubatch,
        stream_gate=stream_gate,
        disk=disk_probe.resolve_profile(disk_profile, sidecar),
        info=info,
        header=header,
        draft_copy=draft_copy,
        logits_all=bool(logits_all),
        flash_attn=bool(flash_attn),
        prompt_tokens=prompt_tokens,
        prompt_pages_freed=prompt_pages_freed,
    )
    off_reason = default_speculation_off(plan) if speculation_by_default and spec_settings is not None else None
    if off_reason is not None:
        spec_settings = None
    if whole_layers:
        if spec_settings is not None and spec_settings.self_draft:  # it drafts over the sparse lane's clusters
            spec_settings = dataclasses.replace(spec_settings, self_draft=False)
        o = engine.offload_config(plan, engine=io_engine)
        o.stream_layers = True
        o.draft_copy = False
        o.prefetch_layers = STREAM_PREFETCH_LAYERS
        o.hot_layers, o.cold_slots = stream_layers(plan, info)
        config = engine.engine_config(info, model_path, thresholds, engine.sparse_config(False), o, verify=verify)
        return plan, config, spec_settings, off_reason
    # every decode split of a layer with a threshold runs on the sparse lane (the dense lane
    # would stream the whole layer from flash), and so do verify batches (1 + k drafted
    # tokens, reading the union of their clusters once); prefill streams on the dense lane
    max_tokens = max(max_sparse_tokens, speculative.verify_batch_max(spec_settings))
    config = engine.engine_config(
        info,
        model_path,
        thresholds,
        engine.sparse_config(True, max_tokens, int(plan.cluster_size), up_by_ggml=False),
        engine.offload_config(plan, engine=io_engine),
        verify=verify,
    )
    return plan, config, spec_settings, off_reason


#: layers read ahead of the one computing in a layer stream: one keeps the disk busy (a layer is
#: ~15-27 MB of reads on Qwen2.5-1.5B, one request per matrix)
STREAM_PREFETCH_LAYERS = 1


def stream_layers(plan: "OffloadPlan", info: "SidecarInfo") -> Tuple[list, int]:
    """The layer stream's sizing in the memory the plan gives its neuron cache, (hot_slots +
    cold_slots) x slot_bytes: 1 + STREAM_PREFETCH_LAYERS cold layer slots (the fewest the stream takes,
    even where that memory holds fewer), and as many pinned layers as the rest holds, the layers with the
    most bytes first (each saves its bytes on every token). Returns (pinned positions, cold slots)."""
    sizes = [
        (
            lay.n_ff * lay.gate_row_bytes if plan.stream_gate else 0,
            lay.n_ff * lay.up_row_bytes,
            lay.n_embd * lay.base_down_row_bytes,
        )
        for lay in info.layers
    ]
    slot = _native.layer_stream_slot_bytes(*(max(s[k] for s in sizes) for k in range(3)))
    memory = (int(plan.hot_slots) + int(plan.cold_slots)) * int(plan.slot_bytes)
    cold = 1 + STREAM_PREFETCH_LAYERS
    n_hot = max(0, min(len(sizes), memory // slot - cold))
    by_bytes = sorted(range(len(sizes)), key=lambda p: (-sum(sizes[p]), p))
    return sorted(by_bytes[:n_hot]), cold


def _reads_nothing(plan: "OffloadPlan") -> bool:
    """Every cluster resident (nothing read per token) and no draft copy to draft from."""
    return plan.flash_bytes_per_token <= 0 and not plan.draft_copy


def default_speculation_off(plan: "OffloadPlan") -> Optional[str]:
    """Why speculation, on by default under a budget, is off for ``plan`` (None: it stays on).

    Where the plan keeps every cluster resident (nothing read per token) and has no draft copy, a pass
    waits on no flash read: it is compute-bound, as in memory (where speculation is off by default).
    There the sparse lane's cost grows with the verify batch (a 2-token pass measured 1.9-3.5x a
    1-token pass on Qwen2.5-1.5B), so a draft token pays only at acceptances near 1, and a self-draft
    computes a whole pass. ``flash_speculative=True`` still turns it on."""
    if _reads_nothing(plan):
        return (
            "off by default: every cluster is resident under this budget, so a pass reads nothing from "
            "flash and is compute-bound, where drafts do not pay; flash_speculative=True turns it on"
        )
    return None


def attach_self_draft(
    llm, speculator: speculative.Speculator, plan: "OffloadPlan", info: "SidecarInfo", spec_settings
) -> Optional[str]:
    """The speculator's self-draft under a budget (no user draft model): off when whole layers are
    computed (deterministic answers), the gate is streamed from flash or every cluster is resident (the
    reason is returned), else the offload lane's draft mode with the plan's predicted acceptance as its
    prior. ``llm``: the `llamaflash.Llama` drafting, held by weak reference."""
    reason = None
    if llm._flash is not None and llm._flash.layer_stream_stats() is not None:
        reason = (
            "self-draft off: deterministic answers compute whole layers from flash, and a self-draft drafts over "
            "the sparse lane's resident clusters"
        )
    elif plan.stream_gate:
        reason = "self-draft off: the gate is streamed from flash under this budget"
    elif spec_settings.self_draft and _reads_nothing(plan):
        # a self-draft skips the clusters that are not resident; with every cluster resident it computes
        # what a plain pass computes, so a draft token costs a whole pass and can never pay
        reason = "self-draft off: every cluster is resident under this budget (a draft would cost a full pass)"
    if reason is not None:
        speculator.disable_source("self_draft", "off: " + reason)
        return reason
    if spec_settings.self_draft:
        from ..planning import draft_plan

        # the plan's predicted acceptance for its resident share (none without an I/O bound)
        predicted = draft_plan.predict_plan(plan, info) if getattr(plan, "io_bound_tok_s", None) is not None else None
        speculator.attach_self_draft(
            speculative.make_self_draft(weakref.ref(llm), llm.n_vocab()),
            prior_acceptance=predicted.acceptance if predicted else None,
            prior_step_seconds=predicted.step_seconds if predicted else 0.0,
            note=(
                f"prior: the plan's resident share of the active neurons is "
                f"{plan.neuron_hit_rate:.0%}, predicted acceptance {predicted.acceptance:.2f}"
                if predicted and not plan.draft_copy
                else ""
            ),
        )
    return None


def free_prompt_pages_after_decode(llm) -> None:
    """Prompt batches and decode take turns in memory (planning/plan_budget.py): the engine empties the
    cold region before a prompt batch, and here, after every ``llama_decode`` of ``llm``'s context (one
    ubatch: the plan's n_batch is its n_ubatch), the compute pages a prompt batch wrote are freed
    (csrc/backend/prompt_buffers.h; nothing after a decode step), before the next call can compute
    clusters into the cold region. Wraps the context's ``decode``, through which every evaluation
    passes; counted in ``llm._prompt_pages_freed``."""
    ctx, flash, ref = llm._ctx, llm._flash, weakref.ref(llm)
    decode = ctx.decode

    def decode_then_free(batch):
        try:
            return decode(batch)
        finally:
            freed = flash.release_prompt_buffers()
            owner = ref()
            if owner is not None:
                owner._prompt_pages_freed += freed

    ctx.decode = decode_then_free


def stats(flash: "_native.FlashModel", plan: Any) -> Optional[Dict[str, Any]]:
    """The cache's counters since load (or the last reset) with per-token figures.

    hit_rate: needed clusters that were resident without any read for this token (pinned, or still
    in a cold slot from an earlier token); prefetch_coverage: needed clusters whose read had been
    started ahead by read-ahead (the I/O overlapped with earlier layers' compute); miss_rate: read on
    demand; bytes_read_per_token / io_wait_per_token: flash traffic and time blocked on it."""
    raw = flash.cache_stats()
    if raw is None:
        return stream_stats(flash, plan)
    needed = raw["clusters_needed"] or 0
    tokens = raw["plans"] / max(1, len(flash.served_layers))  # decode tokens through the cache
    per = (lambda v: v / tokens) if tokens else (lambda v: None)
    out = dict(raw)
    out.update(
        tokens=tokens,
        hit_rate=(raw["hits_hot"] + raw["hits_cold"]) / needed if needed else None,
        prefetch_coverage=raw["hits_prefetch"] / needed if needed else None,
        miss_rate=raw["misses"] / needed if needed else None,
        bytes_read_per_token=per(raw["bytes_read"]),
        # a streamed gate is read through the page cache (not counted in bytes_read): every served
        # layer's gate matrix per decode token
        gate_streamed=bool(flash.stream_gate),
        gate_bytes_per_token=flash.streamed_gate_bytes,
        io_wait_per_token=per(raw["io_wait_seconds"]),
        budget_mb=plan.budget_bytes / 2**20 if plan is not None else None,
        prefill=prefill_stats(flash, plan),
        plan=plan.to_dict() if plan is not None else None,
    )
    return out


def stream_stats(flash: "_native.FlashModel", plan: Any) -> Optional[Dict[str, Any]]:
    """Whole layers (deterministic answers): the layer stream's counters since load (or the last
    reset), ``whole_layers`` True, and per token (plans / served layers) the bytes read and the time
    blocked on them; hit_rate: layers resident when planned (pinned, or still in a cold slot)."""
    raw = flash.layer_stream_stats()
    if raw is None:
        return None
    tokens = raw["plans"] / max(1, len(flash.served_layers))
    per = (lambda v: v / tokens) if tokens else (lambda v: None)
    out = dict(raw)
    out.update(
        whole_layers=True,
        tokens=tokens,
        hit_rate=(raw["hits_hot"] + raw["hits_cold"]) / raw["plans"] if raw["plans"] else None,
        prefetch_coverage=raw["hits_prefetch"] / raw["plans"] if raw["plans"] else None,
        bytes_read_per_token=per(raw["bytes_read"]),
        io_wait_per_token=per(raw["io_wait_seconds"]),
        budget_mb=plan.budget_bytes / 2**20 if plan is not None else None,
        plan=plan.to_dict() if plan is not None else None,
    )
    return out


def prefill_stats(flash: "_native.FlashModel", plan: Any) -> Optional[Dict[str, Any]]:
    """Prefill since load (or the last reset) beside the plan's prediction: ``dense_splits`` (each
    streams one served layer's base up + down, and gate when streamed, from flash through the page
    cache), ``micro_batches`` (dense splits / served layers), ``stream_bytes`` (dense splits x the
    plan's bytes per micro-batch / served layers: the mean layer), and ``predicted`` (the plan's
    prefill_speed prediction for its stated prompt: passes, bytes per micro-batch, TTFT)."""
    if plan is None or not getattr(plan, "prefill", None):
        return None
    native = flash.stats()
    n_layers = max(1, len(flash.served_layers))
    dense = int(native.get("dense_lane_calls", 0))
    per_pass = int(plan.prefill["stream_bytes"])
    return {
        "dense_splits": dense,
        "micro_batches": dense / n_layers,
        "stream_bytes_per_micro_batch": per_pass,
        "stream_bytes": dense * per_pass / n_layers,
        "n_ubatch": plan.n_ubatch,
        "predicted": dict(plan.prefill),
    }
