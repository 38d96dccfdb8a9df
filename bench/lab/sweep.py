"""The speed–memory curve of one model on this machine (``llamaflash bench MODEL --sweep``).

At each budget of a ladder, stock llama.cpp and llamaflash (``ram_budget_mb`` = the budget, speculative
by default, and without speculation) each run in a fresh process inside a fresh memory cgroup of that
budget, the files evicted first (:func:`llamaflash.bench.memlimit.run_one`). Beside every measured
point the planner's prediction for that budget (:func:`predict`): whether llamaflash runs stock or
offload there (plugin/planning/budget_decision.py), and for offload the decode speed the plan predicts
(decode_speed.plan_token_time: the longer of the plan's flash reads and its compute, llama.cpp's
weights, the gate, the sparse kernel over the active neurons, the checks; with speculation
draft_plan's best draft length over that pass and decode_speed's draft step at the plan's predicted
self-draft acceptance, prompt lookup left out); where the budget holds what stock keeps resident, stock's in-memory rate
(budget_decision.stock_decode_tok_s) for stock and for llamaflash, which runs stock there. Each
offload point keeps its predicted token by part (``token_time``), which
``python -m llamaflash.bench.sweep_rates`` sets beside the measured runs' counters.

The ladder (:func:`ladder`): by default ``points`` budgets evenly from the planner's least budget to
max(1.3 × the model file, 1.15 × what stock keeps resident), rounded to 10 MiB.

Progress and faults: every finished run is written to the JSON at once (atomically), so an
interrupted sweep keeps the points it measured; ``resume=True`` loads that JSON, checks that it is
the same sweep, and runs only the points it lacks. Cgroups are removed by ``run_in_cgroup`` whatever
ends a run, and the private copies a sweep made are deleted when it ends, interrupted or not.
Without usable memory cgroups nothing is measured: the sweep says so and reports the predictions
only, labelled as predictions.

A mixture-of-experts model (one with routed expert tensors, files.experts.read_moe_model) is swept by
:mod:`llamaflash.bench.sweep_moe`: by default the configs ``stock-norepack`` (plain file-backed weights
and flash attention: the stock configuration that runs under a limit, and the numerics llamaflash
reproduces), ``stock`` (its default repacks the experts into anonymous memory: OOM-killed under a
limit smaller than the model, shown as OOM) and ``llamaflash-nospec``; the ladder runs from the expert
planner's least budget (plan_experts' ``min_budget_bytes``) to the same top; the predictions per budget
are the expert plan's lane (refused, stock where the model fits, else experts), its hit rate, bytes read
per token and I/O bound. The report adds, per llamaflash run that served experts, the measured hit
rate, MB read and I/O wait per token and the I/O bound (the expert reads' disk rate ÷ the measured bytes
per token), and plots them (:mod:`llamaflash.bench.sweep_report`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from . import benchkit, memlimit, prompt_sets, sweep_moe
from .pagecache import MiB, private_copies

#: The configs a dense model's sweep measures by default: stock llama.cpp, llamaflash with ram_budget_mb
#: (speculative), and the same without speculation (an MoE model's: sweep_moe.MOE_CONFIGS).
CONFIGS = ("stock", memlimit.BUDGET_CONFIG, memlimit.NO_SPECULATION_CONFIG)
#: The default ladder's top: the larger of these multiples of the model file and of stock's resident need.
TOP_MODEL_RATIO = 1.3
TOP_STOCK_NEED_RATIO = 1.15
LADDER_STEP_MB = 10
#: A prediction further than this from the measurement is flagged in the table.
PREDICTION_TOLERANCE = 0.25
#: The JSON fields two sweeps must share for one to resume the other.
IDENTITY_FIELDS = (
    "configs",
    "budgets_mb",
    "reps",
    "threads",
    "n_prompt",
    "n_gen",
    "n_ctx",
    "n_batch",
    "max_decode_s",
    "prompt_set",
)


@dataclass
class SweepOptions:
    model: str  # registry name or .gguf path
    budgets_mb: list[int] = field(default_factory=list)  # empty: the default ladder
    points: int = 8
    configs: list[str] = field(default_factory=list)  # empty: the model's default (CONFIGS or MOE_CONFIGS)
    sidecar: Optional[str] = None
    reps: int = 1
    threads: int = 2
    n_prompt: int = 205
    n_gen: int = 64
    n_ctx: int = 512
    n_batch: int = 512
    max_decode_s: float = 20.0
    timeout_s: float = 300.0
    quiet_wait_s: float = 20.0
    use_cgroup: bool = True
    private_copy_dir: Optional[str] = None
    # "chat" / "code": the prompt set decoded with llm.generate (where llamaflash speculates); None: one
    # text prompt decoded token by token (no speculation in either llamaflash config)
    prompt_set: Optional[str] = "chat"

    def validate(self) -> None:
        if len(set(self.configs)) != len(self.configs):
            raise ValueError(f"configs must be distinct: {self.configs}")
        if any(b <= 0 for b in self.budgets_mb):
            raise ValueError(f"budgets must be positive MiB: {self.budgets_mb}")
        if self.points < 2 and not self.budgets_mb:
            raise ValueError("a ladder needs at least 2 points")
        if self.reps < 1:
            raise ValueError("reps must be >= 1")
        if self.prompt_set is not None:
            prompt_sets.prompt_set(self.prompt_set)  # raises for an unknown set
        if self.prompt_set is None and self.n_prompt <= 8:
            raise ValueError("the prompt must be longer than 8 tokens (the warm-up evaluates 8)")
        if self.prompt_set is None and self.n_prompt + self.n_gen + 1 > self.n_ctx:
            raise ValueError("prompt tokens + generated tokens must fit in n_ctx")


def ladder(least_mb: float, top_mb: float, points: int, step_mb: int = LADDER_STEP_MB) -> list[int]:
    """``points`` budgets from ``least_mb`` (rounded up to ``step_mb``) to ``top_mb``, evenly spaced,
    rounded to ``step_mb``, ascending and distinct."""
    lo = math.ceil(least_mb / step_mb) * step_mb
    hi = max(lo + step_mb, math.ceil(top_mb / step_mb) * step_mb)
    out = sorted({lo + round((hi - lo) * i / (points - 1) / step_mb) * step_mb for i in range(points)})
    return [int(x) for x in out]


# --------------------------------------------------------------------------------------------
# what the planner predicts


def predict(
    model_path: Path,
    sidecar: Path,
    budgets_mb: Sequence[int],
    n_ctx: int,
    disk: Optional[dict] = None,
    rates: Any = None,
) -> dict[str, Any]:
    """The planner's view of the ladder: ``least_mb`` (its least budget), ``stock_need_mb`` (what
    stock keeps resident, at the largest budget's n_ubatch), ``rates`` (the decode_speed.MachineRates
    used; None: its DEFAULT_RATES) and per budget a dict: ``lane`` (stock or offload), ``refused``
    (below the least budget), ``io_bound_tok_s`` (the offload plan's, None when nothing is read from
    flash), ``nospec_tok_s`` and ``spec_tok_s`` (llamaflash's predicted decode: the offload plan's, or
    stock's in-memory rate where the lane is stock), ``stock_tok_s`` (stock's in-memory rate where the
    budget holds what it keeps resident, else None: it would thrash) and, for an offload plan,
    ``token_time`` (its predicted seconds per token by part, decode_speed.OffloadTokenTime) and
    ``flash_bytes_per_token``. For an MoE model: sweep_moe.predict_moe's view (the expert plan's)."""
    from llamaflash.errors import RamBudgetError
    from llamaflash.files.experts import read_moe_model
    from llamaflash.files.gguf_model import read_base_model
    from llamaflash.files.sidecar import validate_pair
    from llamaflash.planning import budget_decision, decode_speed, draft_plan
    from llamaflash.planning.planner import plan_offload

    base = read_base_model(str(model_path))
    moe = read_moe_model(base.header) if base.header is not None else None
    if moe is not None:
        return sweep_moe.predict_moe(model_path, sidecar, budgets_mb, n_ctx, disk, header=base.header, moe=moe)
    rates = rates or decode_speed.DEFAULT_RATES
    info = validate_pair(model_path, sidecar, model=base)
    active = decode_speed.active_fraction(info)
    big = plan_offload(model_path, sidecar, 1 << 20, n_ctx=n_ctx, disk=disk, info=info, header=base.header)
    least_mb = big.least_budget_bytes / MiB
    top = max(budgets_mb) if budgets_mb else 1 << 20
    # what stock as measured (llama.cpp's default: weights mapped) keeps resident: the ladder goes past it
    stock_need_mb = budget_decision.decide(base.header, info, top, n_ctx, use_mmap=True).stock_need_bytes / MiB
    points = {}
    for b in budgets_mb:
        d = budget_decision.decide(base.header, info, b, n_ctx)
        stock_tok_s = budget_decision.stock_decode_tok_s(d, rates) if d.stock else None
        row: dict[str, Any] = {
            "lane": d.lane,
            "stock_need_mb": d.stock_need_bytes / MiB,
            "refused": None,
            "io_bound_tok_s": None,
            "nospec_tok_s": stock_tok_s,
            "spec_tok_s": stock_tok_s,
            "stock_tok_s": stock_tok_s,
        }
        try:
            plan = plan_offload(model_path, sidecar, b, n_ctx=n_ctx, disk=disk, info=info, header=base.header)
        except RamBudgetError as e:
            row["refused"] = str(e)
            points[str(b)] = row
            continue
        row["io_bound_tok_s"] = plan.io_bound_tok_s
        row["neuron_hit_rate"] = plan.neuron_hit_rate
        row["flash_bytes_per_token"] = plan.flash_bytes_per_token
        token = decode_speed.plan_token_time(plan, info, rates, active)
        row["token_time"] = token.as_dict()
        if d.lane == budget_decision.OFFLOAD:
            row["nospec_tok_s"] = token.tok_s
            pred = draft_plan.predict_plan(plan, info)  # its self-draft acceptance
            step = decode_speed.draft_step_seconds(plan, info, rates, active)
            spec = draft_plan.predict(token.total, step, pred.acceptance) if pred else None
            row["spec_tok_s"] = spec.tok_s if spec is not None and not plan.stream_gate else token.tok_s
        points[str(b)] = row
    return {
        "least_mb": least_mb,
        "stock_need_mb": stock_need_mb,
        "rates": dataclasses.asdict(rates),
        "active_fraction": active,
        "budgets": points,
    }


def monotone_violations(
    view: dict[str, Any], keys: Sequence[str] = ("io_bound_tok_s", "nospec_tok_s", "spec_tok_s")
) -> list[dict[str, Any]]:
    """Where the planner predicts a larger budget (more pinned) slower than a smaller one: per key, each
    budget whose prediction is below the best at any smaller budget, with that budget and both values."""
    out = []
    points = sorted(((int(b), p) for b, p in view["budgets"].items()), key=lambda bp: bp[0])
    for key in keys:
        best: Optional[tuple] = None
        for b, p in points:
            v = p.get(key)
            if v is None:
                continue
            if best is not None and v < best[1] * (1 - 1e-9):
                out.append(
                    {"key": key, "budget_mb": b, "value": v, "smaller_budget_mb": best[0], "smaller_value": best[1]}
                )
            if best is None or v > best[1]:
                best = (b, v)
    return out


def default_budgets(model_path: Path, sidecar: Path, points: int, n_ctx: int, disk: Optional[dict] = None) -> list[int]:
    """The default ladder for this model (see the module docstring)."""
    view = predict(model_path, sidecar, [], n_ctx, disk)
    model_mb = model_path.stat().st_size / MiB
    return ladder(
        view["least_mb"], max(TOP_MODEL_RATIO * model_mb, TOP_STOCK_NEED_RATIO * view["stock_need_mb"]), points
    )


# --------------------------------------------------------------------------------------------
# the measurements

Runner = Callable[[dict, Optional[int], Sequence[Path], float], dict]


def run_key(r: dict[str, Any]) -> tuple:
    return (r["limit_mb"], r["config"], r.get("rep"))


def _identity(opts: SweepOptions) -> dict[str, Any]:
    d = asdict(opts)
    return {k: d[k] for k in IDENTITY_FIELDS}


def load_for_resume(path: Path, opts: SweepOptions, model: dict[str, Any]) -> dict[str, Any]:
    """The payload of an earlier, interrupted sweep at ``path``; ValueError when it is another sweep."""
    import json

    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume: cannot read the sweep {path}: {e}") from e
    if payload.get("benchmark") != "sweep":
        raise ValueError(f"--resume: {path} is not a sweep's JSON")
    mine = {**_identity(opts), "model_sha256": model["sha256"]}
    theirs = {**payload.get("identity", {}), "model_sha256": payload.get("model", {}).get("sha256")}
    differ = sorted(k for k in mine if mine[k] != theirs.get(k))
    if differ:
        raise ValueError(
            f"--resume: {path} is another sweep (it differs in {', '.join(differ)}); give the same "
            f"options, or another --json to start a new sweep"
        )
    return payload


def run_sweep(
    opts: SweepOptions,
    json_path: Path,
    resume: bool = False,
    runner: Optional[Runner] = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure (or, without cgroups, predict) the curve; the payload is written to ``json_path`` after
    every run. ``runner(spec, limit_mb, files, timeout)``: one run's result (default memlimit.run_one).
    A KeyboardInterrupt (Ctrl-C, or SIGTERM) leaves the runs so far in the JSON and is raised again."""
    opts.validate()
    runner = runner or memlimit.run_one
    json_path = Path(json_path)
    if json_path.exists() and not resume:
        raise FileExistsError(f"{json_path} exists: pass --resume to continue that sweep, or another --json")
    model_path, model_name, model_sha = benchkit.resolve_model(opts.model)
    sidecar = Path(opts.sidecar).expanduser().resolve() if opts.sidecar else benchkit.sidecar_path_for(model_path)
    if not sidecar.is_file():
        raise FileNotFoundError(
            f"the sweep's llamaflash configs need the sidecar {sidecar}: create it with "
            f"`llamaflash convert {model_path}` (or pass --sidecar)"
        )
    from llamaflash.planning import disk_probe

    disk = disk_probe.saved_profile(sidecar)
    _, moe = sweep_moe.read_moe(model_path)
    if not opts.configs:
        opts.configs = list(sweep_moe.MOE_CONFIGS if moe is not None else CONFIGS)
    if not opts.budgets_mb:
        opts.budgets_mb = default_budgets(model_path, sidecar, opts.points, opts.n_ctx, disk)
    files = benchkit.files_record(model_path, model_name, model_sha, sidecar)
    payload = load_for_resume(json_path, opts, files["model"]) if resume and json_path.exists() else None
    if payload is None:
        payload = {
            "benchmark": "sweep",
            "identity": _identity(opts),
            "options": asdict(opts),
            **files,
            "model_mb": model_path.stat().st_size / MiB,
            "runs": [],
            "complete": False,
        }
    view = predict(model_path, sidecar, opts.budgets_mb, opts.n_ctx, disk)
    payload.update(predictions=view, disk_profile=(disk or {}).get("saved_at") or "built-in default")
    payload["moe"] = sweep_moe.moe_record(model_path, sidecar, moe, opts.n_ctx) if moe is not None else None
    payload["machine"] = benchkit.machine_info()  # (the CPU's SIMD sets decide the kernels' speed)
    cg_ok, cg_why = memlimit.memory_cgroup_support() if opts.use_cgroup else (False, "switched off (--no-cgroup)")
    payload["cgroup"] = {"available": cg_ok, "detail": cg_why}
    for v in monotone_violations(view):
        echo(
            f"WARNING: the planner predicts {v['key']} {v['value']:.2f} at {v['budget_mb']} MiB, less than "
            f"{v['smaller_value']:.2f} at {v['smaller_budget_mb']} MiB (more memory predicted slower)"
        )
    echo(
        f"sweep   : {model_path.name}, budgets {', '.join(map(str, opts.budgets_mb))} MiB (planner's least budget "
        f"{view['least_mb']:.0f} MiB; stock keeps about {view['stock_need_mb']:.0f} MiB resident; model file "
        f"{payload['model_mb']:.0f} MiB)"
    )
    if not cg_ok:
        echo(
            f"memory cgroups unavailable ({cg_why}): nothing is measured; the table and the plot show the "
            f"planner's PREDICTIONS only"
        )
        payload.update(measured=False, complete=True)
        _save(json_path, payload)
        return payload
    payload["measured"] = True
    created: list[Path] = []
    restore = memlimit._sigterm_as_interrupt()
    try:
        if opts.private_copy_dir:
            echo(f"copying the files to {opts.private_copy_dir} (benchmarked there: no other process maps them)")
            copies, created = private_copies([model_path, sidecar], opts.private_copy_dir)
            model_path, sidecar = copies
        with memlimit.bench_lock(echo=echo):
            _measure(opts, payload, model_path, sidecar, json_path, runner, echo)
    except KeyboardInterrupt:
        _save(json_path, payload)
        done = len(payload["runs"])
        echo(f"interrupted: {done} run(s) kept in {json_path}; continue with the same command and --resume")
        raise
    finally:
        restore()
        _remove_copies(created, opts.private_copy_dir, [model_path, sidecar])
    payload["complete"] = True
    _save(json_path, payload)
    return payload


