"""Flash offload statistics for `llamaflash.Llama`: the neuron cache's counters with per-token figures.

Order of operations (what `Llama(..., ram_budget_mb=N)` does):
  1. `planner.plan_offload` sizes everything for the budget (or raises `RamBudgetError` naming the
     minimum);
  2. `engine.engine_config` turns the plan into the native configuration's offload part, and
     `engine.open_engine` opens the model before llama.cpp loads it: offload layout (gate resident, or
     streamed from the base file one layer ahead when the plan says `stream_gate`; up and down
     streamed from the base file for prefill), the sparse lane, the neuron cache with the planner's
     pinned clusters, which are read now;
  3. llama.cpp loads the rest with the plan's batch sizes; decode runs on the sparse lane, whose up and
     down_t rows come from the cache (csrc/offload/neuron_cache.h); `stats` reports what it did.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .. import _native


def stats(flash: "_native.FlashModel", plan: Any) -> Optional[Dict[str, Any]]:
    """The cache's counters since load (or the last reset) with per-token figures.

    hit_rate: needed clusters that were resident without any read for this token (pinned, or still
    in a cold slot from an earlier token); prefetch_coverage: needed clusters whose read had been
    started ahead by read-ahead (the I/O overlapped with earlier layers' compute); miss_rate: read on
    demand; bytes_read_per_token / io_wait_per_token: flash traffic and time blocked on it."""
    raw = flash.cache_stats()
    if raw is None:
        return None
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
        plan=plan.to_dict() if plan is not None else None,
    )
    return out
