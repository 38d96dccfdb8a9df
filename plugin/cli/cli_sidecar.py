"""``llamaflash convert`` (a base model into its sidecar), ``inspect`` (describe a sidecar), ``verify``
(check a sidecar's rows, and the base model's, against its checksums) and ``tune`` (measure stock against
the sparse lane and store the answer beside the sidecar): the commands that make, describe and check a
sidecar, registered on the ``llamaflash`` group by :mod:`llamaflash.cli.cli`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from llamaflash.files import ggml_types
from llamaflash.files import sidecar_format as fmt


class _Sparsity(click.ParamType):
    """``auto`` or a number in [0, 1)."""

    name = "auto|FRACTION"

    def convert(self, value, param, ctx):
        if isinstance(value, float) or value == "auto":
            return value
        try:
            number = float(value)
        except ValueError:
            self.fail(f"{value!r} is neither 'auto' nor a number", param, ctx)
        if not 0.0 <= number < 1.0:
            self.fail(f"{number} is not in [0, 1) (a fraction of neurons, e.g. 0.6)", param, ctx)
        return number


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(path_type=Path),
    default=None,
    help="Sidecar to write (default: MODEL with .gguf replaced by .flash.gguf).",
)
@click.option("--force", is_flag=True, help="Overwrite the output if it exists.")
@click.option(
    "--calib",
    "calib",
    type=click.Path(path_type=Path),
    default=None,
    help="Calibration text file (UTF-8). Default: the registry calibration corpus (English + code), "
    "fetched once into ~/.cache/llamaflash.",
)
@click.option(
    "--valid",
    "valid",
    type=click.Path(path_type=Path),
    default=None,
    help="Validation text for perplexity (never the calibration text). Default: held-out Shakespeare.",
)
@click.option(
    "--sparsity",
    type=_Sparsity(),
    default="auto",
    show_default=True,
    help="Target fraction of FFN neurons skipped per token, or 'auto': the highest level whose "
    "perplexity stays within --quality-budget of dense.",
)
@click.option(
    "--quality-budget",
    type=click.FloatRange(min=0.0, min_open=True),
    default=2.0,
    show_default=True,
    help="--sparsity auto: allowed perplexity increase over dense, in percent.",
)
@click.option(
    "--selection",
    type=click.Choice(["gate"]),
    default="gate",
    show_default=True,
    help="How the engine selects the active neurons: gate-first (gate rows of every neuron, then up and "
    "down of the active ones; exact), its only mode.",
)
@click.option(
    "--order",
    type=click.Choice(["base", "hot"]),
    default="base",
    show_default=True,
    help="Bundle order: base neuron order (the dense lane maps bundles in place) or hot-first "
    "(most frequently active neurons first; the dense lane then copies gate/up).",
)
@click.option(
    "--down-t-type",
    type=click.Choice(list(fmt.DOWN_T_CHOICES)),
    default=fmt.DEFAULT_DOWN_T,
    show_default=True,
    help="Type of the transposed down rows the sparse lane reads: auto (Q4_K where its 256-value blocks "
    "divide n_embd, else Q8_0), q8_0 (near-lossless), base (the base down's type, e.g. Q4_K/Q6_K), "
    "or a type. Every type but Q8_0 quantizes the base weights a second time.",
)
@click.option(
    "--draft-type",
    type=click.Choice(list(fmt.DRAFT_CHOICES)),
    default=fmt.DEFAULT_DRAFT,
    show_default=True,
    help="Draft copy: a low-bit copy of every neuron's up and down rows that a speculative self-draft "
    "computes from under a RAM budget (never the verified tokens): auto (Q2_K where its 256-value "
    "blocks divide n_embd, else Q4_0), none, or a type.",
)
@click.option(
    "--calib-tokens", type=click.IntRange(min=1), default=4096, show_default=True, help="Calibration tokens to profile."
)
@click.option(
    "--valid-tokens",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="Validation tokens per perplexity measurement.",
)
@click.option(
    "--quality-method",
    "quality_method",
    type=click.Choice(["engine"]),
    default="engine",
    show_default=True,
    help="How perplexity and greedy agreement of a sparse setting are measured: with llamaflash's "
    "sparse engine (a temporary sidecar beside the output, every token through the sparse lane), "
    "its only method. Where the engine cannot run, use a fixed --sparsity with --no-quality.",
)
@click.option(
    "--no-quality", is_flag=True, help="With a fixed --sparsity: do not measure perplexity and greedy agreement."
)
@click.option(
    "--no-calibration",
    is_flag=True,
    help="Write a format-1 sidecar: bundles only, no profiling and no sparsity content (runs dense).",
)
@click.option("--no-report", is_flag=True, help="Do not write <sidecar>.report.json.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="llama.cpp threads (default: all cores).")
@click.option("--quiet", "-q", is_flag=True, help="No progress, per-layer lines or report table on stderr.")
def convert(
    model: Path,
    output: Path | None,
    force: bool,
    calib: Path | None,
    valid: Path | None,
    sparsity,
    quality_budget: float,
    selection: str,
    order: str,
    down_t_type: str,
    draft_type: str,
    calib_tokens: int,
    valid_tokens: int,
    quality_method: str,
    no_quality: bool,
    no_calibration: bool,
    no_report: bool,
    threads: int | None,
    quiet: bool,
) -> None:
    """Convert base model MODEL (.gguf) into its llamaflash sidecar.

    Profiles MODEL through llama.cpp on calibration text, chooses per-layer thresholds for the
    target sparsity, measures the quality cost, and writes the sidecar plus a report
    (<sidecar>.report.json).
    """
    del selection, quality_method  # one value each: the converter's only selection and quality method
    if no_quality and sparsity == "auto":
        raise click.UsageError("--no-quality needs a fixed --sparsity (auto measures perplexity to choose).")
    from llamaflash.cli.models_by_name import is_registry_name, resolve_model
    from llamaflash.converters import convert as run_convert

    if is_registry_name(str(model)):
        model = resolve_model(str(model), progress=not quiet)
    out = run_convert(
        model,
        output,
        force=force,
        progress=not quiet,
        calib_path=calib,
        valid_path=valid,
        sparsity=sparsity,
        quality_budget=quality_budget / 100.0,
        order=order,
        down_t_type=down_t_type,
        draft_type=draft_type,
        calib_tokens=calib_tokens,
        valid_tokens=valid_tokens,
        measure_quality=not no_quality,
        profile=not no_calibration,
        report=not no_report,
        n_threads=threads,
    )
    click.echo(str(out))


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option(
    "--sidecar",
    type=click.Path(path_type=Path),
    default=None,
    help="Sidecar to measure (default: <model stem>.flash.gguf beside the model).",
)
@click.option(
    "--reps",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Runs of each engine, alternated; medians are compared.",
)
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
def tune(model: Path, sidecar: Path | None, reps: int, threads: int) -> None:
    """Measure whether the sparse lane beats stock llama.cpp on this machine, and store the answer.

    `Llama(model)` without ram_budget_mb then runs the faster of the two (stock, untouched, unless the
    sparse lane measured at least 3% faster at decode and not slower at prefill). The result is kept
    in <sidecar>.tuning.json, one entry per machine. Time it on a quiet machine."""
    from llamaflash.files.sidecar import default_sidecar_path, validate_pair
    from llamaflash.planning import lane_decision

    sidecar = sidecar or default_sidecar_path(model)
    info = validate_pair(model, sidecar)
    if info.sparsity is None:
        raise click.UsageError(
            f"{sidecar} has no sparsity thresholds (format 1): the default is stock; "
            f"re-convert with `llamaflash convert {model}` for the sparse lane"
        )
    click.echo(f"measuring stock vs the sparse lane of {sidecar.name}, {reps} runs each (fresh processes):", err=True)
    decision = lane_decision.measure(
        model, sidecar, reps=reps, n_threads=threads, echo=lambda s: click.echo(s, err=True)
    )
    click.echo(decision.reason)
    click.echo(f"stored in {lane_decision.tuning_path(sidecar)}")


@click.command()
@click.argument("sidecar", type=click.Path(path_type=Path))
@click.argument("model", type=click.Path(path_type=Path), required=False)
@click.option(
    "--max-mismatches",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Name at most this many mismatching rows (all are counted).",
)
def verify(sidecar: Path, model: Path | None, max_mismatches: int) -> None:
    """Check SIDECAR's rows (and MODEL's FFN rows, when given) against the sidecar's checksums.

    Exits 0 when every checked row matches; 1 naming the rows that do not (file, tensor, row, byte
    offset), or when the sidecar has no checksums; 2 for a malformed or mismatched file."""
    from llamaflash.files.integrity import verify_files

    report = verify_files(sidecar, model, max_mismatches=max_mismatches)
    if report.algorithm is None:
        click.echo(
            f"{sidecar}: format {report.format_version}, no checksums: nothing to verify. Re-create it "
            f"with `llamaflash convert {model or 'MODEL'} -o {sidecar} --force` to add them.",
            err=True,
        )
        sys.exit(1)
    for what, (rows, nbytes) in report.checked.items():
        click.echo(f"checked {what}: {rows} rows, {nbytes} bytes ({report.algorithm})")
    if model is None:
        click.echo("base model rows not checked (pass MODEL to check them too)")
    if report.ok:
        click.echo("OK: every checked row matches its checksum")
        return
    for m in report.mismatches:
        click.echo(f"MISMATCH {m.file}: {m.tensor} row {m.row} (bytes {m.offset}..{m.offset + m.length})")
    more = report.n_mismatches - len(report.mismatches)
    click.echo(
        f"{report.n_mismatches} row(s) do not match{f' ({more} not listed)' if more else ''}: copy the "
        f"damaged file again, or re-create the sidecar with `llamaflash convert` --force from a good model",
        err=True,
    )
    sys.exit(1)


@click.command()
@click.argument("sidecar", type=click.Path(path_type=Path))
def inspect(sidecar: Path) -> None:
    """Describe the llamaflash sidecar SIDECAR (.flash.gguf)."""
    import numpy as np

    from llamaflash.files.sidecar import read_layer_vectors, read_sidecar

    info = read_sidecar(sidecar)
    click.echo(f"sidecar:          {info.path}")
    click.echo(f"format version:   {info.format_version}")
    click.echo(f"converter:        {info.converter_version}")
    click.echo(f"base identity:    {info.base_identity}")
    click.echo(f"base arch:        {info.base_arch}")
    click.echo(f"base name:        {info.base_name or '(none)'}")
    click.echo(f"base file size:   {info.base_file_size}")
    click.echo(f"ffn activation:   {info.activation}")
    click.echo(f"served layers:    {len(info.layers)}")
    click.echo(
        f"checksums:        {info.integrity or 'none (not verified when read; re-convert with --force to add them)'}"
    )
    if info.sparsity is not None:
        from llamaflash.planning.lane_decision import stored_decision

        click.echo(f"default lane:     {stored_decision(sidecar).reason}")

    def type_name(type_id: int) -> str:
        return ggml_types.type_name(type_id)

    header = (
        f"{'layer':>5} {'n_embd':>6} {'n_ff':>6} {'gate':>6} {'up':>6} {'down':>6} "
        f"{'down_t':>6} {'stride':>6} {'bundle_B':>10} {'down_t_B':>10}"
    )
    click.echo(header)
    total = 0
    for lay in info.layers:
        bundle_bytes = lay.n_ff * lay.bundle_stride
        down_t_bytes = lay.n_ff * lay.down_t_row_bytes
        total += bundle_bytes + down_t_bytes
        click.echo(
            f"{lay.layer:>5} {lay.n_embd:>6} {lay.n_ff:>6} {type_name(lay.gate_type):>6} "
            f"{type_name(lay.up_type):>6} {type_name(lay.base_down_type):>6} "
            f"{type_name(lay.down_t_type):>6} {lay.bundle_stride:>6} {bundle_bytes:>10} "
            f"{down_t_bytes:>10}"
        )
    click.echo(f"ffn bytes (bundles + down_t): {total}")
    copies = {lay.draft_type for lay in info.layers}
    if copies != {None}:
        copy_bytes = sum(2 * lay.n_ff * lay.draft_row_bytes for lay in info.layers if lay.draft_type is not None)
        names = ", ".join(sorted(type_name(t) for t in copies if t is not None))
        click.echo(
            f"draft copy:       {names}, {copy_bytes} bytes (up + down_t rows of every neuron, for "
            "speculative self-drafts under a RAM budget)"
        )
    else:
        click.echo("draft copy:       none")
    if info.sparsity is None:
        click.echo("sparsity:         none (format 1: the backend runs every layer dense)")
        return
    sp = info.sparsity
    click.echo(
        f"sparsity:         {sp.method}, target {sp.target:.3f}, criterion {sp.criterion} "
        "(neuron inactive when |act(gate.x)| <= threshold)"
    )
    click.echo(f"bundle order:     {sp.bundle_order}")
    if sp.quality_budget is not None:
        click.echo(f"quality budget:   perplexity within +{100 * sp.quality_budget:.3g}% of dense")
    if sp.calibration_source:
        click.echo(f"calibration:      {sp.calibration_tokens} tokens of {sp.calibration_source}")
    q = sp.quality
    if "ppl_dense" in q:
        click.echo(
            f"quality method:   {q['method']} ({fmt.QUALITY_METHOD_LABELS[q['method']]}), "
            f"{q.get('validation_tokens')} tokens of {q.get('validation')}"
        )
        delta = 100 * (q["ppl"] / q["ppl_dense"] - 1)
        active = f", active fraction {q['active_fraction']:.3f}" if "active_fraction" in q else ""
        click.echo(
            f"  ppl dense {q['ppl_dense']:.4f}, at the operating point {q['ppl']:.4f} ({delta:+.2f}%), "
            f"greedy agreement {q['greedy_agreement']:.3f}{active}"
        )
        curve = zip(
            q.get("curve_sparsity", []),
            q.get("curve_ppl", []),
            q.get("curve_greedy_agreement", []),
            q.get("curve_active_fraction") or [None] * len(q.get("curve_sparsity", [])),
        )
        for s_, p_, g_, a_ in curve:
            active = f"  active fraction {a_:.3f}" if a_ is not None else ""
            click.echo(
                f"  curve: sparsity {s_:.2f}  ppl {p_:.4f} ({100 * (p_ / q['ppl_dense'] - 1):+.2f}%)  "
                f"greedy agreement {g_:.3f}{active}"
            )
    click.echo(f"{'layer':>5} {'threshold':>10} {'sparsity':>8} {'ffn_err':>8} {'hot>=0.5':>8}")
    for lay in info.layers:
        vectors = read_layer_vectors(info, lay)
        hot = int(np.count_nonzero(vectors["freq"] >= 0.5))
        click.echo(f"{lay.layer:>5} {lay.threshold:>10.4g} {lay.sparsity:>8.3f} {lay.ffn_rel_error:>8.4f} {hot:>8}")
