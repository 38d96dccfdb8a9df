"""What the memory-limit benchmark (:mod:`llamaflash.bench.memlimit`) reports about its runs.

Input: the run dicts :func:`llamaflash.bench.memlimit.run_one` returns (worker fields plus ``limit_mb``,
``status``, the cgroup and blkio figures) and the payload :func:`~llamaflash.bench.memlimit.run_benchmark`
builds around them (``summary``, ``runs``, ``options``, ``model``, ...).

- :func:`summarize`: one row per (limit, config): status counts, medians over the ok runs, decode
  versus stock at the same limit, greedy agreement with stock's tokens at the largest limit, and the
  decode columns of :mod:`llamaflash.bench.decode_report`;
- :func:`format_table` (+ :func:`table_notes`): the plain-text table of those rows;
- :func:`write_json`, :func:`write_plot` (PNG of tok/s against the limit; matplotlib, optional);
- :func:`report`: the table, the I/O-bound and speculation lines, the JSON and the PNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from . import benchkit
from .cgroups import STATUSES
from .decode_report import expert_columns, io_bound_lines, limit_label, speculation_columns, speculation_lines
from .pagecache import EVICT_TOLERANCE_BYTES, MiB


def _read_total_bytes(r: dict[str, Any]) -> int | None:
    """Bytes the run read from disk: the blkio group's count, else /proc/<pid>/io read_bytes."""
    if r.get("blkio_read_bytes") is not None:
        return r["blkio_read_bytes"]
    io = r.get("io") or {}
    return io.get("read_bytes")


def _prefix_agreement(ref: Sequence[int], toks: Sequence[int]) -> tuple[float | None, int | None]:
    """Agreement over the common prefix (decode may stop early under a time cap)."""
    n = min(len(ref), len(toks))
    if n == 0:
        return None, None
    first = next((i for i, (a, b) in enumerate(zip(ref[:n], toks[:n])) if a != b), None)
    return sum(1 for a, b in zip(ref[:n], toks[:n]) if a == b) / n, first


def summarize(runs: list[dict[str, Any]], configs: Sequence[str], limits: Sequence[int | None]) -> list[dict[str, Any]]:
    """One row per (limit, config): counts by status, medians over the ok runs, decode ratio versus
    stock at the same limit, greedy agreement with the reference tokens (the first ok stock run
    at the largest limit; over the common prefix), and ``experts``: the expert engine's statistics
    (decode_report.expert_columns; None where no run served experts)."""
    ok = [r for r in runs if r.get("ok")]
    ref = next((r for lim in limits for r in ok if r["config"] == "stock" and r["limit_mb"] == lim), None)
    rows = []
    for limit in limits:
        base_decode = None
        for config in configs:
            rs = [r for r in runs if r["config"] == config and r["limit_mb"] == limit]
            good = [r for r in rs if r.get("ok")]
            counts = {s: sum(1 for r in rs if r.get("status") == s) for s in STATUSES}
            row: dict[str, Any] = {"limit_mb": limit, "config": config, "n_runs": len(rs), "counts": counts}
            row["status"] = _status_text(counts, rs)

            def med(key, rs=good):
                return benchkit.median(r.get(key) for r in rs)

            for key in (
                "prefill_tps",
                "decode_tps",
                "ttft_s",
                "load_s",
                "cg_peak_mb",
                "vm_hwm_mb",
                "n_gen_done",
                "foreign_cpu",
                "evict_residual_mb",
            ):
                row[key] = med(key)
            row["decode_tps_range"] = ([min(r["decode_tps"] for r in good if r.get("decode_tps") is not None),
                                        max(r["decode_tps"] for r in good if r.get("decode_tps") is not None)]
                                       if any(r.get("decode_tps") is not None for r in good) else None)  # fmt: skip
            reads = [_read_total_bytes(r) for r in good]
            row["read_mb"] = benchkit.median(x / MiB for x in reads if x is not None)
            row["decode_read_mb_per_tok"] = benchkit.median(
                r["read_bytes_phases"]["decode"] / MiB / r["n_gen_done"]
                for r in good if r.get("read_bytes_phases") and r.get("n_gen_done"))  # fmt: skip
            row["evict_residual_mb_max"] = max((r.get("evict_residual_mb") or 0 for r in rs), default=0)
            budgets = [r.get("ram_budget") for r in rs if r.get("ram_budget")]
            row["budget_applied"] = all(b.get("applied") for b in budgets) if budgets else None
            row["flash_mode"] = next((r.get("flash_mode") for r in rs if r.get("flash_mode")), None)
            if ref is not None and good:
                agrees = [_prefix_agreement(ref["tokens"], r["tokens"]) for r in good]
                vals = [a for a, _ in agrees if a is not None]
                row["greedy_agree"] = benchkit.median(vals)
                firsts = [f for _, f in agrees if f is not None]
                row["first_divergence"] = min(firsts) if firsts else None
            else:
                row["greedy_agree"] = row["first_divergence"] = None
            row.update(speculation_columns(good))
            row["experts"] = expert_columns(good)
            if config == "stock":
                base_decode = row["decode_tps"]
            rows.append(row)
        for row in rows:
            if row["limit_mb"] == limit:
                d = row["decode_tps"]
                row["decode_x_stock"] = d / base_decode if (d and base_decode) else None
    return rows