def _save(json_path: Path, payload: dict[str, Any]) -> None:
    """Write the payload with ``summary``: sweep_report.summary's rows of the runs so far (medians per
    (budget, config), with the expert statistics and I/O bound of an MoE model's runs)."""
    from .sweep_report import summary

    payload["summary"] = summary(payload)
    benchkit.write_json(json_path, payload)


def _remove_copies(created: Sequence[Path], directory: Optional[str], originals: Sequence[Path]) -> None:
    """Delete the copies this sweep made, and a partial copy an interrupt left (``<name>.part``)."""
    for c in created:
        Path(c).unlink(missing_ok=True)
    if directory:
        for p in originals:
            (Path(directory).expanduser().resolve() / (Path(p).name + ".part")).unlink(missing_ok=True)


def _prompts(opts: SweepOptions, model_path: Path) -> dict[str, Any]:
    """The worker spec's prompt keys (tokenized once, by a worker)."""
    what = (
        {"chat_prompts": prompt_sets.prompt_set(opts.prompt_set)}
        if opts.prompt_set
        else {"prompt_text": benchkit.PROMPT_TEXT, "n_prompt": opts.n_prompt}
    )
    tok = benchkit.run_worker(
        {"mode": "tokenize", "model": str(model_path), "config": "tokenize", "threads": opts.threads, **what},
        timeout=opts.timeout_s,
    )
    if not tok.get("ok"):
        raise RuntimeError(f"tokenisation failed: {tok.get('error')}")
    if opts.prompt_set:
        return {"mode": "generate", "prompts_tokens": tok["prompts_tokens"]}
    return {"mode": "run", "prompt_tokens": tok["prompt_tokens"]}


