"""Shared pieces of the llamaflash benchmarks (DESIGN.md section 8).

- the fixed English prompt text (tokenised by a worker and truncated to exactly N tokens, so every
  configuration sees identical token ids);
- model resolution (asset name or path), page-cache warming, sha256;
- machine / version description;
- the worker subprocess runner (one JSON result line per run, marked with :data:`RESULT_MARK`);
- medians, ratios versus stock, greedy agreement and the summary table.

Only the standard library is imported here: the parent process never loads llama.cpp, each run
does so in a fresh subprocess (``bench/_bench_worker.py``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
WORKER = BENCH_DIR / "_bench_worker.py"
RESULTS_DIR = BENCH_DIR / "results"
RESULT_MARK = "@@BENCH_RESULT@@ "

# Configs that run stock llama-cpp-python.  "stock2" is a second, identical stock config used to
# check the ratio machinery (it should come out at ~1.0x).  Every other config name is a llamaflash
# flash_mode ("dense", ...).
STOCK_CONFIGS = ("stock", "stock2")

# A fixed, original English text (~530 tokens with the Llama/Qwen/Gemma tokenisers).  Prompts are
# its first N tokens; it is repeated if N is larger.  Changing it changes every benchmark: don't.
PROMPT_TEXT = (
    "The old harbour town sits at the mouth of a slow brown river, where the water from the hills "
    "meets the grey sea and the two argue politely for most of the year. Every morning before dawn "
    "the fishing boats go out past the lighthouse, and every evening they come back with whatever "
    "the tide allowed: mackerel in summer, herring in the autumn, and in the long winter months "
    "mostly stories about the fish that got away. The lighthouse keeper, a patient woman named "
    "Margaret, has kept a logbook for thirty-one years. In it she writes the weather, the wind "
    "direction, the height of the waves at noon, and the names of the boats that passed. Nobody "
    "asked her to do this. The light has been automatic since before she arrived, and the "
    "harbour authority sends an engineer twice a year to check the lamp and the batteries. But "
    "Margaret believes that a place is only understood by someone who pays attention to it every "
    "single day, and so she pays attention.\n\n"
    "Her logbooks fill two shelves in the small kitchen at the base of the tower. Researchers from "
    "the university came one spring to copy them, because thirty years of careful daily "
    "observations turned out to be worth more than they had imagined. They found that the storms "
    "had shifted later in the year, that the prevailing wind had turned a few degrees toward the "
    "south, and that the number of boats had fallen by half and then, more recently, begun to "
    "rise again as younger families returned to the town. None of these changes would have been "
    "visible from a single year, or even from five. They appeared only when the pages were laid "
    "side by side, one ordinary day after another, until the pattern could not be ignored.\n\n"
    "Margaret was pleased but not surprised. She had always thought of the logbook as a kind of "
    "conversation with the future, a way of telling someone she would never meet what it had "
    "been like to stand on this particular rock and watch this particular sea. When the "
    "researchers asked what she would do differently if she started again, she thought about it "
    "for a long time. Then she said that she would have written down more about the people: who "
    "came to the harbour to watch the boats leave, who waited on the quay when the weather turned "
    "bad, who laughed and who stayed silent. The numbers, she said, tell you what happened. Only "
    "the people tell you what it meant. The researchers wrote that down too, and it became the "
    "first line of the report they published the following winter, which the town library keeps "
    "on a shelf by the window, next to a photograph of the lighthouse in a storm."
)


# --------------------------------------------------------------------------------------------
# assets / model files


def import_assets():
    """``llamaflash.assets``, or the source file when the package is not installed."""
    try:
        from llamaflash import assets  # type: ignore

        return assets
    except ImportError:
        path = REPO_ROOT / "plugin" / "assets.py"
        spec = importlib.util.spec_from_file_location("_llamaflash_assets_src", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


def resolve_model(model: str) -> tuple[Path, str, str]:
    """(path, short name, sha256) for an asset name (fetched and verified) or a GGUF path."""
    assets = import_assets()
    if model in assets.MODELS:
        path = assets.fetch_model(model)
        return path, model, assets.MODELS[model].sha256
    path = Path(model).expanduser().resolve()
    if not path.is_file():
        raise SystemExit(f"model {model!r} is neither a known asset ({', '.join(assets.list_models())}) nor a file")
    return path, path.stem, sha256_file(path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(8 << 20):
            h.update(b)
    return h.hexdigest()


def warm_page_cache(path: Path) -> float:
    """Read a file once so an in-memory benchmark starts with it in the page cache; returns seconds."""
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    return time.perf_counter() - t


def sidecar_path_for(model: Path) -> Path:
    """Where llamaflash expects the sidecar of ``model``: ``<stem>.flash.gguf`` beside it."""
    return model.with_name(model.stem + ".flash.gguf")


# --------------------------------------------------------------------------------------------
# machine


def _pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    cpu = None
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if cpu is None and line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            if not flags and line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    mem_total_kb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total_kb = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpu": cpu or platform.processor(),
        "cores_online": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "simd": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "f16c", "fma") if f in flags],
        "mem_total_mb": round(mem_total_kb / 1024) if mem_total_kb else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "llama_cpp_python": _pkg_version("llama_cpp_python"),
        "llamaflash": _pkg_version("llamaflash"),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


# --------------------------------------------------------------------------------------------
# other load on the machine (the benchmarks share a small machine: measure, don't assume, quiet)

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_busy_seconds() -> float:
    """Machine-wide busy CPU seconds so far (all cores; /proc/stat, excluding idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def machine_busy_fraction(seconds: float = 1.0) -> float:
    """Fraction of all cores busy over the next ``seconds`` (this process sleeps meanwhile)."""
    b0, t0 = cpu_busy_seconds(), time.monotonic()
    time.sleep(seconds)
    return (cpu_busy_seconds() - b0) / ((time.monotonic() - t0) * (os.cpu_count() or 1))


def wait_until_quiet(max_wait: float, threshold: float = 0.10, window: float = 1.0) -> float:
    """Sleep until the machine is at most ``threshold`` busy over one ``window`` (or ``max_wait``
    seconds have passed); returns the last busy fraction measured."""
    deadline = time.monotonic() + max_wait
    busy = machine_busy_fraction(window)
    while busy > threshold and time.monotonic() < deadline:
        busy = machine_busy_fraction(window)
    return busy


# --------------------------------------------------------------------------------------------
# subprocesses


class WorkerError(RuntimeError):
    pass


def run_worker(
    spec: dict[str, Any],
    *,
    timeout: float | None = 900,
    env: dict[str, str] | None = None,
    cmd_prefix: Sequence[str] = (),
) -> dict[str, Any]:
    """Run ``_bench_worker.py`` with ``spec`` (JSON) in a fresh interpreter; return its result dict.

    ``cmd_prefix`` lets a caller wrap the command (e.g. to start it inside a memory cgroup).
    Raises WorkerError with the exit status and stderr tail when no result line comes back.
    """
    cmd = [*cmd_prefix, sys.executable, str(WORKER), json.dumps(spec)]
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as e:
        raise WorkerError(f"worker timed out after {timeout}s: {spec.get('config')}") from e
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK) :])
            if proc.returncode != 0:
                result.setdefault("warnings", []).append(f"worker exit status {proc.returncode}")
            return result
    tail = "\n".join((proc.stderr or "").strip().splitlines()[-25:])
    raise WorkerError(f"worker for {spec.get('config')!r} exited {proc.returncode} without a result:\n{tail}")


