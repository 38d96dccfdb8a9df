"""Shared pieces of the llamaflash benchmarks in bench/.

The plumbing (prompt text, model resolution, machine description, the worker runner, medians,
greedy agreement, JSON) lives in the package, :mod:`llamaflash.bench.benchkit`, so that the
``llamaflash bench`` command has it too; it is re-exported here.  What stays here is the in-memory
benchmark's summary and table.

The process running a benchmark never loads a model: each run does so in a fresh subprocess
(``llamaflash/bench/worker.py``, run by file path, so a stock run never imports llamaflash).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from llamaflash.bench.benchkit import (  # noqa: F401  (re-exported for the bench scripts)
    PROGRESS_MARK,
    PROMPT_TEXT,
    RESULT_MARK,
    STOCK_CONFIGS,
    WORKER,
    WorkerError,
    cpu_busy_seconds,
    files_record,
    greedy_agreement,
    machine_busy_fraction,
    machine_info,
    median,
    parse_worker_output,
    resolve_model,
    run_worker,
    sha256_file,
    sidecar_path_for,
    timestamp,
    wait_until_quiet,
    warm_page_cache,
    worker_command,
    write_json,
)

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"


# --------------------------------------------------------------------------------------------
# the in-memory benchmark's summary and table


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
        row: dict[str, Any] = {
            "config": cfg,
            "n_ok": len(rs),
            "n_failed": sum(1 for r in runs if r["config"] == cfg and not r.get("ok")),
        }
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
