"""``llamaflash bench`` (stock against llamaflash under memory limits, and the speed-memory sweep) and
``llamaflash plan`` (how a RAM budget is spent): the commands about budgets, registered on the
``llamaflash`` group by :mod:`llamaflash.cli.cli`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from llamaflash.errors import LlamaflashError


@click.command()
@click.argument("model")
@click.argument("more_limits", nargs=-1, type=click.IntRange(min=1), metavar="")
@click.option(
    "--ram-limit-mb",
    "limits",
    type=click.IntRange(min=1),
    multiple=True,
    help="Memory limit in MB for the whole process plus its page cache; several values may follow "
    "one flag: --ram-limit-mb 900 700.",
)
@click.option(
    "--configs",
    default=None,
    help="Comma-separated: stock, llamaflash (ram_budget_mb = the limit), llamaflash-nospec (the same "
    "without speculative decoding), stock-norepack (stock with file-backed weights and flash attention), "
    "or a llamaflash flash_mode. Default: stock,llamaflash; with --sweep stock,llamaflash,llamaflash-nospec "
    "(a mixture-of-experts model: stock-norepack,stock,llamaflash-nospec).",
)
@click.option(
    "--sweep",
    is_flag=True,
    help="The speed-memory curve: every config at a ladder of budgets (the --ram-limit-mb values, or "
    "--points budgets from the planner's least budget to past the model's size), with the planner's "
    "predictions beside the measurements; a table, the JSON (written after every run) and a PNG. For a "
    "mixture-of-experts model the expert planner's ladder and predictions (runs stock or experts, "
    "predicted hit rate and I/O bound), and per llamaflash run the measured expert hit rate, MB read and "
    "I/O wait per token and the I/O bound (disk rate / bytes per token), plotted with the hit rates.",
)
@click.option(
    "--points",
    type=click.IntRange(min=2),
    default=8,
    show_default=True,
    help="--sweep without --ram-limit-mb: budgets in the default ladder.",
)
@click.option("--resume", is_flag=True, help="--sweep: continue the interrupted sweep in --json.")
@click.option(
    "--prompt-set",
    type=click.Choice(["chat", "code", "prose", "text"]),
    default=None,
    help="chat / code / prose: decode that prompt set with llm.generate (speculative where the config "
    "speculates); text: one text prompt (--prompt-tokens) token by token, never speculative. "
    "Default: chat with --sweep, else text.",
)
@click.option(
    "--n-ctx",
    type=click.IntRange(min=64),
    default=None,
    help="Context size (default: 512, or what the prompt and --n-gen need).",
)
@click.option(
    "--sidecar",
    type=click.Path(path_type=Path),
    default=None,
    help="Sidecar for the llamaflash configs (default: MODEL's .flash.gguf beside it).",
)
@click.option("--reps", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(min=9), default=205, show_default=True)
@click.option("--n-gen", type=click.IntRange(min=1), default=64, show_default=True, help="Tokens to generate.")
@click.option(
    "--max-decode-s",
    type=click.FloatRange(min=0, min_open=True),
    default=20.0,
    show_default=True,
    help="Stop decoding after this many seconds (tok/s over the tokens done).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=300.0,
    show_default=True,
    help="Seconds per run, load included; the run is killed after it.",
)
@click.option(
    "--quiet-wait",
    type=click.FloatRange(min=0),
    default=20.0,
    show_default=True,
    help="Before each run, wait up to this long for the cores to be idle.",
)
@click.option("--no-cgroup", is_flag=True, help="Run without memory limits (cold page cache only).")
@click.option(
    "--private-copy",
    "private_copy",
    type=click.Path(path_type=Path),
    default=None,
    help="Benchmark copies of the model and sidecar made in this directory (removed afterwards): "
    "pages another process maps cannot be evicted, and are free to the run.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Where to write every run (default: ./llamaflash-bench-<model>-<time>.json).",
)
@click.option(
    "--png",
    "png_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Plot of tok/s versus limit (default: the JSON path with .png; needs matplotlib).",
)
def bench(
    model: str,
    more_limits: tuple[int, ...],
    limits: tuple[int, ...],
    configs: str | None,
    sweep: bool,
    points: int,
    resume: bool,
    prompt_set: str | None,
    n_ctx: int | None,
    sidecar: Path | None,
    reps: int,
    threads: int,
    prompt_tokens: int,
    n_gen: int,
    max_decode_s: float,
    timeout: float,
    quiet_wait: float,
    no_cgroup: bool,
    private_copy: Path | None,
    json_path: Path | None,
    png_path: Path | None,
) -> None:
    """Benchmark MODEL (a .gguf or a registry model name) under memory limits: stock llama.cpp and
    llamaflash, each run in its own process inside a memory cgroup of the limit (process + page
    cache), the files evicted from the page cache first. Needs root and cgroup v1; otherwise it says
    so and measures without a limit."""
    from llamaflash.bench import benchkit, memlimit

    if more_limits and not limits:
        raise click.UsageError(
            f"unexpected argument(s) {' '.join(map(str, more_limits))}: limits go after --ram-limit-mb"
        )
    all_limits = [*limits, *more_limits]
    prompt_set = prompt_set or ("chat" if sweep else "text")
    prompt_set = None if prompt_set == "text" else prompt_set
    n_ctx = n_ctx or max(512, (0 if prompt_set else prompt_tokens) + n_gen + 1)
    if sweep:
        from llamaflash.bench import sweep as sweeps

        opts = sweeps.SweepOptions(
            model=model,
            budgets_mb=sorted(set(all_limits)),
            points=points,
            # none given: the model's default (sweeps.CONFIGS; an MoE model's sweep_moe.MOE_CONFIGS)
            configs=[c.strip() for c in (configs or "").split(",") if c.strip()],
            sidecar=str(sidecar) if sidecar else None,
            reps=reps,
            threads=threads,
            n_prompt=prompt_tokens,
            n_gen=n_gen,
            n_ctx=n_ctx,
            max_decode_s=max_decode_s,
            timeout_s=timeout,
            quiet_wait_s=quiet_wait,
            use_cgroup=not no_cgroup,
            private_copy_dir=str(private_copy) if private_copy else None,
            prompt_set=prompt_set,
        )
        sweeps.run_from_command_line(opts, json_path, png_path, resume, echo=click.echo)
        return
    if resume:
        raise click.UsageError("--resume continues a --sweep")
    configs = configs or "stock,llamaflash"
    if not all_limits and not no_cgroup:
        raise click.UsageError("give at least one --ram-limit-mb (or --no-cgroup)")
    opts = memlimit.BenchOptions(
        model=model,
        limits_mb=all_limits,
        configs=[c.strip() for c in configs.split(",") if c.strip()],
        sidecar=str(sidecar) if sidecar else None,
        reps=reps,
        threads=threads,
        n_prompt=prompt_tokens,
        n_gen=n_gen,
        n_ctx=n_ctx,
        max_decode_s=max_decode_s,
        timeout_s=timeout,
        quiet_wait_s=quiet_wait,
        use_cgroup=not no_cgroup,
        private_copy_dir=str(private_copy) if private_copy else None,
        prompt_set=prompt_set,
    )
    try:
        opts.validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        payload = memlimit.run_benchmark(opts, echo=click.echo)
    except FileNotFoundError as e:
        raise LlamaflashError(str(e)) from e
    out = json_path or Path(f"llamaflash-bench-{payload['model']['name']}-{benchkit.timestamp()}.json")
    memlimit.report(payload, out, png_path or out.with_suffix(".png"), echo=click.echo)


@click.command()
@click.argument("model")
@click.option(
    "--ram-budget-mb",
    "budget_mb",
    type=click.FloatRange(min=0, min_open=True),
    required=True,
    help="RAM for the whole process, in MiB (as `llamaflash bench --ram-limit-mb`).",
)
@click.option(
    "--sidecar",
    type=click.Path(path_type=Path),
    default=None,
    help="Format-2 sidecar (default: MODEL's .flash.gguf beside it).",
)
@click.option("--n-ctx", type=click.IntRange(min=1), default=512, show_default=True)
@click.option(
    "--n-ubatch",
    type=click.IntRange(min=1),
    default=None,
    help="llama.cpp's physical batch (default: of 512..32 the largest whose plan predicts at least 0.99x "
    "the fastest decode; a larger batch speeds up prefill, its buffers take memory from the cache).",
)
@click.option(
    "--cluster-size",
    type=click.IntRange(min=1),
    default=None,
    help="Neurons per cache slot (default: the size with the best predicted tok/s).",
)
@click.option("--prefetch-layers", type=click.IntRange(min=0), default=2, show_default=True, help="Layers read ahead.")
@click.option(
    "--gate",
    "gate",
    type=click.Choice(["auto", "resident", "streamed"]),
    default="auto",
    show_default=True,
    help="Gate matrices: resident, or read from flash every token one layer ahead (streamed); auto: "
    "the one that predicts the faster decode (streamed only when resident does not fit, or its "
    "memory as pinned clusters saves more reads than the gate costs).",
)
@click.option(
    "--draft-copy",
    "draft_copy",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="Keep the sidecar's draft copy resident for speculative self-drafts: auto (whichever of the copy "
    "and the same memory as pinned clusters predicts the faster delivered decode), on, off.",
)
@click.option(
    "--runtime-mb",
    type=click.FloatRange(min=0),
    default=None,
    help="RSS of the process before the model loads, in MiB (default: this process's RSS).",
)
@click.option(
    "--probe-disk",
    is_flag=True,
    help="Measure the disk first (a few seconds: a 256 MB scratch file in --probe-dir, deleted after) "
    "and save the result for that disk (later plans and Llama(ram_budget_mb=...) use it). Without "
    "it, a saved profile of the sidecar's disk is used when there is one, else a built-in default.",
)
@click.option(
    "--probe-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where --probe-disk writes its scratch file (default: the sidecar's directory).",
)
@click.option(
    "--disk-profile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A saved disk probe result (JSON from llamaflash.planning.disk_probe.probe_disk / bench/bench_disk.py).",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Prompt length whose time to first token is predicted beside decode and weighed in the n_ubatch choice.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON instead of the table.")
@click.option("--json-arrays", is_flag=True, help="With --json: include hot_clusters and cluster_prob per layer.")
def plan(
    model: str,
    budget_mb: float,
    sidecar: Path | None,
    n_ctx: int,
    n_ubatch: int | None,
    cluster_size: int | None,
    prefetch_layers: int,
    gate: str,
    draft_copy: str,
    runtime_mb: float | None,
    probe_disk: bool,
    probe_dir: Path | None,
    disk_profile: Path | None,
    prompt_tokens: int,
    as_json: bool,
    json_arrays: bool,
) -> None:
    """Plan the RAM of the flash-offload engine for MODEL (a .gguf, or a registry model name) under
    --ram-budget-mb: every part of the budget and why, the minimum, the cluster size, the clusters to
    pin, the predicted hit rate and I/O-bound decode speed, and the predicted time to first token of a
    --prompt-tokens prompt. Exit status 2 if the budget is too small."""
    import json

    from llamaflash.files import assets
    from llamaflash.files.sidecar import default_sidecar_path
    from llamaflash.planning import disk_probe
    from llamaflash.planning.planner import plan_offload

    model_path = Path(model)
    if not model_path.exists() and model in assets.list_models():
        model_path = assets.fetch_model(model, progress=True)
    sidecar_path = sidecar or default_sidecar_path(model_path)
    # a given profile, else a fresh probe (saved for later plans and Llama(ram_budget_mb=...)), else the
    # saved profile of the sidecar's disk, else the planner's built-in default
    disk = disk_probe.saved_profile(sidecar_path)
    if disk_profile is not None:
        disk = json.loads(disk_profile.read_text())
    if probe_disk:
        disk = disk_probe.probe_disk(probe_dir or disk_probe.default_directory(sidecar_path), seconds=0.25, file_mb=256)
        click.echo(disk_probe.format_table(disk), err=True)
        click.echo(f"disk profile saved: {disk_probe.save_profile(disk)}", err=True)
    moe_plan = _plan_experts(model_path, sidecar_path, budget_mb, n_ctx, n_ubatch, disk)
    if moe_plan is not None:
        click.echo(json.dumps(dataclasses.asdict(moe_plan), indent=1, default=str) if as_json else moe_plan.explain())
        return
    from llamaflash.files.gguf_model import read_base_model
    from llamaflash.files.sidecar import validate_pair
    from llamaflash.planning import budget_decision

    runtime = None if runtime_mb is None else int(runtime_mb * (1 << 20))
    base = read_base_model(model_path)
    info = validate_pair(model_path, sidecar_path, model=base)
    # what Llama(ram_budget_mb=...) runs: stock llama.cpp where the budget holds what it keeps resident
    decision = budget_decision.decide(base.header, info, budget_mb, n_ctx, n_ubatch, runtime)
    result = plan_offload(
        model_path,
        sidecar_path,
        budget_mb,
        n_ctx=n_ctx,
        n_ubatch=n_ubatch,
        disk=disk,
        runtime_rss_bytes=runtime,
        cluster_size=cluster_size,
        prefetch_layers=prefetch_layers,
        stream_gate={"auto": None, "resident": False, "streamed": True}[gate],
        draft_copy={"auto": None, "on": True, "off": False}[draft_copy],
        info=info,
        header=base.header,
        prompt_tokens=prompt_tokens,
    )
    if as_json:
        click.echo(json.dumps({**result.to_dict(arrays=json_arrays), "decision": decision.as_dict()}, indent=1))
        return
    click.echo(f"decision: {decision.reason}")
    if decision.stock:
        click.echo("(the offload plan below is what flash_mode='sparse' would run at this budget)")
    click.echo("")
    click.echo(result.explain())


def _plan_experts(model_path: Path, sidecar_path: Path, budget_mb: float, n_ctx: int, n_ubatch: int | None, disk):
    """The expert plan of a mixture-of-experts model (None for a dense model): dense part, KV, expert slots."""
    from llamaflash.files import expert_sidecar
    from llamaflash.files.experts import read_moe_model
    from llamaflash.files.gguf_header import read_gguf_header
    from llamaflash.planning import expert_plan
    from llamaflash.planning.planner import default_disk

    header = read_gguf_header(model_path)
    moe = read_moe_model(header)
    if moe is None:
        return None
    counts = None
    if sidecar_path.exists():
        info = expert_sidecar.read_expert_sidecar(sidecar_path)
        counts = {s.layer: s.counts for s in info.layers} if info.routing_tokens > 0 else None
    return expert_plan.plan_experts(
        moe, header, budget_mb, n_ctx=n_ctx, n_ubatch=n_ubatch, disk=disk or default_disk(), counts=counts
    )
