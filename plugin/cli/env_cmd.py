"""`llamaflash env MODEL [--ram-budget-mb N]`: plan MODEL for stock llama.cpp tools and print the shell
lines that make them load llamaflash (README, "With llama-server / llama-cli").

The plan is the one :class:`llamaflash.Llama` makes (:func:`llamaflash.runtime.model_plan.plan_model`:
identify the model once, find and check its sidecar, decide the mode, plan), for a tool process; its
engine plan becomes the plan file (:mod:`llamaflash.files.plan_file`), which the library the tools load
(csrc/backend/dl_backend.cpp) opens through the entry point llamaflash.Llama opens its own plan with
(csrc/backend/plan_reader.h). Where the decision is "stock" (the budget holds what stock keeps
resident, or nothing is served), the lines unset the variables instead, and say why.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path
from typing import Optional

import click

from llamaflash.errors import LlamaflashError
from llamaflash.files import plan_keys as K

MODES = ("auto", "dense", "sparse")
#: flags that make llama-cli / llama-server call ggml_backend_load_all() (see _tool_args)
LOAD_ARGS = ("-ot", "llamaflash=CPU")


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


def plan_for_tools(model_path: str, sidecar: Optional[Path], ram_budget_mb: Optional[float], **options):
    """The plan :class:`llamaflash.Llama` would make (model_plan.plan_model), for a tool process: no
    speculation (llama-server has its own draft models), no draft copy, every prompt's compute pages
    kept (the tools free none between evaluations). Under a budget what Llama runs there: batch-invariant
    numerics (plain weights, flash attention: the context whose compute buffers the planner counts)
    and every batch of up to eval_shapes.MAX_ROWS rows on the sparse lane, so a short prompt, or a
    prompt's last chunk, computes in the tools what it computes in Python; in memory one sparse token
    per batch. Its engine plan's identity carries the tool flags it counted."""
    from llamaflash.runtime import eval_shapes, model_plan

    mode = options["flash_mode"]
    if ram_budget_mb is not None and mode == "dense":
        raise ValueError(
            "--ram-budget-mb needs the sparse lane (flash offload reads only the active neurons' rows); "
            "use --flash-mode sparse or auto, or drop --ram-budget-mb for the dense lane"
        )
    request = model_plan.LoadRequest(
        model_path=model_path,
        sidecar_path=None if sidecar is None else str(sidecar),
        flash_mode=mode,
        sparsity=options["sparsity"],
        ram_budget_mb=ram_budget_mb,
        n_ctx=options["n_ctx"],
        n_ubatch=options["n_ubatch"],
        io_engine=options["io_engine"],
        disk_profile=options["disk_profile"],
        expert_slots=options["expert_slots"],
        verify=options["verify"],
        max_sparse_tokens=1 if ram_budget_mb is None else eval_shapes.MAX_ROWS,
        flash_attn=ram_budget_mb is not None,
        batch_invariant=ram_budget_mb is not None,
        speculation=False,
        prompt_pages_freed=False,
        require_sidecar=True,
        cli=True,
    )
    plan = model_plan.plan_model(request)
    if plan.engine is not None:
        ident = plan.engine.identity
        n_batch = ident.n_batch or ident.n_ubatch  # llama.cpp clamps -ub to -b: give both
        args = _tool_args(ident.n_ctx, n_batch, ident.n_ubatch, plan.mode in ("offload", "experts"))
        plan.engine.identity = dataclasses.replace(ident, n_batch=n_batch, tool_args=args)
    return plan


def shell_lines(plan, plan_path: Optional[Path]) -> str:
    """The lines `env` prints for a ModelPlan: exports when something is served, else unsets; comments
    say why."""
    from llamaflash.files.plan_file import library_path

    names = ("GGML_BACKEND_PATH", K.ENV_PLAN, "LLAMAFLASH_TOOL_ARGS")
    if plan.engine is None:
        return f"# llamaflash: {plan.reason}\nunset {' '.join(names)}\n"
    identity = plan.engine.identity
    values = (str(library_path()), str(plan_path), identity.tool_args)
    lines = [f"# llamaflash: {plan.reason}"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in zip(names, values)]
    lines.append(f"# run: llama-cli -m {shlex.quote(identity.model_path)} $LLAMAFLASH_TOOL_ARGS ...")
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
        plan = plan_for_tools(
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
    if plan.engine is not None:
        path = plan_out or plan_file.default_plan_path(plan.engine.identity.sidecar_path)
        plan_file.write_plan(path, plan.engine)
    click.echo(shell_lines(plan, path), nl=False)
