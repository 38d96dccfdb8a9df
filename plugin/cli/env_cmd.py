"""`llamaflash env MODEL [--ram-budget-mb N]`: plan MODEL for stock llama.cpp tools and print the shell
lines that make them load llamaflash (README, "With llama-server / llama-cli").

The stages are those of :class:`llamaflash.Llama`'s load, without llama.cpp: identify the model once,
find and check its sidecar, decide the mode (stock, dense, sparse, offload, experts), plan, build the
engine configuration; then the configuration becomes data (:mod:`llamaflash.files.plan_file`). The
library the tools load (csrc/backend/dl_backend.cpp) opens the same engine from it. Where the decision is
"stock" (the budget holds what stock keeps resident, or nothing is served), the lines unset the
variables instead, and say why.
"""

from __future__ import annotations

import mmap
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import click

from llamaflash.errors import LlamaflashError, SidecarNotFoundError
from llamaflash.files import plan_keys as K

MODES = ("auto", "dense", "sparse")
#: flags that make llama-cli / llama-server call ggml_backend_load_all() (see _tool_args)
LOAD_ARGS = ("-ot", "llamaflash=CPU")


@dataclass
class ToolPlan:
    """The outcome of :func:`plan_for_tools`: ``identity`` None = run stock (``reason`` says why)."""

    reason: str
    identity: Any = None  # plan_file.PlanIdentity
    dense: Any = None  # _native.EngineConfig
    experts: Any = None  # _native.ExpertConfig
    routers: Optional[Dict[int, Any]] = None
    lock_ranges: Tuple[Tuple[int, int], ...] = ()  # experts: the dense part's file ranges, locked after load


def _tool_args(n_ctx: int, n_batch: Optional[int], n_ubatch: Optional[int], budget: bool) -> str:
    """The tool flags the plan counted (llama-cli / llama-server spelling). The first two make
    llama-cli and llama-server load GGML_BACKEND_PATH at all: in this llama.cpp only llama-bench calls
    ggml_backend_load_all() unconditionally; the others call it while parsing a tensor override (or a
    device list), so a no-op override (no tensor name contains "llamaflash") does it. Under a budget
    (``budget``): what llamaflash.Llama runs there (batch-invariant numerics: flash attention, plain
    weights), and no RAM cache of prompt states (`--cache-ram`, 8 GiB by default in llama-server and
    llama-cli: memory the plan does not count)."""
    args = [*LOAD_ARGS, "-c", str(n_ctx)]
    if n_batch:
        args += ["-b", str(n_batch)]
    if n_ubatch:
        args += ["-ub", str(n_ubatch)]
    if budget:
        args += ["-fa", "on", "--no-repack", "-cram", "0"]
    return " ".join(args + ["-np", "1"])


def _plan_experts(model_path: str, base, moe, sidecar: Optional[Path], budget: Optional[float], o: dict) -> ToolPlan:
    from llamaflash.files.plan_file import PlanIdentity
    from llamaflash.runtime import expert_runtime

    setup, info = expert_runtime.plan_setup(
        model_path,
        base,
        moe,
        sidecar_path=sidecar,
        ram_budget_mb=budget,
        n_ctx=o["n_ctx"],
        n_ubatch=o["n_ubatch"],
        disk_profile=o["disk_profile"],
        n_slots=o["expert_slots"],
        budget_option="--ram-budget-mb",
    )
    plan, sidecar = setup.plan, setup.sidecar
    if plan is None or plan.fits:
        return ToolPlan(setup.reason)
    config = expert_runtime.engine_config(model_path, moe, info, plan, io_engine=o["io_engine"], verify=o["verify"])
    reason = setup.reason
    identity = PlanIdentity(
        K.KIND_EXPERTS,
        "experts",
        reason,
        model_path,
        str(sidecar),
        budget,
        o["n_ctx"],
        plan.n_ubatch,
        plan.n_ubatch,
        _tool_args(o["n_ctx"], plan.n_ubatch, plan.n_ubatch, True),
    )
    return ToolPlan(
        reason,
        identity,
        experts=config,
        routers={layer.layer: layer.router for layer in moe.layers},
        lock_ranges=tuple(expert_runtime.dense_ranges(moe, base.header, mmap.PAGESIZE)),
    )