# --------------------------------------------------------------------------------------------
# statistics and the table


def median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def greedy_agreement(ref: Sequence[int], toks: Sequence[int]) -> tuple[float, int | None]:
    """(fraction of positions with identical tokens, index of the first difference or None)."""
    n = min(len(ref), len(toks))
    if n == 0:
        return 0.0, 0
    same = sum(1 for a, b in zip(ref[:n], toks[:n]) if a == b)
    first = next((i for i, (a, b) in enumerate(zip(ref[:n], toks[:n])) if a != b), None)
    if first is None and len(ref) != len(toks):
        first = n
    return same / max(len(ref), len(toks)), first


def summarize(runs: list[dict[str, Any]], configs: Sequence[str], baseline: str = "stock") -> list[dict[str, Any]]:
    """Per-config medians over the successful runs, ratios versus ``baseline`` and greedy agreement
    of every run with the baseline's first successful run."""
    ok = [r for r in runs if r.get("ok")]
    ref_run = next((r for r in ok if r["config"] == baseline), None)
    ref_tokens = ref_run["tokens"] if ref_run else None
    rows = []
    base = {}
    for cfg in configs:
        rs = [r for r in ok if r["config"] == cfg]
        row: dict[str, Any] = {"config": cfg, "n_ok": len(rs), "n_failed": sum(1 for r in runs if r["config"] == cfg and not r.get("ok"))}
        for key in ("prefill_tps", "decode_tps", "peak_rss_mb", "anon_mb", "file_mb", "load_s", "foreign_cpu"):
            vals = [r.get(key) for r in rs]
            vals = [v for v in vals if v is not None]
            row[key] = median(vals)
            row[key + "_min"] = min(vals) if vals else None
            row[key + "_max"] = max(vals) if vals else None
        if ref_tokens is not None and rs:
            agrees = [greedy_agreement(ref_tokens, r["tokens"]) for r in rs]
            row["greedy_agree"] = median(a for a, _ in agrees)
            firsts = [f for _, f in agrees if f is not None]
            row["first_divergence"] = min(firsts) if firsts else None
        else:
            row["greedy_agree"] = row["first_divergence"] = None
        if cfg == baseline:
            base = row
        rows.append(row)
    for row in rows:
        for key in ("prefill_tps", "decode_tps"):
            b, v = base.get(key), row.get(key)
            row[key.split("_")[0] + "_x"] = (v / b) if (b and v) else None
    return rows


