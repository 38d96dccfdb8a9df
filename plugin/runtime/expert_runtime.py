"""What `llamaflash.Llama` does with an MoE model beside the plan (runtime/model_plan.py): the expert
engine's configuration, its report, and locking the dense part after load.

Under ``ram_budget_mb`` an MoE model's routed experts (``*_exps``) are served by the expert engine
(csrc/experts/expert_*.h) from the base file through an expert cache; every other weight stays resident in
llama.cpp's mapping of the file and is locked after load (mlock), so the kernel cannot reclaim it under pressure. The
result is bit-identical to stock llama.cpp with plain weights (use_extra_bufts=False), whatever the
cache holds. Without a budget, when stock fits the budget (or so nearly that its page-cache misses cost
less than the expert cache's: expert_plan), or for an architecture not served,
the model runs as stock llama.cpp and `flash_stats()["decision"]` says why.
"""

from __future__ import annotations

import os
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

from ..files import expert_sidecar, experts
from ..planning import expert_plan

#: flash_mode reported for an MoE model served by the expert engine.
EXPERTS_MODE = "experts"
#: ggml_type of a router stored in float32
GGML_TYPE_F32 = 0
#: environment variables turning the next-layer prefetch, or computing resident experts while a
#: layer's misses are read, off ("0") for measurements; default on
PREFETCH_ENV = "LLAMAFLASH_EXPERT_PREFETCH"
OVERLAP_ENV = "LLAMAFLASH_EXPERT_OVERLAP"


