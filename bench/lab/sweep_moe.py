"""The speed–memory sweep (:mod:`llamaflash.bench.sweep`) of a mixture-of-experts model: its configs,
the expert planner's view of the ladder, and what the report needs to know about the model.

Configs (:data:`MOE_CONFIGS`): ``stock-norepack`` (llama-cpp-python with plain, file-backed weights
and flash attention: the stock configuration that runs under a limit, and the numerics llamaflash's
expert offload reproduces bit for bit), ``stock`` (llama-cpp-python's defaults: it repacks the experts
into anonymous memory, and a limit smaller than the model OOM-kills it) and ``llamaflash-nospec``
(``Llama(ram_budget_mb=budget, flash_speculative=False)``).

Predictions (:func:`predict_moe`) come from the expert planner (plugin/planning/expert_plan.py
``plan_experts``) with the inputs a Llama loading the pair plans with: the sidecar's routing statistics
(uniform routing without them), the disk profile (the saved probe of the sidecar's filesystem, else the
built-in default), the sweep's n_ctx, no n_ubatch. Per budget: refused (below ``min_budget_bytes``),
stock (``fits``: the model runs as stock llama.cpp) or experts, and for experts the plan's predicted
hit rate (1 - ``miss_rate``), bytes read per token (``read_bytes_per_token``) and I/O bound
(``predicted_tok_s`` = the disk's rate for expert reads ÷ those bytes). The planner predicts no decode
rate beyond that bound, so ``nospec_tok_s`` / ``spec_tok_s`` / ``stock_tok_s`` stay None.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from . import memlimit
from .decode_report import expert_read_rate
from .pagecache import MiB
from .worker import STOCK_NO_REPACK

#: The configs an MoE model's sweep measures by default.
MOE_CONFIGS = (STOCK_NO_REPACK, "stock", memlimit.NO_SPECULATION_CONFIG)
#: The lane a budget's expert plan gives llamaflash: the routed experts served from flash.
EXPERTS_LANE = "experts"
STOCK_LANE = "stock"


def read_moe(model_path: Path):
    """``(header, moe)``: the model's parsed GGUF header and its MoE layout (moe None: a dense model)."""
    from llamaflash.files.experts import read_moe_model
    from llamaflash.files.gguf_model import read_base_model

    header = read_base_model(str(model_path)).header
    return header, read_moe_model(header)


def default_configs(model_path: Path) -> tuple[str, ...]:
    """MOE_CONFIGS for an MoE model, else the dense sweep's configs."""
    from .sweep import CONFIGS

    return MOE_CONFIGS if read_moe(model_path)[1] is not None else CONFIGS


def predict_moe(
    model_path: Path,
    sidecar: Path,
    budgets_mb: Sequence[int],
    n_ctx: int,
    disk: Optional[dict] = None,
    header: Any = None,
    moe: Any = None,
) -> dict[str, Any]:
    """The expert planner's view of the ladder, in the shape of :func:`llamaflash.bench.sweep.predict`'s:
    ``kind`` "moe", ``least_mb`` (plan_experts' ``min_budget_bytes``), ``stock_need_mb`` (what stock
    with plain weights keeps resident at llama-cpp-python's default n_ubatch: expert_plan.stock_need),
    ``disk_profile``, ``routing_tokens`` (the sidecar's calibration tokens; 0: uniform routing assumed)
    and per budget a dict: ``lane`` (stock or experts; None when refused), ``refused`` (the
    RamBudgetError's message), ``hit_rate`` (1 - the plan's miss rate), ``flash_bytes_per_token``,
    ``io_bound_tok_s``, ``slots_per_layer``, ``pinned_per_layer``, ``disk_mb_s`` (experts lane only),
    ``n_ubatch`` and ``note`` (why stock runs), with ``nospec_tok_s``, ``spec_tok_s`` and
    ``stock_tok_s`` None (no decode prediction)."""
    from llamaflash.errors import RamBudgetError
    from llamaflash.files import expert_sidecar
    from llamaflash.planning import expert_plan
    from llamaflash.planning.plan_disk import default_disk, disk_source

    if moe is None:
        header, moe = read_moe(model_path)
    disk = disk or default_disk()
    info = expert_sidecar.read_expert_sidecar(sidecar)
    counts = {s.layer: s.counts for s in info.layers} if info.routing_tokens > 0 else None

    def plan(budget_mb: float):
        return expert_plan.plan_experts(moe, header, budget_mb, n_ctx=n_ctx, disk=disk, counts=counts)

    least_mb = plan(1 << 20).min_budget_bytes / MiB
    stock = expert_plan.stock_need(header, moe, n_ctx, expert_plan.STOCK_DEFAULT_UBATCH)
    points: dict[str, dict[str, Any]] = {}
    for b in budgets_mb:
        row: dict[str, Any] = {
            "lane": None,
            "refused": None,
            "io_bound_tok_s": None,
            "nospec_tok_s": None,
            "spec_tok_s": None,
            "stock_tok_s": None,
            "hit_rate": None,
            "flash_bytes_per_token": None,
        }
        points[str(b)] = row
        try:
            p = plan(b)
        except RamBudgetError as e:
            row["refused"] = str(e)
            continue
        row["n_ubatch"] = p.n_ubatch
        if p.fits:
            row.update(lane=STOCK_LANE, note=p.notes[0] if p.notes else None)
            continue
        row.update(
            lane=EXPERTS_LANE,
            hit_rate=1.0 - p.miss_rate,
            flash_bytes_per_token=p.read_bytes_per_token,
            io_bound_tok_s=p.predicted_tok_s,
            slots_per_layer=p.n_slots,
            pinned_per_layer=p.pinned_per_layer,
            disk_mb_s=p.disk_bytes_per_s / 1e6,
        )
    return {
        "kind": "moe",
        "least_mb": least_mb,
        "stock_need_mb": sum(stock.values()) / MiB,
        "disk_profile": disk.get("saved_at") or disk_source(disk),
        "routing_tokens": info.routing_tokens,
        "budgets": points,
    }


def moe_record(model_path: Path, sidecar: Path, moe: Any, n_ctx: int) -> dict[str, Any]:
    """The payload's ``moe`` entry: the model's expert layout and ``disk``, the expert reads' disk rate
    (decode_report.expert_read_rate) that turns a run's bytes per token into its I/O bound."""
    return {
        "architecture": moe.architecture,
        "n_layer": len(moe.layers),
        "n_expert": moe.n_expert,
        "n_used": moe.n_used,
        "expert_bytes": moe.expert_bytes_total,
        "file_bytes": moe.file_size,
        "disk": expert_read_rate(model_path, sidecar, n_ctx),
    }


__all__ = ("MOE_CONFIGS", "EXPERTS_LANE", "STOCK_LANE", "read_moe", "default_configs", "predict_moe", "moe_record")
