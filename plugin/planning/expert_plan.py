"""Planning an MoE model under a RAM budget: the dense part pinned, KV, and expert cache slots.

The budget covers the whole process. What is not the routed experts is resident in llama.cpp's
mapping of the file, locked in RAM after load (expert_runtime.lock_dense_part): every non-expert weight, the vocabulary, the KV cache and the compute buffers, plus the Python runtime
and a margin, as the dense planner counts them (plugin/planning/planner.py). What remains is the expert cache:
the same number of slots in every MoE layer, each slot one expert (all its tensors, aligned for direct
I/O: ``_native.expert_slot_bytes``). Slots hold the most popular experts of the calibration text
pinned (every slot above n_used: :func:`pinned_count`) and LRU for the rest.

When stock llama.cpp (plain weights, file-backed) fits the budget, llamaflash has nothing to do:
the model runs as stock (``fits``, :func:`stock_need`), with the largest prefill batch whose buffers
fit. Below n_used slots per layer the budget is refused (RamBudgetError naming the minimum).

The predicted decode rate is I/O bound: per token, n_layers x n_used experts, of which a share misses
(LRU simulated on the calibration statistics when the sidecar has them, else the uniform-routing
share), at the disk's measured bandwidth for expert-sized reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..files.experts import MoeModelInfo

MiB = 1024 * 1024
#: llama-cpp-python's default n_ubatch (llama.cpp clamps it to n_batch).
STOCK_DEFAULT_UBATCH = 512

#: Expert reads: the planner's disk profile is read at this queue depth (the reader keeps several
#: experts' tensors in flight).
EXPERT_READ_DEPTH = 16
#: Just below stock's need, stock llama.cpp loses a few routed experts' pages from its page cache
#: and faults them back in: per decoded token about AMPLIFICATION x (shortfall / routed expert bytes)
#: of the token's expert bytes (the dense part stays hot; fault granularity and readahead round up).
#: Those faults are synchronous, slower per byte than the engine's batched direct reads (FAULT_SLOWDOWN).
#: Measured on the synthetic qwen3moe bench model at 2,450 MiB (docs/BENCHMARKS.md): 4.7% of a token's
#: expert bytes re-read at a 3.7% shortfall, ~12 MB per token costing ~20 ms (600 MB/s against the
#: engine's 916). Trusted up to SHORTFALL_MAX of the routed experts: far below, stock's page cache
#: thrashes (the same model at 1/2 of the file re-read 9x a token's bytes).
STOCK_REREAD_AMPLIFICATION = 1.3
STOCK_FAULT_SLOWDOWN = 1.5
STOCK_SHORTFALL_MAX = 0.05
#: Ubatch for prefill under a budget: expert splits of more tokens need more rounds only when the
#: batch's distinct experts exceed the slots; compute buffers grow linearly with it.
EXPERT_UBATCH = 256


@dataclass(frozen=True)
class ExpertPlan:
    budget_bytes: int
    fits: bool  # everything fits: run stock
    n_slots: int  # per MoE layer
    pinned: dict[int, list[int]]  # layer -> experts pinned
    slot_bytes: int
    cache_bytes: int
    share: dict[str, int]  # llama.cpp's and the process's fixed parts (bytes)
    min_budget_bytes: int
    n_ubatch: int
    miss_rate: float  # predicted share of a token's experts read from flash
    read_bytes_per_token: float
    disk_bytes_per_s: float
    predicted_tok_s: float | None
    notes: list[str] = field(default_factory=list)
    # running as stock (fits): the budget holds stock's need with the planner's margin, so stock's
    # default layout (experts repacked into anonymous memory, which cannot be reclaimed) is safe
    # there; otherwise stock runs with plain, file-backed weights (its page cache may shrink)
    stock_repacked: bool = False

    @property
    def pinned_per_layer(self) -> int:
        """Experts pinned in each MoE layer (the same number in every layer)."""
        return max((len(p) for p in self.pinned.values()), default=0)

    def explain(self) -> str:
        lines = [f"budget {self.budget_bytes / MiB:.0f} MiB"]
        for k, v in self.share.items():
            lines.append(
                f"  {k:<22} {v / MiB:8.1f} MiB" + (f" (n_ubatch {self.n_ubatch})" if k == "compute_buffers" else "")
            )
        if self.fits:
            weights = (
                "its default layout: weights repacked where ggml-cpu repacks them"
                if self.stock_repacked
                else "plain weights"
            )
            lines.append(f"  runs as stock llama.cpp ({weights}, n_ubatch {self.n_ubatch}): nothing served from flash")
        else:
            lines.append(
                f"  expert cache           {self.cache_bytes / MiB:8.1f} MiB: {self.n_slots} slots per layer "
                f"of {self.slot_bytes / MiB:.2f} MiB ({self.pinned_per_layer} pinned per layer)"
            )
            lines.append(
                f"  predicted: {self.miss_rate:.0%} of a token's experts read, "
                f"{self.read_bytes_per_token / 1e6:.0f} MB/token at {self.disk_bytes_per_s / 1e6:.0f} MB/s"
                + (f" -> <= {self.predicted_tok_s:.1f} tok/s (I/O bound)" if self.predicted_tok_s else "")
            )
        lines.append(f"  minimum budget {self.min_budget_bytes / MiB:.0f} MiB")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def lru_miss_rate(counts: np.ndarray, n_used: int, n_slots: int, n_pinned: int) -> float:
    """Expected share of selections missing a cache of ``n_slots`` (``n_pinned`` most popular pinned,
    LRU for the rest) under independent routing with the measured popularity ``counts``: each unpinned
    expert is resident with the probability that it was among the last ~(n_slots - n_pinned)
    distinct experts drawn (Che's approximation of LRU)."""
    p = np.asarray(counts, dtype=float)
    if p.sum() <= 0:
        p = np.ones_like(p)
    p = p / p.sum()
    order = np.argsort(-p, kind="stable")
    rest = np.sort(order[n_pinned:])  # the unpinned experts, in index order
    lru = n_slots - n_pinned
    q = p[rest] * n_used  # expected selections per token of each unpinned expert
    if lru <= 0 or len(rest) == 0:
        return float(p[rest].sum())
    if lru >= len(rest):
        return 0.0
    # characteristic time T (tokens) with sum(1 - exp(-q T)) = lru
    lo, hi = 0.0, 1e9
    for _ in range(200):
        mid = (lo + hi) / 2
        if np.sum(1 - np.exp(-q * mid)) < lru:
            lo = mid
        else:
            hi = mid
    hit = 1 - np.exp(-q * lo)
    return float(np.sum(p[rest] * (1 - hit)))


def pinned_count(n_slots: int, n_used: int) -> int:
    """Experts pinned per MoE layer in a cache of ``n_slots`` slots (with routing statistics):
    n_slots - n_used, every slot but the n_used LRU slots a token's misses need (the most the cache
    takes, ExpertLayerSpec.pinned). Measured on routing traces of the SYNTHETIC Qwen3-30B-A3B shape
    (held-out text; docs/MOE.md, "The cache policy against the offline optimum"): the hit rate rises
    with the pinned count P up to n_slots - n_used at every slot count from 18 to 87, in 41-48 of
    the 48 layers; against P = (n_slots - n_used) // 2 it gains 2.9-4.4 points of hits at 18-54
    slots without prefetch, and with the lookahead prefetch at 54 slots the engine read 22% fewer
    expert bytes per token (138.6 against 177.2 MB)."""
    return max(0, n_slots - n_used)


def pinned_experts(counts: np.ndarray, n_pin: int) -> list[int]:
    """The ``n_pin`` most selected experts by ``counts`` (ties: lower expert first)."""
    return [int(e) for e in np.argsort(-np.asarray(counts), kind="stable")[:n_pin]]


def moe_llama_share(header, moe: MoeModelInfo, n_ctx: int, n_ubatch: int, logits_all: bool = False) -> dict[str, int]:
    """llama.cpp's memory with the routed experts served by llamaflash (bytes), counted as the dense
    planner counts it (plan_llama_share.llama_memory): the vocabulary, every weight but the ``*_exps``
    tensors (file-backed, locked after load; token_embd by the rows used), the f16 KV cache, and the
    compute buffers: llama.cpp's CPU graph and logits, the expert splits' activations
    n_ubatch x n_used x (3 n_ff_exp + n_embd) f32, and the expert lane's per-pair buffers, per expert
    tensor (input ne0, output ne1) its gathered inputs, products and staged outputs
    n_ubatch x n_used x (ne0 + 2 ne1) f32 (csrc/experts/expert_lane.cpp, ExpertLane::Matmul)."""
    from .plan_llama_share import llama_memory

    experts = {t.name for layer in moe.layers for t in layer.tensors}
    n_ff = max(t.ne1 for layer in moe.layers for t in layer.tensors if t.kind != "down")
    split = n_ubatch * moe.n_used * (3 * n_ff + moe.n_embd) * 4
    lane = max(sum(n_ubatch * moe.n_used * (t.ne0 + 2 * t.ne1) * 4 for t in layer.tensors) for layer in moe.layers)
    return llama_memory(header, n_ctx, n_ubatch, experts, split + lane, True, logits_all)


def router_copy_bytes(moe: MoeModelInfo) -> int:
    """The engine's f32 copies of the routers (ExpertLayerSpec.router: n_expert x n_embd per layer that
    has one), for the next-layer prediction and draft routing."""
    return sum(layer.n_expert * moe.n_embd * 4 for layer in moe.layers if layer.router is not None)


def stock_need(header, moe: MoeModelInfo, n_ctx: int, n_ubatch: int, logits_all: bool = False) -> dict[str, int]:
    """What stock llama.cpp with plain weights keeps resident (bytes): the whole file in the page cache
    (``model_file``), its vocabulary, f16 KV cache and compute buffers at ``n_ubatch`` (no device), and
    the Python runtime. No margin: a slight overshoot reclaims a few clean file pages (re-read once),
    while serving experts from flash when the file fits costs far more."""
    from .plan_llama_share import llama_memory
    from .planner import RUNTIME_RSS_BYTES

    mem = llama_memory(header, n_ctx, n_ubatch, (), 0, True, logits_all)
    need = {
        "model_file": int(moe.file_size),
        "llama_vocab": mem["llama_vocab"],
        "kv_cache": mem["kv_cache"],
        "compute_buffers": mem["compute_buffers"],
        "python_runtime": RUNTIME_RSS_BYTES,
    }
    if logits_all:
        need["python_logits"] = mem["python_logits"]
    return need


def stock_reread_per_token(moe: MoeModelInfo, shortfall: int) -> float | None:
    """Bytes stock llama.cpp re-reads per decoded token when its page cache is ``shortfall`` bytes short
    of :func:`stock_need` (see STOCK_REREAD_AMPLIFICATION); None beyond STOCK_SHORTFALL_MAX, where
    the estimate does not hold (stock thrashes)."""
    routed = sum(layer.n_expert * layer.expert_bytes for layer in moe.layers)
    share = max(0, shortfall) / routed
    if share > STOCK_SHORTFALL_MAX:
        return None
    return STOCK_REREAD_AMPLIFICATION * share * moe.n_used * sum(layer.expert_bytes for layer in moe.layers)


def stock_ubatch(
    header, moe: MoeModelInfo, budget: int, n_ctx: int, n_ubatch: int | None, logits_all: bool = False
) -> int | None:
    """The n_ubatch at which stock fits ``budget`` bytes (:func:`stock_need`), or None: the user's
    ``n_ubatch`` when given, else the largest of llama-cpp-python's default (512) and the planner's
    smaller choices that fits (a smaller batch only slows prefill; decode runs as stock)."""
    from .planner import UBATCH_CHOICES

    if n_ubatch:
        candidates = [int(n_ubatch)]
    else:
        candidates = sorted(
            {u for u in (STOCK_DEFAULT_UBATCH, *UBATCH_CHOICES) if u <= STOCK_DEFAULT_UBATCH}, reverse=True
        )
    for u in candidates:
        if sum(stock_need(header, moe, n_ctx, u, logits_all).values()) <= budget:
            return u
    return None


def _stock_plan(
    budget: int,
    moe: MoeModelInfo,
    slot: int,
    need: dict[str, int],
    min_budget: int,
    n_ubatch: int,
    note: str,
    repacked: bool = False,
) -> ExpertPlan:
    """A plan that runs the model as stock llama.cpp (``fits``): no slots, nothing read; ``need`` is
    stock's memory as counted, ``note`` why stock runs, ``repacked`` whether stock's default layout
    fits (ExpertPlan.stock_repacked)."""
    return ExpertPlan(
        budget, True, moe.n_expert, {}, slot, 0, need, min_budget, n_ubatch, 0.0, 0.0, 0.0, None, [note], repacked
    )


def plan_experts(
    moe: MoeModelInfo,
    header,
    ram_budget_mb: float,
    *,
    n_ctx: int,
    disk: dict[str, Any],
    alignment: int = 4096,
    counts: dict[int, np.ndarray] | None = None,
    n_ubatch: int | None = None,
    n_slots: int | None = None,
    logits_all: bool = False,
) -> ExpertPlan:
    """The plan for ``moe`` under ``ram_budget_mb``; raises RamBudgetError below the minimum.
    ``n_slots``: the expert slots per layer the user asked for (then the engine serves the experts even
    when the whole model would fit; refused when those slots do not fit the budget); ``logits_all``: the
    Llama keeps every token's logits (counted, plan_llama_share.llama_memory)."""
    from .. import _native
    from ..errors import RamBudgetError
    from .planner import (
        MARGIN_FIXED_BYTES,
        MARGIN_FRACTION,
        RUNTIME_RSS_BYTES,
        UBATCH_BUDGET_SHARE,
        UBATCH_CHOICES,
        disk_throughput,
    )

    budget = int(ram_budget_mb * MiB)
    forced = n_slots is not None
    slot = max(
        int(_native.expert_slot_bytes([t.expert_bytes for t in layer.tensors], alignment)) for layer in moe.layers
    )
    n_layers = len(moe.layers)

    margin = int(MARGIN_FIXED_BYTES + MARGIN_FRACTION * budget)  # beside everything the plan counts

    def fixed_parts(u: int) -> dict[str, int]:
        parts = moe_llama_share(header, moe, n_ctx, u, logits_all)
        parts["router_copies"] = router_copy_bytes(moe)
        parts["python_runtime"] = RUNTIME_RSS_BYTES
        parts["margin"] = margin
        return parts

    user_ubatch = n_ubatch
    if n_ubatch is None:
        # the largest prefill batch whose buffers take at most UBATCH_BUDGET_SHARE of the budget and that
        # leaves n_used expert slots per layer (smaller batches when the budget is tight)
        choices = [u for u in UBATCH_CHOICES if u <= EXPERT_UBATCH]
        fitting = [
            u
            for u in choices
            if fixed_parts(u)["compute_buffers"] <= UBATCH_BUDGET_SHARE * budget
            and sum(fixed_parts(u).values()) + moe.n_used * slot * n_layers <= budget
        ]
        n_ubatch = fitting[0] if fitting else choices[-1]
    n_ubatch = int(n_ubatch)
    share = fixed_parts(n_ubatch)
    fixed = sum(share.values())
    min_slots = moe.n_used
    # the least budget: n_used slots per layer, the smallest prefill batch
    least = moe_llama_share(header, moe, n_ctx, UBATCH_CHOICES[-1], logits_all)
    # the margin is a share of the whole budget: budget = (everything else + fixed margin) / (1 - share)
    min_budget = math.ceil(
        (
            sum(least.values())
            + router_copy_bytes(moe)
            + RUNTIME_RSS_BYTES
            + MARGIN_FIXED_BYTES
            + slot * n_layers * min_slots
        )
        / (1 - MARGIN_FRACTION)
    )
    notes: list[str] = []
    stock_u = stock_ubatch(header, moe, budget, n_ctx, user_ubatch, logits_all) if n_slots is None else None
    if n_slots is not None:
        if not moe.n_used <= n_slots <= moe.n_expert:
            raise ValueError(
                f"flash_expert_slots={n_slots} must lie in [n_used, n_expert] = [{moe.n_used}, {moe.n_expert}]"
            )
        if fixed + n_slots * slot * n_layers > budget:
            raise RamBudgetError(
                f"flash_expert_slots={n_slots} needs {(fixed + n_slots * slot * n_layers) / MiB:.0f} MiB; "
                f"ram_budget_mb={ram_budget_mb:g} is too small for it"
            )
        min_slots = moe.n_used
    elif stock_u is not None:
        need = stock_need(header, moe, n_ctx, stock_u, logits_all)
        # repacked experts are anonymous memory of the file's size: safe only with the margin beside them
        repacked = sum(need.values()) + margin <= budget
        return _stock_plan(
            budget, moe, slot, need, min_budget, stock_u,
            f"stock fits: the model file and llama.cpp's buffers at n_ubatch {stock_u} "
            f"({sum(need.values()) / MiB:.0f} MiB) fit the budget",
            repacked,
        )  # fmt: skip
    if n_slots is None:
        n_slots = min(moe.n_expert, (budget - fixed) // (slot * n_layers)) if budget > fixed else 0
    if n_slots < min_slots:
        raise RamBudgetError(
            f"ram_budget_mb={ram_budget_mb:g} is below the minimum for this model ({math.ceil(min_budget / MiB)} MiB: "
            f"llama.cpp's dense part, KV cache and buffers {(fixed - share['margin']) / MiB:.0f} MiB, and "
            f"{min_slots} expert slots per layer of {slot / MiB:.2f} MiB); give at least "
            f"{math.ceil(min_budget / MiB)} MiB, or a smaller n_ctx"
        )
    n_slots = int(n_slots)
    n_pin = pinned_count(n_slots, moe.n_used) if counts else 0
    pinned: dict[int, list[int]] = {}
    miss = []
    for layer in moe.layers:
        c = counts.get(layer.layer) if counts else None
        if c is not None and np.sum(c) > 0 and n_pin > 0:
            pinned[layer.layer] = pinned_experts(c, n_pin)
        else:
            pinned[layer.layer] = []
        miss.append(
            lru_miss_rate(
                c if c is not None else np.ones(layer.n_expert), moe.n_used, n_slots, len(pinned[layer.layer])
            )
        )
    miss_rate = float(np.mean(miss))
    read = miss_rate * moe.n_used * sum(layer.expert_bytes for layer in moe.layers)
    bw = disk_throughput(disk, float(slot) / max(1, len(moe.layers[0].tensors)), EXPERT_READ_DEPTH)
    if not counts:
        notes.append("no routing statistics in the sidecar: hit rate predicted for uniform routing, nothing pinned")
    if not forced:
        # just below stock's need: stock's few page-cache misses against the expert cache's misses,
        # its need counted at the batch that leaves it least short. Stock then runs exactly as
        # llama-cpp-python would (the user's n_ubatch, else its default): at 1.03x the file, prefill
        # batches of 32 made stock re-read 2-4x the bytes per decoded token that its own batch (256)
        # did, for the same anonymous memory (bench/results/moe-qwen3moe-uniform-2450-c.json).
        u_min = int(user_ubatch or UBATCH_CHOICES[-1])
        u_stock = int(user_ubatch or STOCK_DEFAULT_UBATCH)
        need = stock_need(header, moe, n_ctx, u_min, logits_all)
        reread = stock_reread_per_token(moe, sum(need.values()) - budget)
        if reread is not None and reread * STOCK_FAULT_SLOWDOWN <= read:
            return _stock_plan(
                budget, moe, slot, need, min_budget, u_stock,
                f"stock llama.cpp is {(sum(need.values()) - budget) / MiB:.0f} MiB short of the file "
                f"and its buffers here: it re-reads ~{reread / 1e6:.0f} MB per token, the expert cache "
                f"would read ~{read / 1e6:.0f} MB",
            )  # fmt: skip
    return ExpertPlan(
        budget,
        False,
        n_slots,
        pinned,
        slot,
        slot * n_slots * n_layers,
        share,
        min_budget,
        n_ubatch,
        miss_rate,
        read,
        bw,
        (bw / read) if read > 0 else None,
        notes,
    )
