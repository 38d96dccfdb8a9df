"""Benchmark under a memory limit: stock llama.cpp and llamaflash, each run in its own process inside a
fresh memory cgroup of the same limit.

The limit covers the whole process *and* the page cache it faults in: a cgroup (v1 memory
controller) charges a page-cache page to the group whose process first brought it in.  Pages that
are already cached when the run starts belong to nobody in the group and are free for it, so the
model (and the sidecar) are evicted from the page cache before every run
(``posix_fadvise(POSIX_FADV_DONTNEED)``) and the eviction is checked with ``mincore``.  A page that
another process keeps mapped cannot be evicted; such a run is flagged (``evict_residual_mb``).

Layers (one module each, re-exported here):
- page cache (:mod:`llamaflash.bench.pagecache`): :func:`resident_bytes`, :func:`evict`, :func:`evict_files`;
- cgroups (:mod:`llamaflash.bench.cgroups`): :func:`memory_cgroup_support`, :class:`MemoryCgroup` (v1 memory controller: limit, peak,
  OOM kills), :class:`BlkioCgroup` (v1 blkio: bytes read from the model's disk, counted even for a
  process the OOM killer ended);
- one process in a limit: :func:`run_in_cgroup` (evict, start inside the groups, time out, classify
  the end: ``ok`` / ``OOM`` / ``timeout`` / ``killed`` / ``error``);
- the benchmark (this module): :class:`BenchOptions`, :func:`run_benchmark` (runs :mod:`llamaflash.bench.worker`
  per (rep, limit, config), each by :func:`run_one`);
- its report (:mod:`llamaflash.bench.memlimit_report`): :func:`summarize`, :func:`format_table`, :func:`write_plot`,
  :func:`report`.

``llamaflash bench`` (``cli/cli_budget.py``) and ``bench/bench_memlimit.py`` are thin edges over
:func:`run_benchmark`.  Only the standard library is used (matplotlib, optional, for the PNG).

Configs: ``stock`` (llama_cpp.Llama); ``llamaflash`` (``llamaflash.Llama(ram_budget_mb=<limit>)``:
flash offload planned for the limit; a limit below the planner's minimum is status ``refused``, with
the minimum in the error); any other name is a llamaflash ``flash_mode`` run without a budget
(``dense``, ...).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from . import benchkit, prompt_sets

# the layers below the benchmark (cgroups, page cache, decode columns) and its report (memlimit_report:
# summary rows, table, JSON, plot), re-exported: callers and tests use them through this module
from .cgroups import (  # noqa: F401
    STATUSES,
    BlkioCgroup,
    CgroupError,
    MemoryCgroup,
    Outcome,
    classify,
    memory_cgroup_support,
    run_in_cgroup,
)
from .decode_report import (  # noqa: F401  (add_io_bound, io_bound_lines: used through this module)
    add_io_bound,
    expert_columns,
    expert_read_rate,
    io_bound_lines,
    limit_label,
    speculation_columns,
    speculation_lines,
)
from .memlimit_report import (  # noqa: F401
    TABLE_COLUMNS,
    _fmt,
    _read_total_bytes,
    config_label,
    format_table,
    report,
    summarize,
    table_notes,
    write_json,
    write_plot,
)
from .pagecache import EVICT_TOLERANCE_BYTES, MiB, evict, evict_files, private_copies, resident_bytes  # noqa: F401

#: The llamaflash config that gets ``ram_budget_mb=<limit>`` (flash offload; speculative by default),
#: and the same without speculative decoding.
BUDGET_CONFIG = "llamaflash"
NO_SPECULATION_CONFIG = "llamaflash-nospec"
#: speculative, with the self-draft forced to compute from the sidecar's draft copy, or from the
#: resident clusters only (the planner's choice between them overridden)
DRAFT_COPY_CONFIG = "llamaflash-copy"
RESIDENT_DRAFT_CONFIG = "llamaflash-resident"
#: flash offload with n_ubatch fixed at 32 (the planner's choice at these budgets before it weighed
#: prefill): the decode and prefill the n_ubatch choice is compared with
UBATCH32_CONFIG = "llamaflash-ubatch32"

# --------------------------------------------------------------------------------------------
# the benchmark


@dataclass
class BenchOptions:
    model: str  # asset name (llamaflash.files.assets.MODELS) or .gguf path
    limits_mb: list[int]
    configs: list[str] = field(default_factory=lambda: ["stock", BUDGET_CONFIG])
    sidecar: str | None = None  # default <model stem>.flash.gguf beside the model
    reps: int = 2
    threads: int = 2
    n_prompt: int = 205
    n_gen: int = 64
    n_ctx: int = 512
    n_batch: int = 512
    flash_n_ubatch: int | None = None  # llamaflash configs: n_ubatch fixed instead of the plan's choice
    max_decode_s: float = 20.0  # a collapsing run stops decoding after this long (tok/s over what finished)
    timeout_s: float = 300.0  # per run, load included; the process is killed after it
    quiet_wait_s: float = 20.0  # before each run, wait up to this long for the machine to be idle
    use_cgroup: bool = True  # False: run without limits (what happens when cgroups are unavailable)
    private_copy_dir: str | None = None  # benchmark copies of the files made here (removed afterwards)
    # None: one text prompt of n_prompt tokens, decoded token by token; "chat" / "code": the prompt set
    # (llamaflash.bench.prompt_sets) in the model's chat template, decoded by llm.generate (speculative
    # where the config speculates), n_gen tokens or EOS per prompt
    prompt_set: str | None = None
    # measured right before each run (after the quiet wait), kept as run["disk_before"]: e.g. the disk's
    # throughput for the reads the run will make, whose rate varies over the day on a shared VM
    disk_probe: Callable[[], dict[str, Any]] | None = None

    def validate(self) -> None:
        if not self.configs:
            raise ValueError("no configs")
        if len(set(self.configs)) != len(self.configs):
            raise ValueError(f"duplicate configs: {self.configs}")
        if self.use_cgroup and not self.limits_mb:
            raise ValueError("no memory limits given")
        if any(x <= 0 for x in self.limits_mb):
            raise ValueError(f"memory limits must be positive MB: {self.limits_mb}")
        if self.reps < 1:
            raise ValueError("reps must be >= 1")
        if self.n_prompt <= 8:
            raise ValueError("the prompt must be longer than 8 tokens (the warm-up evaluates 8)")
        if self.n_prompt + self.n_gen + 1 > self.n_ctx:
            raise ValueError("prompt tokens + generated tokens must fit in n_ctx")


def _config_spec(config: str, limit_mb: int | None) -> dict[str, Any]:
    """The worker spec keys that make ``config`` what it is."""
    if config in benchkit.STOCK_CONFIGS:
        return {}
    if config == BUDGET_CONFIG:
        return {"flash_mode": None, "ram_budget_mb": limit_mb}
    if config == NO_SPECULATION_CONFIG:
        return {"flash_mode": None, "ram_budget_mb": limit_mb, "flash_speculative": False}
    if config == UBATCH32_CONFIG:
        return {"flash_mode": None, "ram_budget_mb": limit_mb, "n_ubatch": 32}
    if config in (DRAFT_COPY_CONFIG, RESIDENT_DRAFT_CONFIG):
        return {"flash_mode": None, "ram_budget_mb": limit_mb, "flash_draft_copy": config == DRAFT_COPY_CONFIG}
    return {"flash_mode": config}


def _phase_of(progress: list[dict[str, Any]]) -> str:
    if not progress:
        return "load"
    last = progress[-1]
    return {"loaded": "warm-up", "warmed_up": "prefill", "prefilled": "decode", "decoding": "decode"}.get(
        last["phase"], last["phase"]
    )


def run_one(spec: dict[str, Any], limit_mb: int | None, files: Sequence[Path], timeout: float) -> dict[str, Any]:
    """One worker run under ``limit_mb``; a result dict (worker fields + limit, status, cgroup figures)."""
    oc = run_in_cgroup(benchkit.worker_command(spec), limit_mb, timeout=timeout, evict_paths=files,
                       blkio_file=files[0] if files else None)  # fmt: skip
    result, progress = benchkit.parse_worker_output(oc.stdout)
    status = oc.status
    if status == "ok" and (result is None or not result.get("ok")):
        status = "error"
    if status == "error" and str((result or {}).get("error", "")).startswith("RamBudgetError"):
        status = "refused"  # the planner refusing a budget below its minimum is an answer, not a crash
    r: dict[str, Any] = dict(result or {"ok": False, "config": spec["config"], "rep": spec.get("rep")})
    r["ok"] = status == "ok"
    r.update({
        "status": status,
        "limit_mb": limit_mb,
        "returncode": oc.returncode,
        "signal": oc.signal,
        "wall_s": oc.wall_s,
        "cgroup": oc.cgroup,
        "cg_peak_mb": oc.cgroup["max_usage_bytes"] / MiB if oc.cgroup and oc.cgroup.get("max_usage_bytes") else None,
        "blkio_read_bytes": oc.blkio_read_bytes,
        "eviction": oc.eviction,
        "evict_residual_mb": max((e["resident_after"] for e in oc.eviction), default=0) / MiB,
        "notes": oc.notes,
        "progress_last": progress[-1] if progress else None,
    })  # fmt: skip
    for p in progress:  # what a run that died early had already said about itself
        for key in ("flash_mode", "ram_budget"):
            if key in p:
                r.setdefault(key, p[key])
    if status != "ok":
        r["died_in"] = _phase_of(progress)
        if progress and progress[-1].get("VmHWM_kb"):
            r.setdefault("vm_hwm_mb", progress[-1]["VmHWM_kb"] / 1024)
        if status in ("error", "killed", "refused") and not r.get("error"):
            tail = "\n".join(oc.stderr.strip().splitlines()[-15:])
            r["error"] = f"exit {oc.returncode}{' (' + oc.signal + ')' if oc.signal else ''}: {tail}"
    return r


#: One memory-limit benchmark at a time on a machine (two would compete for the cores, the disk and
#: the page cache and make each other's numbers meaningless).
LOCK_PATH = Path("/tmp/llamaflash-memlimit-bench.lock")


@contextlib.contextmanager
def bench_lock(path: Path = LOCK_PATH, wait_s: float | None = None, echo: Callable[[str], None] = print):
    """Hold an exclusive lock on ``path`` for the benchmark; waits for a running one (at most ``wait_s``
    seconds, then TimeoutError; None: as long as it takes)."""
    import fcntl

    f = open(path, "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            echo(f"another memory-limit benchmark holds {path} (pid {holder}): waiting for it to finish")
            deadline = None if wait_s is None else time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(f"{path} is still held by pid {holder}") from None
                    time.sleep(0.5)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
    finally:
        f.close()  # releases the lock


def _sigterm_as_interrupt() -> Callable[[], None]:
    """Make SIGTERM raise KeyboardInterrupt (so the worker, its groups and the copies are cleaned up);
    returns the function that restores the previous handler.  A no-op outside the main thread."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def run_benchmark(opts: BenchOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every (rep, limit, config) and return the payload (args, environment, runs, summary).

    Order: reps outermost, then limits from the largest down, configs innermost in an order that
    reverses from one (rep, limit) cell to the next, so that no config always runs right after the
    same other one (a stock run that thrashes leaves the disk and page cache busy for the next run)
    and slow drifts of the machine hit every config."""
    opts.validate()
    from llamaflash.files import assets

    if opts.model not in assets.MODELS and not Path(opts.model).expanduser().is_file():
        raise FileNotFoundError(f"model {opts.model!r} is neither a file nor a registry model "
                                f"({', '.join(assets.list_models())})")  # fmt: skip
    model_path, model_name, model_sha = benchkit.resolve_model(opts.model)
    flash_configs = [c for c in opts.configs if c not in benchkit.STOCK_CONFIGS]
    sidecar = Path(opts.sidecar).expanduser().resolve() if opts.sidecar else benchkit.sidecar_path_for(model_path)
    if flash_configs and not sidecar.is_file():
        raise FileNotFoundError(
            f"config(s) {', '.join(flash_configs)} need the sidecar {sidecar}: create it with "
            f"`llamaflash convert {model_path}` (or pass the sidecar path), or run only 'stock'"
        )

    originals = {"model": str(model_path), "sidecar": str(sidecar) if flash_configs else None}
    created: list[Path] = []
    if opts.private_copy_dir:
        echo(f"copying the files to {opts.private_copy_dir} (benchmarked there: no other process maps them)")
        copies, created = private_copies([model_path] + ([sidecar] if flash_configs else []), opts.private_copy_dir)
        model_path = copies[0]
        if flash_configs:
            sidecar = copies[1]
    restore = _sigterm_as_interrupt()
    try:
        with bench_lock(echo=echo):
            payload = _run_all(opts, model_path, model_name, model_sha, sidecar, flash_configs, echo)
    finally:
        restore()
        for c in created:
            c.unlink(missing_ok=True)
    payload["files"] = {"originals": originals, "private_copies": opts.private_copy_dir is not None}
    if flash_configs:
        # an MoE model's layout is read from the original (a private copy is deleted by now); the disk
        # profile is the one of the filesystem the runs read the sidecar from
        experts = expert_read_rate(Path(originals["model"]), sidecar, opts.n_ctx)
        add_io_bound(payload["summary"], payload["runs"], sidecar, experts)
    return payload


def _run_all(
    opts: BenchOptions,
    model_path: Path,
    model_name: str,
    model_sha: str,
    sidecar: Path,
    flash_configs: list[str],
    echo: Callable[[str], None],
) -> dict[str, Any]:
    cg_ok, cg_why = memory_cgroup_support() if opts.use_cgroup else (False, "memory cgroups switched off")
    limits: list[int | None] = sorted(set(opts.limits_mb), reverse=True) if cg_ok else [None]
    if not cg_ok:
        echo(f"WARNING: memory cgroups unavailable ({cg_why}). Measuring WITHOUT any memory limit instead: "
             f"each config runs {opts.reps}x with the model evicted from the page cache first (cold start), "
             f"limits {opts.limits_mb or '-'} are NOT applied.")  # fmt: skip
    else:
        echo(f"memory limits: {cg_why}")

    what = (
        {"chat_prompts": prompt_sets.prompt_set(opts.prompt_set)}
        if opts.prompt_set
        else {"prompt_text": benchkit.PROMPT_TEXT, "n_prompt": opts.n_prompt}
    )
    tok = benchkit.run_worker({"mode": "tokenize", "model": str(model_path), "config": "tokenize",
                               "threads": opts.threads, **what}, timeout=opts.timeout_s)  # fmt: skip
    if not tok.get("ok"):
        raise RuntimeError(f"tokenisation failed: {tok.get('error')}\n{tok.get('traceback', '')}")
    prompt_tokens = tok.get("prompt_tokens") or [t for p in tok["prompts_tokens"] for t in p]
    prompts = (
        {"mode": "generate", "prompts_tokens": tok["prompts_tokens"]}
        if opts.prompt_set
        else {"mode": "run", "prompt_tokens": prompt_tokens}
    )

    machine = benchkit.machine_info()
    echo(f"machine : {machine['cpu']}, {machine['cores_usable']}/{machine['cores_online']} cores, "
         f"{machine['mem_total_mb']} MB; load avg {machine['loadavg']}")  # fmt: skip
    echo(f"model   : {model_path} ({model_path.stat().st_size / 1e6:.1f} MB)")
    if flash_configs:
        echo(f"sidecar : {sidecar} ({sidecar.stat().st_size / 1e6:.1f} MB)")
    echo(f"run     : {len(prompt_tokens)} prompt tokens, up to {opts.n_gen} generated (decode stops after "
         f"{opts.max_decode_s:g} s), {opts.threads} threads, {opts.reps} reps of {', '.join(opts.configs)} at "
         f"{', '.join('no limit' if x is None else f'{x} MB' for x in limits)}")  # fmt: skip

    runs = []
    for rep in range(opts.reps):
        for i, limit in enumerate(limits):
            order = opts.configs if (rep + i) % 2 == 0 else opts.configs[::-1]
            for config in order:
                spec = {
                    "model": str(model_path), "config": config, "rep": rep,
                    "sidecar_path": str(sidecar) if config in flash_configs else None,
                    **prompts, "n_gen": opts.n_gen, "threads": opts.threads,
                    "n_ctx": opts.n_ctx, "n_batch": opts.n_batch, "max_decode_s": opts.max_decode_s,
                    "progress": True, **_config_spec(config, limit),
                }  # fmt: skip
                if opts.flash_n_ubatch and config in flash_configs:
                    spec["n_ubatch"] = opts.flash_n_ubatch
                files = [model_path] + ([sidecar] if config in flash_configs else [])
                busy = benchkit.wait_until_quiet(opts.quiet_wait_s) if opts.quiet_wait_s > 0 else None
                disk = opts.disk_probe() if opts.disk_probe is not None else None
                r = run_one(spec, limit, files, opts.timeout_s)
                r["machine_busy_before"] = busy
                if disk is not None:
                    r["disk_before"] = disk
                runs.append(r)
                echo(_run_line(r))

    rows = summarize(runs, opts.configs, limits)
    return {
        "benchmark": "memlimit",
        "options": {k: v for k, v in asdict(opts).items() if k != "disk_probe"},
        "cgroup": {"available": cg_ok, "detail": cg_why},
        "limits_mb": limits,
        "machine": machine,
        "system_info": tok.get("system_info"),
        **benchkit.files_record(model_path, model_name, model_sha, sidecar if flash_configs else None),
        "prompt_tokens": prompt_tokens,
        "summary": rows,
        "runs": runs,
    }


def _run_line(r: dict[str, Any]) -> str:
    head = f"  rep {r.get('rep')} {limit_label(r['limit_mb']):>5} MB {r['config']:<11}"
    if r["status"] != "ok":
        extra = f" in {r.get('died_in')}" if r.get("died_in") else ""
        err = f": {r['error'].splitlines()[0][:160]}" if r["status"] in ("error", "refused") and r.get("error") else ""
        return f"{head} {r['status']}{extra} after {r['wall_s']:.1f} s{err}"
    read = _read_total_bytes(r)
    line = (f"{head} prefill {r['prefill_tps']:7.1f} tok/s  decode {_fmt(r['decode_tps'], '6.2f')} tok/s "
            f"({r['n_gen_done']} tok)  ttft {r['ttft_s']:.2f} s  load {r['load_s']:.1f} s  "
            f"peak {_fmt(r.get('cg_peak_mb'), '.0f')} MB  read {_fmt(read / MiB if read is not None else None, '.0f')} MB")  # fmt: skip
    budget = r.get("ram_budget")
    if budget and not budget.get("applied"):
        line += f"  [no budget: {budget.get('fallback_flash_mode')}]"
    if r.get("evict_residual_mb", 0) > EVICT_TOLERANCE_BYTES / MiB:
        line += f"  [NOT EVICTED: {r['evict_residual_mb']:.0f} MB cached]"
    return line
