"""The plan of one model load, made once for both hosts: `llamaflash.Llama`, which opens it in this
process, and `llamaflash env`, which writes it for the llama.cpp tools. Four stages, each a function:

  identify_model  the one parse of the base model's header (dense FFN or mixture-of-experts)
  find_sidecar    the sidecar, found and checked against the model (None: none is used)
  decide_mode     stock, dense, sparse, offload or experts, and why
  plan_load       the typed plan: :class:`ModelPlan`

:func:`plan_model` runs them in order. A plan that serves the model carries an
:class:`~llamaflash.files.plan_file.EnginePlan` (its identity and the native engine configuration):
the data both hosts hand to the native engine through the same entry point
(csrc/backend/plan_reader.h), serialised by :mod:`llamaflash.files.plan_file`. The rest of a
ModelPlan is what a host does around the engine (llama.cpp's batch sizes, speculation, what to say).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from ..errors import RamBudgetError, SidecarNotFoundError
from ..files import experts, gguf_model
from ..files import plan_keys as K
from ..files.plan_file import EnginePlan, PlanIdentity
from ..files.sidecar import default_sidecar_path, validate_pair
from ..planning import budget_decision, lane_decision
from . import speculative
from .llama_settings import DENSE_UP_MAX_SPARSITY, _has_sparsity, _level_sparsity, sparsity_thresholds
from .notices import warn_no_sidecar

STOCK = "stock"  # llama.cpp runs the model untouched
OFFLOAD = "offload"  # dense FFN rows from flash through the neuron cache, under a RAM budget
EXPERTS = "experts"  # an MoE model's routed experts from flash through the expert cache


@dataclass(frozen=True)
class LoadRequest:
    """What a host asks for, its arguments already type-checked. ``flash_mode``: "auto", "dense" or
    "sparse" (with a budget, "auto" and "sparse" plan offload). llama.cpp's settings the plan counts:
    ``n_ctx``, ``n_batch`` / ``n_ubatch`` (None: the plan's), ``logits_all``, ``use_mmap``,
    ``flash_attn``, ``embedding``. ``batch_invariant``: llamaflash's weights not repacked.
    ``speculation``: the host's ``flash_speculative`` argument; ``user_draft``: a draft model given.
    ``prompt_pages_freed``: the host frees a prompt's compute pages after it (planner.plan_offload).
    ``require_sidecar``: a missing sidecar is an error (else the model runs stock); ``cli``: messages
    spell options as command-line flags. ``deterministic``: answers independent of batching
    (``deterministic=True``): the expert lane computes an MoE's f32 routers row by row too."""

    model_path: str
    sidecar_path: Optional[str] = None
    flash_mode: str = "auto"
    sparsity: Optional[float] = None
    max_sparse_tokens: int = 1
    dense_up: Optional[bool] = None
    ram_budget_mb: Optional[float] = None
    n_ctx: int = 512
    n_batch: Optional[int] = None
    n_ubatch: Optional[int] = None
    logits_all: bool = False
    use_mmap: Optional[bool] = None
    flash_attn: bool = False
    embedding: bool = False
    io_engine: str = "auto"
    stream_gate: Optional[bool] = None
    disk_profile: Any = None
    draft_copy: Optional[bool] = None
    verify: bool = True
    expert_slots: Optional[int] = None
    prompt_tokens: Optional[int] = None
    batch_invariant: bool = False
    speculation: Any = None
    user_draft: bool = False
    prompt_pages_freed: bool = True
    require_sidecar: bool = False
    cli: bool = False
    deterministic: bool = False

    def option(self, name: str) -> str:
        """How messages name an option: ``ram_budget_mb`` or ``--ram-budget-mb``."""
        return "--" + name.replace("_", "-") if self.cli else name


@dataclass(frozen=True)
class ModelId:
    """The model, identified once: its path, parsed header (``base``) and, for a mixture-of-experts
    model, its expert layout (``moe``; None for a dense FFN model)."""

    path: str
    base: gguf_model.BaseModelInfo
    moe: Optional[experts.MoeModelInfo]


@dataclass(frozen=True)
class Sidecar:
    """A sidecar checked against its model: ``info`` is a SidecarInfo with the base model's offsets
    resolved (dense), or an ExpertSidecarInfo (MoE)."""

    path: Path
    info: Any


@dataclass(frozen=True)
class ModeChoice:
    """What runs: ``mode`` (STOCK, "dense", "sparse", OFFLOAD or EXPERTS) and ``reason``.
    ``decision``: the default's decision as `flash_stats()["decision"]` reports it (None where the
    caller chose the mode); ``budget``: the budget decision that chose stock (budget_decision)."""

    mode: str
    reason: str
    decision: Optional[lane_decision.Decision] = None
    budget: Optional[budget_decision.BudgetDecision] = None


@dataclass
class ModelPlan:
    """The typed plan of one load. ``engine``: what the native engine opens (None: the model runs as
    stock). ``llama_defaults``: llama.cpp settings the plan counted, for those the host did not give;
    ``llama_overrides``: settings it must run with whatever was given. ``speculation``: the
    SpeculativeSettings to run (None: off), ``speculation_off_reason`` where a default turned it off.
    ``offload`` / ``expert_plan``: the planner's OffloadPlan / ExpertPlan. ``check_base_rows``: stock
    with a checksummed sidecar, the base model's FFN rows are checked while llama.cpp reads them.
    ``stock_fits_budget``: the budget holds what stock keeps resident in its own layout (a dense
    model: budget_decision; an MoE model: ExpertPlan.stock_repacked).
    ``notice``: the line a host shows the user about the choice (None: nothing to say)."""

    model: ModelId
    mode: str
    reason: str
    decision: Optional[lane_decision.Decision] = None
    sidecar: Optional[Sidecar] = None
    engine: Optional[EnginePlan] = None
    llama_defaults: Dict[str, Any] = field(default_factory=dict)
    llama_overrides: Dict[str, Any] = field(default_factory=dict)
    speculation: Any = None
    speculation_off_reason: Optional[str] = None
    offload: Any = None
    expert_plan: Any = None
    check_base_rows: bool = False
    stock_fits_budget: bool = False
    notice: Optional[str] = None


# -- the stages ---------------------------------------------------------------------------------


def identify_model(request: LoadRequest) -> ModelId:
    """Parses the base model's header once (what read_base_model raises for a bad file) and finds its
    experts. Raises ValueError where the request's flash mode does not apply to an MoE model."""
    base = gguf_model.read_base_model(request.model_path)
    moe = experts.read_moe_model(base.header) if base.header is not None else None
    if moe is not None and request.flash_mode != "auto":
        given = f"--flash-mode {request.flash_mode}" if request.cli else f"flash_mode={request.flash_mode!r}"
        raise ValueError(
            f"{given} is for dense FFN models; '{request.model_path}' is a mixture-of-experts model: "
            f"leave {request.option('flash_mode')} unset"
        )
    return ModelId(request.model_path, base, moe)


def _moe_stock_reason(model: ModelId, request: LoadRequest) -> Optional[str]:
    """Why an MoE model runs as stock before any sidecar is read (None: its experts can be served)."""
    why = experts.check_layout(model.moe)
    if why is not None:
        return f"running as stock: {why}"
    if request.ram_budget_mb is None and not _experts_for_determinism(model, request):
        return (
            "running as stock: an MoE model in memory runs as stock llama.cpp (experts are served "
            f"from flash only under {request.option('ram_budget_mb')}, or with deterministic answers)"
        )
    return None


def _router_rows(model: ModelId, request: LoadRequest) -> bool:
    """Whether the expert lane computes the MoE's routers row by row: deterministic answers on f32
    routers (stock would need a filler row after every lone token: eval_shapes)."""
    from . import expert_runtime

    return request.deterministic and expert_runtime.routers_in_f32(model.moe)


def _experts_for_determinism(model: ModelId, request: LoadRequest) -> bool:
    """Whether an MoE model in memory is served by the expert lane with every expert resident, so that
    it computes the routers row by row."""
    return request.ram_budget_mb is None and _router_rows(model, request)


def find_sidecar(model: ModelId, request: LoadRequest) -> Optional[Sidecar]:
    """The sidecar of ``model`` (``request.sidecar_path``, else ``<model stem>.flash.gguf`` beside it),
    read and checked against the model (one identity check). None where the model runs without one:
    no classic FFN, an MoE model that runs as stock anyway, or no default sidecar (a
    LlamaflashWarning says so once). Raises SidecarNotFoundError where one is needed (a path given, a
    budget, ``require_sidecar``) and missing; SidecarError subclasses for a sidecar that does not fit."""
    if model.moe is not None:
        return _find_expert_sidecar(model, request)
    budget = request.option("ram_budget_mb")
    if request.sidecar_path is not None:
        path = Path(request.sidecar_path)
        if not path.exists():
            if request.require_sidecar:
                raise SidecarNotFoundError(
                    f"no sidecar for '{model.path}' at '{path}'; create it with `llamaflash convert {model.path}`"
                )
            raise SidecarNotFoundError(
                f"sidecar '{path}' does not exist; create it with `llamaflash convert {model.path} -o {path}` "
                f"or leave sidecar_path unset to run without one"
            )
    elif not model.base.ffn_layers and not request.require_sidecar:
        path = None  # no classic FFN (e.g. state-space models): nothing to serve
    else:
        path = default_sidecar_path(model.path)
        if not path.exists():
            if request.require_sidecar:
                raise SidecarNotFoundError(
                    f"no sidecar for '{model.path}' at '{path}'; create it with `llamaflash convert {model.path}`"
                )
            if not request.deterministic:  # deterministic in memory needs none (matmul_rows)
                warn_no_sidecar(model.path, path)
            path = None
    if path is None and request.ram_budget_mb is not None:
        raise SidecarNotFoundError(
            f"{budget} needs a sidecar for '{model.path}' (none at "
            f"'{default_sidecar_path(model.path)}'); create it with `llamaflash convert {model.path}`"
        )
    if path is None:
        return None
    return Sidecar(path, validate_pair(model.path, path, model=model.base))


def _find_expert_sidecar(model: ModelId, request: LoadRequest) -> Optional[Sidecar]:
    from ..files import expert_sidecar

    if _moe_stock_reason(model, request) is not None:
        return None
    path = Path(request.sidecar_path) if request.sidecar_path is not None else default_sidecar_path(model.path)
    if not path.exists() and request.sidecar_path is None and _experts_for_determinism(model, request):
        return None  # deterministic answers in memory run as stock without one
    if not path.exists():
        raise SidecarNotFoundError(
            f"{request.option('ram_budget_mb')} needs the expert sidecar of '{model.path}' (none at '{path}'); "
            f"create it with `llamaflash convert {model.path}`"
        )
    info = expert_sidecar.read_expert_sidecar(path)
    expert_sidecar.validate_expert_pair(model.moe, gguf_model.base_identity(model.path, model.base), info)
    return Sidecar(path, info)


def decide_mode(model: ModelId, sidecar: Optional[Sidecar], request: LoadRequest) -> ModeChoice:
    """The mode: the caller's where given; otherwise the default's. Under a budget "auto" runs stock
    where the budget holds what stock keeps resident (budget_decision; a given disk profile is still
    checked), else offload; in memory "auto" runs the lane measured faster here (lane_decision). An
    MoE model with an expert sidecar gets EXPERTS here; :func:`plan_load` may still find stock fits."""
    if model.moe is not None:
        reason = _moe_stock_reason(model, request)
        if reason is None and sidecar is None:
            reason = "running as stock: deterministic answers in memory use the expert lane only with an expert sidecar"
        if reason is not None:
            return ModeChoice(STOCK, reason, lane_decision.Decision(lane_decision.STOCK, False, reason))
        return ModeChoice(EXPERTS, "experts served from flash")
    if sidecar is None:
        return ModeChoice(STOCK, "no sidecar")
    info = sidecar.info
    if request.ram_budget_mb is not None:
        if request.flash_mode != "auto":
            return ModeChoice(OFFLOAD, "flash offload (flash_mode='sparse' under a budget)")
        choice = budget_decision.decide(
            model.base.header,
            info,
            request.ram_budget_mb,
            request.n_ctx,
            request.n_ubatch,
            logits_all=request.logits_all,
            use_mmap=request.use_mmap,
        )
        decision = lane_decision.Decision(choice.lane, False, choice.reason, detail=choice.as_dict())
        if not choice.stock:
            return ModeChoice(OFFLOAD, choice.reason, decision)
        if request.disk_profile is not None and str(request.disk_profile) != "probe":
            from ..planning import disk_probe

            disk_probe.resolve_profile(request.disk_profile, sidecar.path)  # a bad one is still an error
        return ModeChoice(STOCK, choice.reason, decision, budget=choice)
    if request.flash_mode != "auto":
        return ModeChoice(request.flash_mode, f"{request.flash_mode} lane in memory")
    decision = default_decision(info, sidecar.path, request.embedding)
    if decision.lane == lane_decision.STOCK:
        return ModeChoice(STOCK, decision.reason, decision)
    return ModeChoice("sparse", "sparse lane in memory", decision)


def default_decision(info, sidecar: Path, embedding: bool) -> lane_decision.Decision:
    """The lane of flash_mode "auto" in memory (see lane_decision): stock for embeddings and for a
    sidecar without sparsity thresholds, else the measurement stored for this machine."""
    if embedding:
        return lane_decision.Decision(lane_decision.STOCK, False, "running as stock: embeddings are always exact")
    if not _has_sparsity(info):
        return lane_decision.Decision(
            lane_decision.STOCK,
            False,
            "running as stock: the sidecar has no sparsity thresholds, so nothing "
            "can be skipped (flash_mode='dense' is exact but not faster; re-convert for the sparse lane)",
        )
    return lane_decision.stored_decision(sidecar)


def plan_load(model: ModelId, sidecar: Optional[Sidecar], choice: ModeChoice, request: LoadRequest) -> ModelPlan:
    """The typed plan for ``choice``: for a served mode the engine configuration (validated) and its
    identity; for offload the planner's plan for the budget (RamBudgetError below its minimum); for
    EXPERTS the expert plan (stock where the model fits the budget after all). Raises ValueError for
    flash_draft_copy=True without self-drafts to use it."""
    if model.moe is not None:
        return _plan_experts(model, sidecar, choice, request)
    speculation = speculative.SpeculativeSettings.from_argument(request.speculation)
    if choice.mode == STOCK:
        return _stock_plan(model, sidecar, choice, request, speculation)
    info = sidecar.info
    thresholds = sparsity_thresholds(info, request.sparsity) if choice.mode in ("sparse", OFFLOAD) else None
    plan = ModelPlan(model, choice.mode, choice.reason, choice.decision, sidecar, speculation=speculation)
    if choice.mode == OFFLOAD:
        config = _plan_offload(plan, thresholds, request)
    else:
        from . import engine

        sparse = engine.sparse_config(False)
        if thresholds is not None:
            sparse = engine.sparse_config(
                True, request.max_sparse_tokens, up_by_ggml=dense_up(info, request.sparsity, request.dense_up)
            )
        config = engine.engine_config(info, model.path, thresholds, sparse, verify=request.verify)
    config.repack = not request.batch_invariant
    config.validate()
    plan.engine = EnginePlan(identity(plan, K.KIND_DENSE, request), dense=config)
    return plan


def plan_model(request: LoadRequest) -> ModelPlan:
    """The four stages in order: identify the model, find and check its sidecar, decide, plan."""
    model = identify_model(request)
    sidecar = find_sidecar(model, request)
    choice = decide_mode(model, sidecar, request)
    return plan_load(model, sidecar, choice, request)


# -- parts of plan_load ---------------------------------------------------------------------------


def dense_up(info, level: Optional[float], given: Optional[bool]) -> bool:
    """Whether the sparse lane takes u = up·x from ggml's dense GEMV: ``given``, else chosen from the
    level's sparsity (dense below DENSE_UP_MAX_SPARSITY)."""
    if given is None:
        return _level_sparsity(info, level) < DENSE_UP_MAX_SPARSITY
    return bool(given)


def identity(plan: ModelPlan, kind: str, request: LoadRequest) -> PlanIdentity:
    """What the served plan was made for: the files, the budget and llama.cpp's context and batch sizes
    (the host's, else the plan's; 0: llama.cpp's default)."""
    defaults = plan.llama_defaults
    return PlanIdentity(
        kind,
        plan.mode,
        plan.reason,
        os.fspath(plan.model.path),
        str(plan.sidecar.path),
        request.ram_budget_mb or 0.0,
        request.n_ctx,
        request.n_batch or defaults.get("n_batch") or 0,
        request.n_ubatch or defaults.get("n_ubatch") or 0,
        "",
    )


def _stock_plan(model: ModelId, sidecar, choice: ModeChoice, request: LoadRequest, speculation) -> ModelPlan:
    plan = ModelPlan(model, STOCK, choice.reason, choice.decision, sidecar, speculation=speculation)
    if choice.budget is not None:  # stock holds its weights the way its need was counted
        plan.stock_fits_budget = True
        plan.llama_defaults["n_ubatch"] = choice.budget.n_ubatch
        plan.llama_overrides["use_mmap"] = choice.budget.use_mmap
        plan.notice = f"llamaflash: {choice.reason}"
    elif sidecar is not None:  # the in-memory default chose stock: llama.cpp reads the FFN rows itself
        plan.check_base_rows = request.verify and sidecar.info.integrity is not None
        plan.notice = f"llamaflash: '{sidecar.path}': {choice.reason}"
    return plan


def _plan_offload(plan: ModelPlan, thresholds, request: LoadRequest):
    """The budget's OffloadPlan and the engine configuration from it; speculation on by default under
    a budget (``flash_speculative`` None, no draft model) unless the plan reads nothing per token."""
    from . import offload

    by_default = request.speculation is None and not request.user_draft
    speculation = speculative.SpeculativeSettings.from_argument(
        True if request.speculation is None else request.speculation
    )
    # the draft copy serves self-drafts only: without them the plan is the one without speculation
    # deterministic answers compute whole layers (offload.stream_layers): no sparse lane to draft over
    self_drafts = (
        speculation is not None and speculation.self_draft and not request.user_draft and not request.deterministic
    )
    if request.draft_copy and not self_drafts:
        raise ValueError(
            "flash_draft_copy=True keeps the draft copy for speculative self-drafts, which are off here "
            "(flash_speculative=False, self_draft=False, a draft_model given, or deterministic=True); leave flash_draft_copy "
            "unset or turn self-drafts on"
        )
    offload_plan, config, plan.speculation, plan.speculation_off_reason = offload.configure(
        plan.model.path,
        plan.sidecar.path,
        plan.sidecar.info,
        plan.model.base.header,
        thresholds,
        speculation,
        ram_budget_mb=request.ram_budget_mb,
        n_ctx=request.n_ctx,
        n_ubatch=request.n_ubatch,
        logits_all=request.logits_all,
        flash_attn=request.flash_attn,
        max_sparse_tokens=request.max_sparse_tokens,
        stream_gate=request.stream_gate,
        disk_profile=request.disk_profile,
        draft_copy=request.draft_copy if self_drafts else False,
        io_engine=request.io_engine,
        verify=request.verify,
        speculation_by_default=by_default,
        prompt_tokens=request.prompt_tokens,
        prompt_pages_freed=request.prompt_pages_freed,
        whole_layers=request.deterministic,
    )
    plan.offload = offload_plan
    plan.llama_defaults.update(n_batch=offload_plan.n_batch, n_ubatch=offload_plan.n_ubatch)
    plan.reason = f"flash offload: {offload_plan.cluster_size}-neuron clusters through a cache under the budget"
    if config.offload.stream_layers:
        plan.reason = (
            f"flash offload, deterministic: every FFN computed whole as stock computes it, the layers read from "
            f"flash one at a time ({len(config.offload.hot_layers)} of {len(config.layers)} pinned)"
        )
    return config


def _plan_experts(model: ModelId, sidecar, choice: ModeChoice, request: LoadRequest) -> ModelPlan:
    """An MoE model: stock (no speculative self-draft: nothing to draft with), or its routed experts
    from flash by the expert plan for the budget; every other weight stays with llama.cpp."""
    from ..planning import disk_probe, expert_plan
    from . import expert_runtime, matmul_rows

    speculation = speculative.SpeculativeSettings.from_argument(request.speculation)
    stock_speculation = dataclasses.replace(speculation, self_draft=False) if speculation is not None else None
    if choice.mode == STOCK:
        plan = ModelPlan(model, STOCK, choice.reason, choice.decision, speculation=stock_speculation)
        plan.notice = f"llamaflash: '{model.path}': {choice.reason}"
        return plan
    info = sidecar.info
    counts = {s.layer: s.counts for s in info.layers} if info.routing_tokens > 0 else None
    in_memory = request.ram_budget_mb is None  # deterministic answers: every expert resident
    try:
        budget_plan = expert_plan.plan_experts(
            model.moe,
            model.base.header,
            _machine_memory_mb() if in_memory else request.ram_budget_mb,
            n_ctx=request.n_ctx,
            n_ubatch=request.n_ubatch,
            disk=disk_probe.resolve_profile(request.disk_profile, sidecar.path) or _default_disk(),
            counts=counts,
            n_slots=(request.expert_slots or model.moe.n_expert) if in_memory else request.expert_slots,
            logits_all=request.logits_all,
        )
    except RamBudgetError as e:
        if not in_memory:
            raise
        reason = f"running as stock: the model's experts do not all fit this machine's memory ({e})"
        plan = ModelPlan(model, STOCK, reason, lane_decision.Decision(lane_decision.STOCK, False, reason))
        plan.speculation = stock_speculation
        plan.notice = f"llamaflash: '{model.path}': {reason}"
        return plan
    budget = "in memory" if in_memory else f"{request.option('ram_budget_mb')}={request.ram_budget_mb:g}"
    if budget_plan.fits:
        reason = f"running as stock under {budget}: {budget_plan.notes[0]}"
        plan = ModelPlan(model, STOCK, reason, lane_decision.Decision(lane_decision.STOCK, False, reason), sidecar)
        plan.speculation, plan.expert_plan = stock_speculation, budget_plan
        plan.llama_defaults["n_ubatch"] = budget_plan.n_ubatch  # the prefill batch at which stock fits
        # where stock's default layout fits with the margin, stock's own numerics (repacked weights)
        # unless speculation or deterministic answers need the batch-invariant ones (llama_load)
        plan.stock_fits_budget = budget_plan.stock_repacked
        plan.notice = f"llamaflash: '{model.path}': {reason}"
        return plan
    reason = f"experts served from flash: {budget_plan.n_slots} of {model.moe.n_expert} experts per layer cached"
    if in_memory:
        reason = (
            f"experts served by the expert lane in memory, {budget_plan.n_slots} of {model.moe.n_expert} per layer "
            "resident: deterministic answers (routers row by row)"
        )
    plan = ModelPlan(model, EXPERTS, reason, lane_decision.Decision(EXPERTS, False, reason), sidecar)
    plan.speculation, plan.expert_plan = speculation, budget_plan
    plan.llama_defaults.update(n_batch=budget_plan.n_ubatch, n_ubatch=budget_plan.n_ubatch)
    config = expert_runtime.engine_config(
        model.path,
        model.moe,
        info,
        budget_plan,
        io_engine=request.io_engine,
        verify=request.verify,
        prefetch=expert_runtime.prefetch_enabled(),
        overlap=expert_runtime.overlap_enabled(),
        router_rows=_router_rows(model, request),
    )
    routers = {layer.layer: layer.router for layer in model.moe.layers}
    # deterministic with the K-quant matmul weights copied to the llamaflash device (matmul_rows):
    # their pages in the file's mapping are not locked as well
    copied = request.deterministic and not matmul_rows.reads_in_place(request.ram_budget_mb)
    held = matmul_rows.taken_weights(model.base.header) if copied else ()
    lock_ranges = tuple(expert_runtime.dense_ranges(model.moe, model.base.header, mmap.PAGESIZE, held))
    plan.engine = EnginePlan(
        identity(plan, K.KIND_EXPERTS, request), experts=config, routers=routers, lock_ranges=lock_ranges
    )
    return plan


def _machine_memory_mb() -> float:
    """This machine's memory (MemTotal) in MiB: the budget of an MoE model served in memory."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024.0
    raise OSError("/proc/meminfo has no MemTotal")


def _default_disk() -> Dict[str, Any]:
    from ..planning.planner import default_disk

    return default_disk()