def _status_text(counts: dict[str, int], rs: list[dict[str, Any]]) -> str:
    if not rs:
        return "-"
    parts = [(s, n) for s, n in counts.items() if n]
    if len(parts) == 1:
        s = parts[0][0]
        if s == "OOM":
            phases = sorted({r.get("died_in") or "?" for r in rs})
            return f"OOM ({'/'.join(phases)})"
        return s
    return ", ".join(f"{n} {s}" for s, n in parts)


def _fmt(v: Any, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def config_label(row: dict[str, Any]) -> str:
    """The config name, with a '*' when it asked for a RAM budget that was not applied."""
    return row["config"] + ("*" if row.get("budget_applied") is False else "")


TABLE_COLUMNS = (
    "limit MB",
    "config",
    "status",
    "prefill tok/s",
    "decode tok/s",
    "x stock",
    "TTFT s",
    "load s",
    "cg peak MB",
    "VmHWM MB",
    "read MB",
    "dec MB/tok",
    "tokens",
    "agree",
    "other load",
)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text table (one line per (limit, config)) plus footnotes."""
    cells = [TABLE_COLUMNS]
    for r in rows:
        agree = _fmt(r.get("greedy_agree"), ".3f")
        if r.get("first_divergence") is not None:
            agree += f"@{r['first_divergence']}"
        cells.append((
            limit_label(r["limit_mb"]), config_label(r), r["status"],
            _fmt(r["prefill_tps"], ".1f"), _fmt(r["decode_tps"], ".2f"), _fmt(r.get("decode_x_stock"), ".2f"),
            _fmt(r["ttft_s"], ".2f"), _fmt(r["load_s"], ".1f"), _fmt(r["cg_peak_mb"], ".0f"),
            _fmt(r["vm_hwm_mb"], ".0f"), _fmt(r["read_mb"], ".0f"), _fmt(r["decode_read_mb_per_tok"], ".1f"),
            _fmt(r["n_gen_done"], ".0f"), agree, _fmt(r.get("foreign_cpu"), ".1%"),
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in cells) for i in range(len(TABLE_COLUMNS))]
    lines = []
    for k, row in enumerate(cells):
        lines.append(
            "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
        if k == 0:
            lines.append("-" * len(lines[0]))
    notes = table_notes(rows)
    return "\n".join(lines + ([""] + notes if notes else []))


def table_notes(rows: list[dict[str, Any]]) -> list[str]:
    notes = [
        "medians over the ok runs; status counts every run (OOM: killed by the cgroup's OOM killer, in the phase "
        "named); x stock = decode versus stock at the same limit; TTFT = prefill + first token (model loaded); "
        "cg peak = cgroup max usage (process + page cache); read MB = bytes read from disk by the whole run "
        "(blkio, else /proc/pid/io); dec MB/tok = read during decode per token; tokens = decode steps done "
        "(fewer than asked: the decode time cap); agree = greedy tokens equal to stock's at the largest limit "
        "(@ first difference)",
    ]
    if any(r.get("budget_applied") is False for r in rows):
        mode = next((r.get("flash_mode") for r in rows if r.get("budget_applied") is False), None)
        notes.append(f"* ram_budget_mb is not implemented in this llamaflash yet: this config ran flash_mode="
                     f"{mode!r} WITHOUT a RAM budget (only the cgroup limit applied)")  # fmt: skip
    residual = [r for r in rows if (r.get("evict_residual_mb_max") or 0) > EVICT_TOLERANCE_BYTES / MiB]
    if residual:
        notes.append("WARNING: model pages stayed in the page cache after eviction for "
                     + ", ".join(f"{limit_label(r['limit_mb'])} MB/{r['config']} ({r['evict_residual_mb_max']:.0f} MB)" for r in residual)
                     + ": another process maps the file; those runs got the pages for free (benchmark a private "
                       "copy: --private-copy DIR)")  # fmt: skip
    if any(r["limit_mb"] is None for r in rows):
        notes.append("limit 'none': memory cgroups were unavailable, measured without any memory limit")
    return notes


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    return benchkit.write_json(Path(path), payload)


def _pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plot(path: Path, payload: dict[str, Any]) -> Path | None:
    """PNG of decode (and prefill) tok/s versus the memory limit, one line per config; OOM cells are
    marked at the bottom.  Returns None when matplotlib is missing or nothing was limited."""
    plt = _pyplot()
    if plt is None:
        return None
    rows = [r for r in payload["summary"] if r["limit_mb"] is not None]
    if not rows:
        return None
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    all_vals = [r[k] for r in rows for k in ("decode_tps", "prefill_tps") if r.get(k)]
    floor = min(all_vals) / 3 if all_vals else 0.1
    for ax, key, title in ((axes[0], "decode_tps", "decode"), (axes[1], "prefill_tps", "prefill")):
        for i, cfg in enumerate(configs):
            rs = sorted((r for r in rows if r["config"] == cfg), key=lambda r: r["limit_mb"])
            label = cfg + ("*" if any(r.get("budget_applied") is False for r in rs) else "")
            xs = [r["limit_mb"] for r in rs if r.get(key)]
            ys = [r[key] for r in rs if r.get(key)]
            (line,) = ax.plot(xs, ys, marker="o", label=label)
            for r in rs:
                if not r.get(key) and r["n_runs"]:
                    ax.plot([r["limit_mb"]], [floor], marker="x", markersize=10, color=line.get_color())
                    ax.annotate(r["status"].split(" (")[0], (r["limit_mb"], floor), textcoords="offset points",
                                xytext=(0, 8 + 10 * i), ha="center", fontsize=8, color=line.get_color())  # fmt: skip
        ax.set_yscale("log")
        ax.set_xlabel("memory limit, MB (process + page cache)")
        ax.set_ylabel(f"{title} tok/s (median)")
        ax.set_title(f"{title} speed under a memory limit")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    model = payload.get("model", {}).get("name", "")
    fig.suptitle(
        f"{model}, {payload['options']['threads']} threads"
        + ("   (* no RAM budget applied)" if any(r.get("budget_applied") is False for r in rows) else "")
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(
    payload: dict[str, Any], json_path: Path, png_path: Path | None, echo: Callable[[str], None] = print
) -> None:
    """Print the table, write the JSON and the PNG (saying so when matplotlib is missing)."""
    echo("")
    echo(format_table(payload["summary"]))
    for line in io_bound_lines(payload["summary"]) + speculation_lines(payload["summary"]):
        echo(line)
    echo(f"wrote {write_json(json_path, payload)}")
    if png_path is not None:
        png = write_plot(png_path, payload)
        if png is not None:
            echo(f"wrote {png}")
        elif not any(r["limit_mb"] is not None for r in payload["summary"]):
            echo("no plot: nothing ran under a memory limit")
        else:
            echo("no plot: matplotlib is not installed (pip install 'llamaflash[bench]'); the table and the JSON "
                 "have every number")  # fmt: skip
