"""What `llamaflash.Llama` does with an MoE model: decide, plan, open the expert engine, report.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import SidecarNotFoundError
from ..files import expert_sidecar, experts
from ..files.gguf_model import BaseModelInfo, base_identity
from ..planning import expert_plan

#: flash_mode reported for an MoE model served by the expert engine.
EXPERTS_MODE = "experts"
#: environment variable turning the next-layer prefetch off ("0") for measurements; default on
PREFETCH_ENV = "LLAMAFLASH_EXPERT_PREFETCH"


def prefetch_enabled() -> bool:
    """Whether the engine prefetches the next layer's predicted experts (``$LLAMAFLASH_EXPERT_PREFETCH``:
    "0" off, "1" or unset on; anything else is refused)."""
    value = os.environ.get(PREFETCH_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{PREFETCH_ENV}={value!r}: use 1 (prefetch, the default) or 0 (no prefetch)")
    return value == "1"


@dataclass
class ExpertSetup:
    """The outcome of :func:`prepare`: ``model`` None = run as stock (``reason`` says why)."""

    reason: str
    model: Any = None  # _native.ExpertModel
    plan: Optional[expert_plan.ExpertPlan] = None
    sidecar: Optional[Path] = None
    moe: Optional[experts.MoeModelInfo] = None


def plan_setup(
    model_path: str,
    base: BaseModelInfo,
    moe: experts.MoeModelInfo,
    *,
    sidecar_path: Optional[str],
    ram_budget_mb: Optional[float],
    n_ctx: int,
    n_ubatch: Optional[int],
    disk_profile: Any,
    n_slots: Optional[int] = None,
    logits_all: bool = False,
    budget_option: str = "ram_budget_mb",
) -> Tuple[ExpertSetup, Optional[expert_sidecar.ExpertSidecarInfo]]:
    """Checks the pair and plans, opening nothing: the setup (``model`` None) and the sidecar's info
    (None where it runs as stock before reading one). ``budget_option``: how messages name the budget
    (``--ram-budget-mb`` on the command line)."""
    from ..files.sidecar import default_sidecar_path
    from ..planning import disk_probe

    why = experts.check_layout(moe)
    if why is not None:
        return ExpertSetup(f"running as stock: {why}", moe=moe), None
    if ram_budget_mb is None:
        return ExpertSetup(
            "running as stock: an MoE model in memory runs as stock llama.cpp (experts are served "
            f"from flash only under {budget_option})",
            moe=moe,
        ), None
    sidecar = Path(sidecar_path) if sidecar_path is not None else default_sidecar_path(model_path)
    if not sidecar.exists():
        raise SidecarNotFoundError(
            f"{budget_option} needs the expert sidecar of '{model_path}' (none at '{sidecar}'); create it with "
            f"`llamaflash convert {model_path}`"
        )
    info = expert_sidecar.read_expert_sidecar(sidecar)
    expert_sidecar.validate_expert_pair(moe, base_identity(model_path, base), info)
    counts = {s.layer: s.counts for s in info.layers} if info.routing_tokens > 0 else None
    plan = expert_plan.plan_experts(
        moe,
        base.header,
        ram_budget_mb,
        n_ctx=n_ctx,
        n_ubatch=n_ubatch,
        disk=disk_probe.resolve_profile(disk_profile, sidecar) or _default_disk(),
        counts=counts,
        n_slots=n_slots,
        logits_all=logits_all,
    )
    if plan.fits:
        reason = f"running as stock under {budget_option}={ram_budget_mb:g}: {plan.notes[0]}"
    else:
        reason = f"experts served from flash: {plan.n_slots} of {moe.n_expert} experts per layer cached"
    return ExpertSetup(reason, plan=plan, sidecar=sidecar, moe=moe), info


def prepare(
    model_path: str,
    base: BaseModelInfo,
    moe: experts.MoeModelInfo,
    *,
    sidecar_path: Optional[str],
    ram_budget_mb: Optional[float],
    n_ctx: int,
    n_ubatch: Optional[int],
    io_engine: str,
    disk_profile: Any,
    verify: bool,
    n_slots: Optional[int] = None,
    logits_all: bool = False,
) -> ExpertSetup:
    """Checks the pair and plans (:func:`plan_setup`); opens the engine when there is something to serve."""
    from .. import _native

    setup, info = plan_setup(
        model_path,
        base,
        moe,
        sidecar_path=sidecar_path,
        ram_budget_mb=ram_budget_mb,
        n_ctx=n_ctx,
        n_ubatch=n_ubatch,
        disk_profile=disk_profile,
        n_slots=n_slots,
        logits_all=logits_all,
    )
    if setup.plan is None or setup.plan.fits:
        return setup
    config = engine_config(
        model_path, moe, info, setup.plan, io_engine=io_engine, verify=verify, prefetch=prefetch_enabled()
    )
    setup.model = _native.ExpertModel.open(config)
    return setup


def _default_disk() -> Dict[str, Any]:
    from ..planning.planner import default_disk

    return default_disk()


def engine_config(
    model_path: str,
    moe: experts.MoeModelInfo,
    info: expert_sidecar.ExpertSidecarInfo,
    plan: expert_plan.ExpertPlan,
    *,
    io_engine: str = "auto",
    verify: bool = True,
    prefetch: bool = True,
):
    """The native ExpertConfig of a plan."""
    from .. import _native

    stats = {s.layer: s for s in info.layers}
    config = _native.ExpertConfig()
    config.base_path = os.fspath(model_path)
    config.n_embd = moe.n_embd
    config.io_engine = io_engine
    config.verify = verify
    config.prefetch = prefetch
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
        if layer.router is not None:  # f32 copy: next-layer prediction and draft routing (plan: router_copies)
            spec.router = experts.router_matrix(model_path, layer.router).ravel().tolist()
        layers.append(spec)
    config.layers = layers
    return config


def stats(model, plan: Optional[expert_plan.ExpertPlan], moe: Optional[experts.MoeModelInfo]) -> Dict[str, Any]:
    """`flash_stats()["experts"]`: the engine's counters and what follows from them."""
    s = dict(model.stats())
    needed = max(1, s["experts_needed"])
    s["hit_rate"] = s["hits"] / needed
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
    if moe is not None:
        s["n_expert"], s["n_used"], s["moe_layers"] = moe.n_expert, moe.n_used, len(moe.layers)
    return s