def _plan_dense(model_path: str, base, sidecar: Optional[Path], budget: Optional[float], o: dict) -> ToolPlan:
    from llamaflash.files.plan_file import PlanIdentity
    from llamaflash.files.sidecar import default_sidecar_path, validate_pair
    from llamaflash.planning import budget_decision, lane_decision
    from llamaflash.runtime import engine, eval_shapes, offload
    from llamaflash.runtime.llama_settings import DENSE_UP_MAX_SPARSITY, _level_sparsity, sparsity_thresholds

    sidecar = sidecar or default_sidecar_path(model_path)
    if not sidecar.exists():
        raise SidecarNotFoundError(
            f"no sidecar for '{model_path}' at '{sidecar}'; create it with `llamaflash convert {model_path}`"
        )
    info = validate_pair(model_path, sidecar, model=base)  # the one identity check
    mode = o["flash_mode"]
    if budget is not None:
        if mode == "dense":
            raise ValueError(
                "--ram-budget-mb needs the sparse lane (flash offload reads only the active neurons' rows); "
                "use --flash-mode sparse or auto, or drop --ram-budget-mb for the dense lane"
            )
        if mode == "auto":
            choice = budget_decision.decide(base.header, info, budget, o["n_ctx"], o["n_ubatch"])
            if choice.stock:
                return ToolPlan(choice.reason)
        mode = "offload"
    elif mode == "auto":
        from llamaflash.runtime.llama import _default_decision

        decision = _default_decision(info, sidecar, {})
        if decision.lane == lane_decision.STOCK:
            return ToolPlan(decision.reason)
        mode = "sparse"
    thresholds = sparsity_thresholds(info, o["sparsity"]) if mode in ("sparse", "offload") else None
    n_batch = n_ubatch = o["n_ubatch"]
    if mode == "offload":
        # the context the tools run (-fa on, _tool_args): the planner counts its compute buffers
        kwargs: Dict[str, Any] = {"n_ctx": o["n_ctx"], "flash_attn": True}
        if o["n_ubatch"] is not None:
            kwargs["n_ubatch"] = o["n_ubatch"]
        plan, config, _, _ = offload.configure(
            model_path,
            sidecar,
            info,
            base.header,
            thresholds,
            kwargs,
            None,  # no speculation in the tools: llama-server has its own draft models
            ram_budget_mb=budget,
            # as llamaflash.Llama under a budget (batch-invariant numerics): every batch of up to
            # MAX_ROWS rows on the sparse lane, so a short prompt, or a prompt's last chunk, computes
            # in the tools what it computes in Python
            max_sparse_tokens=eval_shapes.MAX_ROWS,
            stream_gate=None,
            disk_profile=o["disk_profile"],
            draft_copy=False,
            io_engine=o["io_engine"],
            verify=o["verify"],
            prompt_pages_freed=False,  # the tools free no page between evaluations: every part in full
        )
        n_batch, n_ubatch = kwargs["n_batch"], kwargs["n_ubatch"]
        config.repack = False  # batch-invariant numerics, as llamaflash.Llama under a budget
        reason = f"flash offload: {plan.cluster_size}-neuron clusters through a cache under the budget"
    else:
        sparse = engine.sparse_config(False)
        if thresholds is not None:
            up_by_ggml = _level_sparsity(info, o["sparsity"]) < DENSE_UP_MAX_SPARSITY
            sparse = engine.sparse_config(True, 1, up_by_ggml=up_by_ggml)
        config = engine.engine_config(info, model_path, thresholds, sparse, verify=o["verify"])
        config.repack = True
        reason = f"{mode} lane in memory"
    config.validate()
    identity = PlanIdentity(
        K.KIND_DENSE,
        mode,
        reason,
        model_path,
        str(sidecar),
        budget or 0.0,
        o["n_ctx"],
        n_batch or 0,
        n_ubatch or 0,
        _tool_args(o["n_ctx"], n_batch, n_ubatch, mode == "offload"),
    )
    return ToolPlan(reason, identity, dense=config)


def plan_for_tools(model_path: str, sidecar: Optional[Path], ram_budget_mb: Optional[float], **options) -> ToolPlan:
    """Identify the model, check the sidecar, decide, plan, configure (see the module docstring)."""
    from llamaflash.files import experts, gguf_model

    base = gguf_model.read_base_model(model_path)  # the one parse of the base header
    moe = experts.read_moe_model(base.header) if base.header is not None else None
    if moe is not None:
        if options["flash_mode"] != "auto":
            raise ValueError(
                f"--flash-mode {options['flash_mode']} is for dense FFN models; '{model_path}' is a "
                "mixture-of-experts model: leave it unset"
            )
        return _plan_experts(model_path, base, moe, sidecar, ram_budget_mb, options)
    return _plan_dense(model_path, base, sidecar, ram_budget_mb, options)