def _measure(
    opts: SweepOptions,
    payload: dict[str, Any],
    model_path: Path,
    sidecar: Path,
    json_path: Path,
    runner: Runner,
    echo: Callable[[str], None],
) -> None:
    done = {run_key(r) for r in payload["runs"]}
    # the configs alternate their order between budgets and repetitions: a run right after another
    # config's (e.g. stock thrashing the page cache and the disk) is not always the same config's
    todo = [
        (limit, config, rep)
        for rep in range(opts.reps)
        for b, limit in enumerate(sorted(opts.budgets_mb, reverse=True))
        for config in (opts.configs if (rep + b) % 2 == 0 else opts.configs[::-1])
        if (limit, config, rep) not in done
    ]
    if done:
        echo(f"resuming: {len(done)} run(s) kept, {len(todo)} to go")
    if not todo:
        return
    prompts = _prompts(opts, model_path)
    t0 = time.monotonic()
    for i, (limit, config, rep) in enumerate(todo, 1):
        flash = config not in benchkit.STOCK_CONFIGS
        spec = {
            "model": str(model_path),
            "config": config,
            "rep": rep,
            "sidecar_path": str(sidecar) if flash else None,
            **prompts,
            "n_gen": opts.n_gen,
            "threads": opts.threads,
            "n_ctx": opts.n_ctx,
            "n_batch": opts.n_batch,
            "max_decode_s": opts.max_decode_s,
            "progress": True,
            **memlimit._config_spec(config, limit),
        }
        if opts.quiet_wait_s > 0:
            benchkit.wait_until_quiet(opts.quiet_wait_s)
        r = runner(spec, limit, [model_path] + ([sidecar] if flash else []), opts.timeout_s)
        payload["runs"].append(r)
        _save(json_path, payload)
        elapsed = time.monotonic() - t0
        left = elapsed / i * (len(todo) - i)
        echo(f"[{i}/{len(todo)}] {progress_line(r, payload['predictions'])}   ({elapsed:.0f} s, ~{left:.0f} s left)")