def dense_ranges(moe: experts.MoeModelInfo, header, page: int) -> List[Tuple[int, int]]:
    """The file ranges [start, end) of the model's dense part that stay locked in RAM under a budget:
    every tensor but the routed experts and, where an output matrix exists, the token embedding table
    (read by rows; its pages come and go as tokens need them). Each tensor's range is widened to
    whole pages of ``page`` bytes (mlock locks pages) and ranges that then touch are merged; sorted.
    The one definition for llamaflash.Llama (lock_dense_part) and the plan file of the tools' library
    (`llamaflash env`, which locks the same ranges after load)."""
    expert_names = {t.name for layer in moe.layers for t in layer.tensors}
    tied = not any(t.name == "output.weight" for t in header.tensors)
    spans = sorted(
        (t.offset // page * page, -(-(t.offset + t.nbytes) // page) * page)
        for t in header.tensors
        if t.nbytes > 0 and t.name not in expert_names and (tied or t.name != "token_embd.weight")
    )
    merged: List[Tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def lock_dense_part(model_path: str, moe: experts.MoeModelInfo, header) -> Dict[str, Any]:
    """Pins llama.cpp's file-backed copy of the model's dense part (dense_ranges) in RAM (mlock), so
    that memory pressure from the expert cache can never evict it. llama.cpp maps the base file (its
    default mmap load); the pages of each range are found through /proc/self/maps. Returns what was
    locked; a refused mlock (RLIMIT_MEMLOCK) is reported, not raised: the model still runs, only less
    well under pressure."""
    import ctypes
    import mmap as _mmap

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
    for lo_file, hi_file in dense_ranges(moe, header, _mmap.PAGESIZE):
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