def shell_lines(result: ToolPlan, plan_path: Optional[Path]) -> str:
    """The lines `env` prints: exports when something is served, else unsets; comments say why."""
    from llamaflash.files.plan_file import library_path

    names = ("GGML_BACKEND_PATH", K.ENV_PLAN, "LLAMAFLASH_TOOL_ARGS")
    if result.identity is None:
        return f"# llamaflash: {result.reason}\nunset {' '.join(names)}\n"
    values = (str(library_path()), str(plan_path), result.identity.tool_args)
    lines = [f"# llamaflash: {result.reason}"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in zip(names, values)]
    lines.append(f"# run: llama-cli -m {shlex.quote(result.identity.model_path)} $LLAMAFLASH_TOOL_ARGS ...")
    return "\n".join(lines) + "\n"


@click.command()
@click.argument("model")
@click.option(
    "--ram-budget-mb",
    "budget_mb",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="RAM for the whole tool process, in MiB (flash offload; MoE: experts from flash). Unset: in memory.",
)
@click.option("--sidecar", type=click.Path(path_type=Path), default=None, help="Default: MODEL's .flash.gguf.")
@click.option(
    "--flash-mode",
    type=click.Choice(MODES),
    default="auto",
    show_default=True,
    help="As llamaflash.Llama's flash_mode: dense = the exact dense lane, sparse = the sparse lane.",
)
@click.option("--sparsity", type=float, default=None, help="As flash_sparsity (default: the converter's point).")
@click.option("--n-ctx", type=click.IntRange(min=1), default=512, show_default=True, help="The tools' -c.")
@click.option("--n-ubatch", type=click.IntRange(min=1), default=None, help="The tools' -ub (default: the plan's).")
@click.option("--io-engine", type=click.Choice(["auto", "io_uring", "pool"]), default="auto", show_default=True)
@click.option("--disk-profile", default=None, help="As flash_disk_profile: a saved probe (JSON) or 'default'.")
@click.option("--expert-slots", type=click.IntRange(min=1), default=None, help="MoE: expert cache slots per layer.")
@click.option("--no-verify", is_flag=True, help="Do not check rows read against the sidecar's checksums.")
@click.option("-o", "--plan-out", type=click.Path(path_type=Path), default=None, help="Default: beside the sidecar.")
def env(
    model: str,
    budget_mb: Optional[float],
    sidecar: Optional[Path],
    flash_mode: str,
    sparsity: Optional[float],
    n_ctx: int,
    n_ubatch: Optional[int],
    io_engine: str,
    disk_profile: Optional[str],
    expert_slots: Optional[int],
    no_verify: bool,
    plan_out: Optional[Path],
) -> None:
    """Plan MODEL for llama-server / llama-cli / llama-bench and print the shell lines that make them
    load llamaflash: eval "$(llamaflash env MODEL --ram-budget-mb N)". Writes the plan file beside the
    sidecar (or --plan-out)."""
    from llamaflash.files import plan_file

    library = plan_file.library_path()
    if not library.exists():
        raise LlamaflashError(f"the backend library is not installed at '{library}'; reinstall llamaflash")
    model_path = os.path.abspath(model)
    try:
        result = plan_for_tools(
            model_path,
            sidecar,
            budget_mb,
            flash_mode=flash_mode,
            sparsity=sparsity,
            n_ctx=n_ctx,
            n_ubatch=n_ubatch,
            io_engine=io_engine,
            disk_profile=disk_profile,
            expert_slots=expert_slots,
            verify=not no_verify,
        )
    except ValueError as e:
        if isinstance(e, LlamaflashError):
            raise
        raise LlamaflashError(str(e)) from e
    path = None
    if result.identity is not None:
        path = plan_out or plan_file.default_plan_path(result.identity.sidecar_path)
        plan_file.write_plan(
            path,
            result.identity,
            dense=result.dense,
            experts=result.experts,
            routers=result.routers,
            lock_ranges=result.lock_ranges,
        )
    click.echo(shell_lines(result, path), nl=False)
