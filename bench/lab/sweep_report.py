"""What a sweep (:mod:`llamaflash.bench.sweep`) reports: a table with one line per budget (decode tok/s
of each config, the ratios the curve is judged by, the planner's predictions beside the measurements),
the JSON, and a PNG of tok/s against the budget with the model file's size and the region where stock
was OOM-killed marked (matplotlib, the optional extra ``llamaflash[bench]``).

Ratios: ``x stock`` = llamaflash ÷ stock at the same budget (stock OOM-killed counts as 0: no ratio,
llamaflash wins); ``x nospec`` = llamaflash ÷ llamaflash without speculation. A prediction that is off
the measurement by more than PREDICTION_TOLERANCE is marked ``!``. ``same tokens`` compares the
speculative and the non-speculative runs' tokens at the budget (they must be equal).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from . import memlimit
from .sweep import PREDICTION_TOLERANCE, predicted_for

PLOT_NEEDS = "the plot needs matplotlib: pip install 'llamaflash[bench]' (the table and the JSON have every number)"


def summary(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """memlimit's per-(budget, config) rows (medians over the ok runs) for the measured runs."""
    configs = payload["identity"]["configs"]
    budgets = sorted(payload["identity"]["budgets_mb"], reverse=True)
    return memlimit.summarize(payload["runs"], configs, budgets) if payload.get("runs") else []