def _switch(name: str, what: str) -> bool:
    value = os.environ.get(name, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: use 1 ({what}, the default) or 0 (no {what})")
    return value == "1"


def prefetch_enabled() -> bool:
    """Whether the engine prefetches the next layer's predicted experts (``$LLAMAFLASH_EXPERT_PREFETCH``:
    "0" off, "1" or unset on; anything else is refused)."""
    return _switch(PREFETCH_ENV, "prefetch")


def overlap_enabled() -> bool:
    """Whether a layer's resident experts are computed while its misses are read
    (``$LLAMAFLASH_EXPERT_OVERLAP``: "0" off, "1" or unset on; anything else is refused)."""
    return _switch(OVERLAP_ENV, "overlap")


def routers_in_f32(moe: experts.MoeModelInfo) -> bool:
    """Whether every MoE layer's router is stored in f32, so that the engine's copy is its exact
    bytes and the expert lane can compute the router's MUL_MAT (ExpertConfig.router_rows)."""
    return all(layer.router is not None and layer.router.ggml_type == GGML_TYPE_F32 for layer in moe.layers)


def engine_config(
    model_path: str,
    moe: experts.MoeModelInfo,
    info: expert_sidecar.ExpertSidecarInfo,
    plan: expert_plan.ExpertPlan,
    *,
    io_engine: str = "auto",
    verify: bool = True,
    prefetch: bool = True,
    overlap: bool = True,
    router_rows: bool = False,
):
    """The native ExpertConfig of a plan, without the routers: the plan file locates each layer's router
    in the base model (plan_file.EnginePlan.routers) and the reader loads it as float32 (the copy
    next-layer prediction and draft routing use; expert_plan counts it as router_copies).
    ``router_rows``: the lane also computes each router's MUL_MAT, every row as ggml-cpu computes a row
    alone (csrc/experts/router_rows.h; needs routers_in_f32), so that batch-invariant evaluation needs
    no filler row after a lone token."""
    from .. import _native

    stats = {s.layer: s for s in info.layers}
    config = _native.ExpertConfig()
    config.base_path = os.fspath(model_path)
    config.n_embd = moe.n_embd
    config.io_engine = io_engine
    config.verify = verify
    config.prefetch = prefetch
    config.overlap = overlap
    config.router_rows = router_rows
    layers = []
    for layer in moe.layers:
        spec = _native.ExpertLayerSpec()
        spec.layer = layer.layer
        spec.n_expert = layer.n_expert
        spec.n_used = moe.n_used
        tensors = []
        for t in layer.tensors:
            ts = _native.ExpertTensorSpec()
            ts.kind = getattr(_native.ExpertTensorKind, t.kind)
            ts.offset = t.offset
            ts.type = t.ggml_type
            ts.ne0, ts.ne1 = t.ne0, t.ne1
            ts.expert_bytes = t.expert_bytes
            ts.checksums = [int(c) for c in stats[layer.layer].checksums[t.kind]] if verify else []
            tensors.append(ts)
        spec.tensors = tensors
        spec.n_slots = plan.n_slots
        spec.pinned = plan.pinned.get(layer.layer, [])
        layers.append(spec)
    config.layers = layers
    return config


def stats(model, plan: Optional[expert_plan.ExpertPlan], moe: Optional[experts.MoeModelInfo]) -> Dict[str, Any]:
    """`flash_stats()["experts"]`: the engine's counters and what follows from them."""
    s = dict(model.stats())
    needed = max(1, s["experts_needed"])
    s["hit_rate"] = s["hits"] / needed
    # the experts that were resident before the token's prefetch reached them: the rate the plan
    # predicts (plan.miss_rate models the cache without prefetch); prefetched and used ones excluded
    s["resident_hit_rate"] = (s["hits"] - s["prefetch_used"]) / needed
    s["prefetch_recall"] = (
        s["prefetch_used"] / (s["prefetch_used"] + s["misses"]) if s["prefetch_used"] + s["misses"] else None
    )
    s["prefetch_waste"] = s["prefetch_wasted"] / s["prefetched"] if s["prefetched"] else None
    tokens = s["tokens"]
    s["bytes_read_per_token"] = s["bytes_read"] / tokens if tokens else None
    s["io_wait_per_token_s"] = s["io_wait_seconds"] / tokens if tokens else None
    s["resident_bytes"] = model.resident_bytes
    s["io_engine"] = model.io_engine
    s["direct_io"] = model.direct
    if plan is not None:
        s["slots_per_layer"] = plan.n_slots
        s["pinned_per_layer"] = max((len(v) for v in plan.pinned.values()), default=0)
        s["predicted_miss_rate"] = plan.miss_rate
        s["predicted_tok_s_io_bound"] = plan.predicted_tok_s
        # what the plan counted under the budget (bytes): llama.cpp's and the process's parts (the KV
        # cache at the full n_ctx among them) and the expert cache
        s["plan_parts"] = {**plan.share, "expert_cache": plan.cache_bytes}
        s["budget_bytes"] = plan.budget_bytes
    if moe is not None:
        s["n_expert"], s["n_used"], s["moe_layers"] = moe.n_expert, moe.n_used, len(moe.layers)
    return s


def dense_ranges(
    moe: experts.MoeModelInfo, header, page: int, held_elsewhere: Collection[str] = ()
) -> List[Tuple[int, int]]:
    """The file ranges [start, end) of the model's dense part that stay locked in RAM under a budget:
    every tensor but the routed experts, those in ``held_elsewhere`` (weights the llamaflash device
    holds a copy of: matmul_rows) and, where an output matrix exists, the token embedding table (read
    by rows; its pages come and go as tokens need them). Each tensor's range is widened to
    whole pages of ``page`` bytes (mlock locks pages) and ranges that then touch are merged; sorted.
    The one definition for llamaflash.Llama (lock_dense_part) and the plan file of the tools' library
    (`llamaflash env`, which locks the same ranges after load)."""
    expert_names = {t.name for layer in moe.layers for t in layer.tensors}
    tied = not any(t.name == "output.weight" for t in header.tensors)
    spans = sorted(
        (t.offset // page * page, -(-(t.offset + t.nbytes) // page) * page)
        for t in header.tensors
        if t.nbytes > 0
        and t.name not in expert_names
        and t.name not in held_elsewhere
        and (tied or t.name != "token_embd.weight")
    )
    merged: List[Tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def lock_dense_part(model_path: str, ranges: Sequence[Tuple[int, int]]) -> Dict[str, Any]:
    """Pins llama.cpp's file-backed copy of the model's dense part (``ranges``: the plan's
    dense_ranges, file ranges [start, end) in whole pages) in RAM (mlock), so
    that memory pressure from the expert cache can never evict it. llama.cpp maps the base file (its
    default mmap load); the pages of each range are found through /proc/self/maps. Returns what was
    locked; a refused mlock (RLIMIT_MEMLOCK) is reported, not raised: the model still runs, only less
    well under pressure."""
    import ctypes

    path = os.path.realpath(model_path)
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip() == path:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                maps.append((start, end, int(parts[2], 16)))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    locked, failed, errno = 0, 0, 0
    for lo_file, hi_file in ranges:
        for start, end, off in maps:  # a mapping's offset is page-aligned: so are the addresses
            lo, hi = max(lo_file, off), min(hi_file, off + (end - start))
            if lo >= hi:
                continue
            if libc.mlock(start + lo - off, hi - lo) == 0:
                locked += hi - lo
            else:
                failed += hi - lo
                errno = ctypes.get_errno()
    out: Dict[str, Any] = {"dense_locked_bytes": locked, "mapped": bool(maps)}
    if failed:
        out["dense_lock_failed_bytes"] = failed
        out["dense_lock_error"] = os.strerror(errno)
    return out
