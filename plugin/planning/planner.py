"""RAM-budget planner for the flash-offload engine: how a process's RAM budget is split, which neuron
clusters to pin, and what decode speed the disk allows (``llamaflash plan``; docs/PLANNER.md).

Every size is in bytes; "MiB" is 2**20 bytes, the unit of ``ram_budget_mb`` (as ``llamaflash bench
--ram-limit-mb``). :func:`plan_offload` is the entry point; the parts, one job each:

  plan_disk          the disk model: device seconds per read request from a probed (or default) profile
  plan_llama_share   llama.cpp's memory: vocabulary, weights it keeps, KV cache, compute buffers
  plan_clusters      the neuron cache: cluster tables, which clusters to pin, flash reads per token
  plan_budget        the parts of a budget for a candidate layout, and the least budget it runs in
  plan_search        the layout that fits with the fastest predicted decode, its n_ubatch weighed with
                     the prompt's prefill; the draft copy one more candidate
  prefill_speed      the predicted time to first token of a prompt at an n_ubatch
  plan_explain       why each part has its size, the notes, the printed table
  plan_result        OffloadPlan, the plain value the engine is configured from
  draft_plan         the predicted delivered decode that decides for or against the draft copy
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import RamBudgetError, SidecarError
from ..files.gguf_header import GGUFHeader, read_gguf_header
from ..files.gguf_model import read_base_model
from ..files.sidecar import SidecarInfo, default_sidecar_path, validate_pair
from .plan_budget import (
    GATE_WINDOW_LAYERS,
    IN_MEMORY_MARGIN_FIXED_BYTES,
    MARGIN_FIXED_BYTES,
    MARGIN_FRACTION,
    RUNTIME_RSS_BYTES,
    UBATCH_BUDGET_SHARE,
    UBATCH_CHOICES,
    VERIFY_ROWS,
    PlanRequest,
    draft_copy_bytes,
)
from .plan_clusters import CLUSTER_SIZES, DEPTH_NEAR_BEST, GATE_READ_DEPTH, PREFETCH_MIN_PROBS, cluster_tables
from .plan_disk import default_disk, disk_throughput
from .plan_llama_share import COMPUTE_SAFETY, VOCAB_BYTES_PER_ENTRY, VOCAB_FIXED_BYTES, MiB, llama_share
from .plan_result import OffloadPlan
from .plan_search import copy_layout, plan_layout, plan_with_copy, plan_without_copy, with_ubatch_trade
from .prefill_speed import DEFAULT_PROMPT_TOKENS

__all__ = [
    "CLUSTER_SIZES",
    "COMPUTE_SAFETY",
    "DEPTH_NEAR_BEST",
    "GATE_READ_DEPTH",
    "GATE_WINDOW_LAYERS",
    "MARGIN_FIXED_BYTES",
    "IN_MEMORY_MARGIN_FIXED_BYTES",
    "MARGIN_FRACTION",
    "MiB",
    "OffloadPlan",
    "PREFETCH_MIN_PROBS",
    "RUNTIME_RSS_BYTES",
    "RamBudgetError",
    "UBATCH_BUDGET_SHARE",
    "UBATCH_CHOICES",
    "VERIFY_ROWS",
    "VOCAB_BYTES_PER_ENTRY",
    "VOCAB_FIXED_BYTES",
    "default_disk",
    "disk_throughput",
    "draft_copy_bytes",
    "llama_share",
    "plan_offload",
]


def plan_offload(
    model_path: str | os.PathLike,
    sidecar_path: str | os.PathLike | None,
    ram_budget_mb: float,
    *,
    n_ctx: int = 512,
    n_ubatch: int | None = None,
    disk: dict[str, Any] | None = None,
    runtime_rss_bytes: int | None = None,
    cluster_size: int | None = None,
    prefetch_layers: int = 2,
    stream_gate: bool | None = None,
    info: SidecarInfo | None = None,
    header: GGUFHeader | None = None,
    draft_copy: bool | None = None,
    logits_all: bool = False,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    flash_attn: bool = True,
    prompt_pages_freed: bool = True,
) -> OffloadPlan:
    """Plan the RAM of the flash-offload engine for ``model_path`` + its format-2 sidecar under
    ``ram_budget_mb`` MiB (see the module docstring and :class:`OffloadPlan`).

    ``n_ubatch`` None: of UBATCH_CHOICES, the one whose plan predicts the shortest request: TTFT of
    ``prompt_tokens`` (prefill_speed) plus prefill_speed.REQUEST_DECODE_TOKENS decoded; the plan's
    ``prefill`` and ``ubatch_choice`` say what each n_ubatch predicts (:mod:`plan_search`);
    ``disk`` None: :func:`default_disk`; ``runtime_rss_bytes`` None: RUNTIME_RSS_BYTES;
    ``cluster_size`` None: the CLUSTER_SIZES entry with the best predicted tok/s; ``stream_gate`` None:
    the gate matrices stay resident when that fits the budget, else they are streamed from flash
    every token (GATE_WINDOW_LAYERS layers in memory; every gate row read per token). Raises
    :class:`RamBudgetError` below the minimum, :class:`SidecarError` for a sidecar without neuron
    statistics, and what :func:`~llamaflash.files.sidecar.validate_pair` raises for a bad pair.

    ``draft_copy``: keep the sidecar's draft copy resident for speculative self-drafts (True; the gate
    then stays resident, SidecarError without a copy), not (False), or None: plan both ways and keep
    the one with the higher predicted delivered decode speed (:mod:`llamaflash.planning.draft_plan`).

    ``logits_all``: the Llama keeps every token's logits (``Llama(logits_all=True)``): counted.
    ``flash_attn``: the context runs flash attention (offload's default, batch-invariant numerics): its
    compute buffers hold no KQ scores.

    ``prompt_pages_freed``: the host frees a prompt's compute pages after evaluating it, so that prompt
    batches and decode take turns in the cold region's memory (llamaflash.Llama; plan_budget); False for
    a host that does not (the backend library in llama.cpp's tools): every part counted in full.

    ``info`` / ``header``: the pair's :func:`~llamaflash.files.sidecar.validate_pair` result and the base
    model's parsed header, when the caller has them (``llamaflash.Llama``), so that one load parses
    the base header once and checks the pair's identity once; None: read here."""
    if (
        n_ctx < 1
        or prefetch_layers < 0
        or (cluster_size is not None and cluster_size < 1)
        or (n_ubatch is not None and n_ubatch < 1)
        or prompt_tokens < 1
    ):
        raise ValueError(
            f"n_ctx {n_ctx}, n_ubatch {n_ubatch}, prompt_tokens {prompt_tokens} and cluster_size "
            f"{cluster_size} must be positive, "
            f"prefetch_layers {prefetch_layers} non-negative"
        )
    sidecar = Path(sidecar_path) if sidecar_path is not None else default_sidecar_path(model_path)
    if info is None:
        model = read_base_model(model_path)
        info, header = validate_pair(model_path, sidecar, model=model), model.header
    copy_bytes = draft_copy_bytes(info)
    if draft_copy:
        if copy_bytes is None:
            raise SidecarError(
                f"{sidecar}: no draft copy in this sidecar; re-create it with `llamaflash convert "
                f"{model_path} --force` (--draft-type auto), or plan without one"
            )
        if stream_gate:
            raise ValueError(
                "draft_copy needs the gate resident (a self-draft never waits for flash): stream_gate must not be True"
            )
    if info.sparsity is None:
        raise SidecarError(
            f"{sidecar}: format-{info.format_version} sidecar without neuron statistics; the planner "
            f"needs per-neuron activation frequencies. Re-create it with `llamaflash convert "
            f"{model_path} --force` (without --no-calibration)."
        )
    req = PlanRequest(
        model_path=str(model_path),
        sidecar_path=sidecar,
        budget_mb=ram_budget_mb,
        info=info,
        header=header if header is not None else read_gguf_header(model_path),
        budget_bytes=int(ram_budget_mb * MiB),
        # the runtime is a measured constant, not this process's RSS: a plan depends on the model, the
        # budget and the settings only (docs/PLANNER.md, "Accounting rule")
        runtime_bytes=runtime_rss_bytes if runtime_rss_bytes is not None else RUNTIME_RSS_BYTES,
        runtime_given=runtime_rss_bytes is not None,
        n_ctx=n_ctx,
        n_ubatch=n_ubatch,
        cluster_size=cluster_size,
        prefetch_layers=prefetch_layers,
        stream_gate=stream_gate,
        disk=disk,
        tables=tuple(cluster_tables(info, cluster_size)),
        logits_all=bool(logits_all),
        prompt_tokens=int(prompt_tokens),
        flash_attn=bool(flash_attn),
        prompt_pages_freed=bool(prompt_pages_freed),
    )
    return with_ubatch_trade(req, _plan_draft_copy(req, info, draft_copy, copy_bytes))


def _plan_draft_copy(
    req: PlanRequest, info: SidecarInfo, draft_copy: bool | None, copy_bytes: int | None
) -> OffloadPlan:
    """The plan with the draft copy (``draft_copy`` True), without it (False, or no copy), or the one of
    the two with the higher predicted delivered decode (None)."""
    from . import draft_plan

    if draft_copy:
        return plan_with_copy(req, copy_bytes)
    if copy_bytes is None:
        return plan_without_copy(req)
    # n_ubatch as if the copy may be kept, whether or not it is: the same tokens every way (prefill)
    without = plan_without_copy(req, copy_bytes)
    if draft_copy is False:
        return without
    if without.stream_gate:
        return draft_plan.copy_unused(
            without, "the gate is streamed at this budget, and a self-draft needs it resident"
        )
    try:  # the same n_ubatch: prefill numerics depend on it, and the copy must not change a token
        layout = copy_layout(req, without.n_ubatch, copy_bytes)
    except RamBudgetError:
        return draft_plan.copy_does_not_fit(without, copy_bytes)
    return draft_plan.choose_draft_copy(info, without, plan_layout(req, layout, without.least_budget_bytes))