def curve(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per budget, ascending: ``budget_mb``, ``lane`` (the planner's), per config its row
    (``rows[config]``), the ratios, the predictions and whether the spec/nospec tokens agree."""
    rows = summary(payload)
    preds = payload.get("predictions", {}).get("budgets", {})
    out = []
    for b in sorted(payload["identity"]["budgets_mb"]):
        by = {r["config"]: r for r in rows if r["limit_mb"] == b}
        point = preds.get(str(b), {})
        c: dict[str, Any] = {
            "budget_mb": b,
            "lane": point.get("lane"),
            "refused": point.get("refused"),
            "rows": by,
            "predicted": {
                cfg: predicted_for(cfg, point) for cfg in (memlimit.BUDGET_CONFIG, memlimit.NO_SPECULATION_CONFIG)
            },
        }
        dec = {cfg: (by[cfg]["decode_tps"] if cfg in by else None) for cfg in payload["identity"]["configs"]}
        c["decode"] = dec
        stock = by.get("stock")
        flash = dec.get(memlimit.BUDGET_CONFIG)
        c["x_stock"] = (
            flash / dec["stock"]
            if flash and dec.get("stock")
            else (float("inf") if flash and stock and stock["status"].startswith("OOM") else None)
        )
        nospec = dec.get(memlimit.NO_SPECULATION_CONFIG)
        c["x_nospec"] = flash / nospec if flash and nospec else None
        c["stock_oom"] = bool(stock and stock["status"].startswith("OOM"))
        c["prediction_error"] = {
            cfg: (dec[cfg] / p - 1 if dec.get(cfg) and p else None) for cfg, p in c["predicted"].items()
        }
        c["same_tokens"] = _same_tokens(payload["runs"], b)
        out.append(c)
    return out


def _same_tokens(runs: list[dict[str, Any]], budget: int) -> Optional[bool]:
    """Whether every ok speculative and non-speculative run at ``budget`` decoded the same tokens
    (over their common prefix: decode may stop early under the time cap); None if either is missing."""
    toks = [
        r.get("tokens")
        for r in runs
        if r.get("ok")
        and r["limit_mb"] == budget
        and r["config"] in (memlimit.BUDGET_CONFIG, memlimit.NO_SPECULATION_CONFIG)
        and r.get("tokens")
    ]
    kinds = {r["config"] for r in runs if r.get("ok") and r["limit_mb"] == budget and r.get("tokens")}
    if not {memlimit.BUDGET_CONFIG, memlimit.NO_SPECULATION_CONFIG} <= kinds:
        return None
    n = min(len(t) for t in toks)
    return all(t[:n] == toks[0][:n] for t in toks)


def _f(v: Any, spec: str, none: str = "-") -> str:
    return none if v is None else ("inf" if v == float("inf") else format(v, spec))


def format_table(payload: dict[str, Any]) -> str:
    """The curve as text: measured and predicted, or the predictions alone when nothing was measured."""
    measured = payload.get("measured", False)
    configs = [c for c in payload["identity"]["configs"]]
    head = ["budget MiB", "runs as"]
    if measured:
        head += [f"{c} tok/s" for c in configs] + ["x stock", "x nospec", "same tokens"]
    head += ["predicted nospec", "predicted spec"]
    cells = [head]
    flagged = False
    for c in curve(payload):
        line = [str(c["budget_mb"]), "refused" if c["refused"] else (c["lane"] or "-")]
        if measured:
            for cfg in configs:
                row = c["rows"].get(cfg)
                line.append(
                    _f(c["decode"].get(cfg), ".2f")
                    if row is None or row["status"] == "ok"
                    else row["status"].split(" (")[0]
                )
            line += [
                _f(c["x_stock"], ".2f"),
                _f(c["x_nospec"], ".2f"),
                {True: "yes", False: "NO", None: "-"}[c["same_tokens"]],
            ]
        for cfg in (memlimit.NO_SPECULATION_CONFIG, memlimit.BUDGET_CONFIG):
            p, err = c["predicted"][cfg], c["prediction_error"][cfg]
            mark = ""
            if err is not None:
                mark = f" ({err:+.0%}{'!' if abs(err) > PREDICTION_TOLERANCE else ''})"
                flagged |= abs(err) > PREDICTION_TOLERANCE
            line.append(_f(p, ".2f") + mark)
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    text = ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in cells]
    text.insert(1, "-" * len(text[0]))
    notes = [
        "runs as: the planner's decision for llamaflash at the budget (stock: the budget holds what stock "
        "keeps resident, so llamaflash runs stock llama.cpp; offload: flash offload; refused: below its "
        "least budget)"
    ]
    if measured:
        notes.append(
            "decode tok/s: medians over the ok runs (OOM: killed by the cgroup); x stock = llamaflash / "
            "stock (inf: stock OOM-killed); x nospec = llamaflash / llamaflash-nospec; same tokens: the "
            "speculative and non-speculative runs decoded the same tokens"
        )
    else:
        notes.append("PREDICTIONS ONLY: nothing was measured (" + payload.get("cgroup", {}).get("detail", "") + ")")
    notes.append(
        "predicted: the planner's decode tok/s for flash offload (decode_speed.plan_token_time: the longer "
        "of the plan's flash reads and its compute; spec: draft_plan's best draft length over that pass at "
        "the plan's predicted self-draft acceptance), and where llamaflash runs stock, stock's in-memory "
        "rate (every weight read once per token at the machine's dense rate, decode_speed.MachineRates); "
        "(+x%) = measured / predicted - 1; the counters behind a miss: python -m llamaflash.bench.sweep_rates"
        + (f"; ! = off by more than {PREDICTION_TOLERANCE:.0%}" if flagged else "")
    )
    return "\n".join(text + [""] + notes)


def write_plot(path: Path, payload: dict[str, Any]) -> Optional[Path]:
    """PNG of decode tok/s against the budget: measured lines per config (solid), the planner's
    predictions (dashed), the model file's size (vertical line), the budgets where stock was
    OOM-killed (shaded) and where llamaflash runs stock (hatched). None without matplotlib."""
    plt = memlimit._pyplot()
    if plt is None:
        return None
    pts = curve(payload)
    measured = payload.get("measured", False)
    fig, ax = plt.subplots(figsize=(9, 5))
    xs = [c["budget_mb"] for c in pts]
    if measured:
        for cfg in payload["identity"]["configs"]:
            data = [(c["budget_mb"], c["decode"][cfg]) for c in pts if c["decode"].get(cfg)]
            if data:
                ax.plot(*zip(*data), marker="o", label=f"{cfg} (measured)")
    for cfg, style in ((memlimit.NO_SPECULATION_CONFIG, "--"), (memlimit.BUDGET_CONFIG, ":")):
        data = [(c["budget_mb"], c["predicted"][cfg]) for c in pts if c["predicted"][cfg]]
        if data:
            ax.plot(*zip(*data), linestyle=style, marker="x", label=f"{cfg} (PREDICTED by the planner)")
    step = (xs[1] - xs[0]) / 2 if len(xs) > 1 else 10
    for c in pts:
        if c["stock_oom"]:
            ax.axvspan(c["budget_mb"] - step, c["budget_mb"] + step, color="red", alpha=0.12, lw=0)
        if c["lane"] == "stock":
            ax.axvspan(c["budget_mb"] - step, c["budget_mb"] + step, color="green", alpha=0.06, lw=0, hatch="//")
    model_mb = payload.get("model_mb")
    if model_mb:
        ax.axvline(model_mb, color="gray", linestyle="-.", lw=1)
        ax.annotate(
            f"model file {model_mb:.0f} MiB",
            (model_mb, ax.get_ylim()[1] * 0.95),
            rotation=90,
            ha="right",
            va="top",
            fontsize=8,
            color="gray",
        )
    if any(c["stock_oom"] for c in pts):
        ax.plot([], [], color="red", alpha=0.3, lw=8, label="stock OOM-killed")
    if any(c["lane"] == "stock" for c in pts):
        ax.plot([], [], color="green", alpha=0.2, lw=8, label="llamaflash runs stock (budget holds the model)")
    ax.set_xlabel("RAM budget = memory cgroup limit, MiB (process + page cache)")
    ax.set_ylabel("decode tok/s" + ("" if measured else " (PREDICTED)"))
    name = payload.get("model", {}).get("name", "")
    threads = payload["identity"]["threads"]
    ax.set_title(
        f"{name}, {threads} threads: decode speed against memory"
        + ("" if measured else "\nPREDICTIONS ONLY (memory cgroups unavailable: nothing measured)")
    )
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(
    payload: dict[str, Any], json_path: Path, png_path: Optional[Path], echo: Callable[[str], None] = print
) -> None:
    """Print the table, say where the JSON is, write the PNG (or say what it needs)."""
    echo("")
    echo(format_table(payload))
    echo(f"wrote {json_path}")
    if png_path is not None:
        png = write_plot(png_path, payload)
        echo(f"wrote {png}" if png is not None else f"no plot: {PLOT_NEEDS}")


__all__ = ("summary", "curve", "format_table", "write_plot", "report", "PLOT_NEEDS")