def progress_line(r: dict[str, Any], predictions: dict[str, Any]) -> str:
    """One run: budget, config, status or decode tok/s, and the planner's prediction for it."""
    head = f"{r['limit_mb']:>5} MiB {r['config']:<18}"
    if r.get("status") != "ok":
        return f"{head} {r.get('status')}" + (f" in {r['died_in']}" if r.get("died_in") else "")
    tps = r.get("decode_tps")
    pred = predicted_for(r["config"], predictions.get("budgets", {}).get(str(r["limit_mb"])))
    mode = f" [{r.get('flash_mode')}]" if r.get("flash_mode") else ""
    experts = (r.get("flash_stats") or {}).get("experts") or {}
    hit = f" expert hit rate {experts['hit_rate']:.2f}" if experts.get("hit_rate") is not None else ""
    return (
        (f"{head} decode {tps:6.2f} tok/s" if tps is not None else f"{head} decode -")
        + mode
        + hit
        + (f"  predicted {pred:.2f}" if pred is not None else "")
    )


def predicted_for(config: str, point: Optional[dict[str, Any]]) -> Optional[float]:
    """The planner's predicted decode tok/s for a config at a budget (None: no prediction)."""
    if not point:
        return None
    if config == memlimit.NO_SPECULATION_CONFIG:
        return point.get("nospec_tok_s")
    if config == memlimit.BUDGET_CONFIG:
        return point.get("spec_tok_s")
    return point.get("stock_tok_s")