def _fmt(v: Any, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'config':<10} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill x':>10} {'decode x':>9} "
        f"{'peak RSS MB':>12} {'anon MB':>8} {'greedy agree':>13}  {'reps':>4} {'other load':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        agree = "-" if r["greedy_agree"] is None else f"{r['greedy_agree']:.3f}"
        if r.get("first_divergence") is not None:
            agree += f" @{r['first_divergence']}"
        reps = f"{r['n_ok']}" + (f"+{r['n_failed']}F" if r["n_failed"] else "")
        lines.append(
            f"{r['config']:<10} {_fmt(r['prefill_tps'], '.1f'):>14} {_fmt(r['decode_tps'], '.1f'):>13} "
            f"{_fmt(r['prefill_x'], '.3f'):>10} {_fmt(r['decode_x'], '.3f'):>9} "
            f"{_fmt(r['peak_rss_mb'], '.0f'):>12} {_fmt(r.get('anon_mb'), '.0f'):>8} {agree:>13}  {reps:>4} {_fmt(r.get('foreign_cpu_max'), '.1%'):>10}"
        )
    return "\n".join(lines)


def format_spread(rows: list[dict[str, Any]]) -> str:
    """One line per config: min..max of the repetitions (to judge the noise behind the medians)."""
    out = []
    for r in rows:
        if not r["n_ok"]:
            continue
        out.append(
            f"  {r['config']:<10} prefill {r['prefill_tps_min']:.1f}..{r['prefill_tps_max']:.1f}  "
            f"decode {r['decode_tps_min']:.1f}..{r['decode_tps_max']:.1f}  "
            f"peak RSS {r['peak_rss_mb_min']:.0f}..{r['peak_rss_mb_max']:.0f} MB  "
            f"load {r['load_s_min']:.2f}..{r['load_s_max']:.2f} s"
        )
    return "\n".join(out)


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