#: Exit status of an interrupted sweep (128 + SIGINT).
EXIT_INTERRUPTED = 130


def run_from_command_line(
    opts: SweepOptions,
    json_path: Optional[Path],
    png_path: Optional[Path],
    resume: bool,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """``llamaflash bench MODEL --sweep``: run, then print the table and write the JSON and the PNG.
    Bad options and a JSON that is another sweep are LlamaflashError (exit status 2); an interrupt
    exits with status 130 after saying where the measured points are."""
    from llamaflash.errors import LlamaflashError

    from .sweep_report import report

    try:
        opts.validate()
    except ValueError as e:
        raise LlamaflashError(f"bench --sweep: {e}") from e
    if resume and json_path is None:
        raise LlamaflashError("--resume needs the --json of the sweep to continue")
    name = Path(opts.model).stem if Path(opts.model).suffix == ".gguf" else opts.model
    json_path = Path(json_path or f"llamaflash-sweep-{name}-{benchkit.timestamp()}.json")
    try:
        payload = run_sweep(opts, json_path, resume=resume, echo=echo)
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        raise LlamaflashError(str(e)) from e
    report(payload, json_path, png_path or json_path.with_suffix(".png"), echo=echo)
    return payload


__all__ = (
    "run_from_command_line",
    "monotone_violations",
    "SweepOptions",
    "CONFIGS",
    "ladder",
    "predict",
    "default_budgets",
    "run_sweep",
    "load_for_resume",
    "predicted_for",
    "progress_line",
)
