"""What a sweep (:mod:`llamaflash.bench.sweep`) reports: a table with one line per budget (decode tok/s
of each config, the ratios the curve is judged by, the planner's predictions beside the measurements),
the JSON, and a PNG of tok/s against the budget with the model file's size and the region where stock
was OOM-killed marked (matplotlib, the optional extra ``llamaflash[bench]``).

Ratios: ``x stock`` = llamaflash ÷ stock at the same budget (stock OOM-killed counts as 0: no ratio,
llamaflash wins); ``x nospec`` = llamaflash ÷ llamaflash without speculation. A prediction that is off
the measurement by more than PREDICTION_TOLERANCE is marked ``!``. ``same tokens`` compares the
speculative and the non-speculative runs' tokens at the budget (they must be equal).

An MoE model's sweep (``payload["moe"]``, :mod:`llamaflash.bench.sweep_moe`): the llamaflash config
whose experts are reported is the first non-stock one (``llamaflash-nospec`` by default); ``x norepack``
= it ÷ stock-norepack, ``x stock`` = it ÷ stock; ``same tokens`` compares every llamaflash run's tokens
with stock-norepack's (llamaflash reproduces its numerics). Per budget the table adds that config's
measured expert hit rate, MB read per decoded token (10^6 bytes), I/O wait per token (ms), I/O bound
(the expert reads' disk rate ÷ the bytes read per token, decode_report.add_expert_io_bound) and decode
as a share of it, beside the expert plan's predicted hit rate and I/O bound. The plot adds the measured
and predicted I/O bounds and, on a second axis, the measured and predicted hit rates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from . import memlimit, memlimit_report
from .decode_report import add_expert_io_bound, io_bound_lines
from .pagecache import MiB
from .sweep import PREDICTION_TOLERANCE, predicted_for
from .worker import STOCK_CONFIGS, STOCK_NO_REPACK

PLOT_NEEDS = "the plot needs matplotlib: pip install 'llamaflash[bench]' (the table and the JSON have every number)"


def summary(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """memlimit_report's per-(budget, config) rows (medians over the ok runs) for the measured runs; for an
    MoE model each row that served experts with its I/O bound (decode_report.add_expert_io_bound)."""
    configs = payload["identity"]["configs"]
    budgets = sorted(payload["identity"]["budgets_mb"], reverse=True)
    rows = memlimit_report.summarize(payload["runs"], configs, budgets) if payload.get("runs") else []
    if payload.get("moe"):
        add_expert_io_bound(rows, payload["moe"].get("disk"))
    return rows


def flash_config(payload: dict[str, Any]) -> Optional[str]:
    """The llamaflash config the ratios are taken of: ``llamaflash`` for a dense model; for an MoE
    model the first non-stock config (None: none)."""
    if not payload.get("moe"):
        return memlimit.BUDGET_CONFIG
    return next((c for c in payload["identity"]["configs"] if c not in STOCK_CONFIGS), None)


def curve(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per budget, ascending: ``budget_mb``, ``lane`` (the planner's), per config its row
    (``rows[config]``), the ratios, the predictions and whether the spec/nospec tokens agree; for an MoE
    model also :func:`_moe_point`'s fields, and ``same tokens`` over stock-norepack and llamaflash."""
    rows = summary(payload)
    preds = payload.get("predictions", {}).get("budgets", {})
    moe = bool(payload.get("moe"))
    flash_cfg = flash_config(payload)
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
        flash = dec.get(flash_cfg)
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
        if moe:
            c.update(_moe_point(by, dec, point, flash_cfg))
            flashes = {cfg for cfg in payload["identity"]["configs"] if cfg not in STOCK_CONFIGS}
            c["same_tokens"] = _same_tokens(payload["runs"], b, {STOCK_NO_REPACK} | flashes, STOCK_NO_REPACK)
        else:
            c["same_tokens"] = _same_tokens(payload["runs"], b)
        out.append(c)
    return out


def _moe_point(by: dict, dec: dict, point: dict, flash_cfg: Optional[str]) -> dict[str, Any]:
    """An MoE budget's extra fields: ``flash_config``, ``x_norepack``, ``experts`` (its row's expert
    statistics), ``io_bound_tps`` and ``of_io_bound`` (measured), and the plan's ``predicted_hit_rate``,
    ``predicted_mb_per_token`` and ``predicted_io_bound_tps``."""
    row = by.get(flash_cfg) or {}
    flash, ref = dec.get(flash_cfg), dec.get(STOCK_NO_REPACK)
    per_tok = point.get("flash_bytes_per_token")
    return {
        "flash_config": flash_cfg,
        "x_norepack": flash / ref if flash and ref else None,
        "experts": row.get("experts"),
        "io_bound_tps": row.get("io_bound_tps"),
        "of_io_bound": row.get("of_io_bound"),
        "predicted_hit_rate": point.get("hit_rate"),
        "predicted_mb_per_token": per_tok / 1e6 if per_tok is not None else None,
        "predicted_io_bound_tps": point.get("io_bound_tok_s"),
    }


def _same_tokens(
    runs: list[dict[str, Any]],
    budget: int,
    configs: frozenset | set = frozenset((memlimit.BUDGET_CONFIG, memlimit.NO_SPECULATION_CONFIG)),
    needs: Optional[str] = None,
) -> Optional[bool]:
    """Whether every ok run of ``configs`` at ``budget`` decoded the same tokens (over their common
    prefix: decode may stop early under the time cap); None unless two of them ran (and ``needs``, when
    given, is one of those that ran). Default: the speculative and non-speculative llamaflash."""
    toks = [
        r.get("tokens")
        for r in runs
        if r.get("ok") and r["limit_mb"] == budget and r["config"] in configs and r.get("tokens")
    ]
    kinds = {r["config"] for r in runs if r.get("ok") and r["limit_mb"] == budget and r.get("tokens")} & set(configs)
    if len(kinds) < 2 or (needs is not None and needs not in kinds):
        return None
    n = min(len(t) for t in toks)
    return all(t[:n] == toks[0][:n] for t in toks)


def _f(v: Any, spec: str, none: str = "-") -> str:
    return none if v is None else ("inf" if v == float("inf") else format(v, spec))


def format_table(payload: dict[str, Any]) -> str:
    """The curve as text: measured and predicted, or the predictions alone when nothing was measured."""
    if payload.get("moe"):
        return format_moe_table(payload)
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


def _columns(cells: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    text = ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in cells]
    text.insert(1, "-" * len(text[0]))
    return text


def _status_or(row: Optional[dict[str, Any]], value: Any, spec: str) -> str:
    """A config's cell: its value, or its status where its runs did not end ok (OOM, refused, ...)."""
    return _f(value, spec) if row is None or row["status"] == "ok" else row["status"].split(" (")[0]


def format_moe_table(payload: dict[str, Any]) -> str:
    """An MoE model's curve as text (see the module docstring): per budget the expert plan's lane, each
    config's decode tok/s, the ratios, the llamaflash config's expert statistics and I/O bound, and the
    plan's predicted hit rate, MB per token and I/O bound."""
    measured = payload.get("measured", False)
    configs = list(payload["identity"]["configs"])
    pts = curve(payload)
    flash_cfg = flash_config(payload)
    head = ["budget MiB", "runs as"]
    if measured:
        head += [f"{c} tok/s" for c in configs]
        head += ["x norepack", "x stock", "same tokens", "hit", "resident hit", "MB/tok", "wait ms/tok", "I/O bound"]
        head += ["of bound"]
    head += ["predicted hit", "predicted MB/tok", "predicted I/O bound"]
    cells = [head]
    for c in pts:
        line = [str(c["budget_mb"]), "refused" if c["refused"] else (c["lane"] or "-")]
        if measured:
            line += [_status_or(c["rows"].get(cfg), c["decode"].get(cfg), ".2f") for cfg in configs]
            e = c["experts"] or {}
            per_tok, wait = e.get("bytes_read_per_token"), e.get("io_wait_per_token_s")
            line += [
                _f(c["x_norepack"], ".2f"),
                _f(c["x_stock"], ".2f"),
                {True: "yes", False: "NO", None: "-"}[c["same_tokens"]],
                _f(e.get("hit_rate"), ".3f"),
                _f(e.get("resident_hit_rate"), ".3f"),
                _f(per_tok / 1e6 if per_tok is not None else None, ".2f"),
                _f(wait * 1e3 if wait is not None else None, ".1f"),
                _f(c["io_bound_tps"], ".2f"),
                _f(c["of_io_bound"], ".0%"),
            ]
        line += [
            _f(c["predicted_hit_rate"], ".3f"),
            _f(c["predicted_mb_per_token"], ".2f"),
            _f(c["predicted_io_bound_tps"], ".2f"),
        ]
        cells.append(line)
    view = payload.get("predictions", {})
    notes = [
        "runs as: the expert plan's decision for llamaflash at the budget (stock: the model runs as stock "
        "llama.cpp, nothing served from flash; experts: the routed experts served from flash through the "
        f"expert cache; refused: below its least budget, {view.get('least_mb', 0):.0f} MiB)"
    ]
    moe = payload["moe"]
    disk = moe.get("disk") or {}
    if measured:
        notes.append(
            f"decode tok/s: medians over the ok runs (OOM: killed by the cgroup; stock repacks the experts into "
            f"anonymous memory); x norepack / x stock = {flash_cfg} / stock-norepack, / stock (inf: stock "
            f"OOM-killed); same tokens: every llamaflash run decoded stock-norepack's tokens. hit, resident hit, "
            f"MB/tok, wait: {flash_cfg}'s expert cache (flash_stats()['experts']: hit rate counting prefetched "
            f"experts, the hit rate of the experts resident before the token's prefetch, which is what the plan "
            f"predicts, 10^6 bytes read and seconds waiting on reads per decoded token); I/O bound = {disk.get('disk_mb_s', 0):.0f} MB/s "
            f"({disk.get('read_kib', 0):.0f} KiB expert reads, depth {disk.get('queue_depth')}, disk profile: "
            f"{disk.get('profile')}) / MB per token; of bound = decode / I/O bound"
        )
    else:
        notes.append("PREDICTIONS ONLY: nothing was measured (" + payload.get("cgroup", {}).get("detail", "") + ")")
    notes.append(
        f"predicted: the expert plan (plan_experts) at the budget: hit rate = 1 - its miss rate without prefetch "
        f"({'LRU on the sidecar routing statistics' if view.get('routing_tokens') else 'uniform routing: the sidecar has no routing statistics'}), "
        f"bytes read per token, and its I/O bound (the disk's rate for expert reads / those bytes; disk "
        f"profile: {view.get('disk_profile')}); no decode speed is predicted beyond that bound"
    )
    notes.append(
        f"model: {moe.get('architecture')}, {moe.get('n_layer')} MoE layers x {moe.get('n_expert')} experts, "
        f"{moe.get('n_used')} used per token; experts {moe.get('expert_bytes', 0) / MiB:.0f} MiB of "
        f"{moe.get('file_bytes', 0) / MiB:.0f} MiB"
    )
    more = [ln for ln in io_bound_lines(summary(payload)) if flash_cfg is None or f" {flash_cfg}:" not in ln]
    return "\n".join(_columns(cells) + [""] + notes + (more if len(more) > 1 else []))


def write_plot(path: Path, payload: dict[str, Any]) -> Optional[Path]:
    """PNG of decode tok/s against the budget: measured lines per config (solid), the planner's
    predictions (dashed), the model file's size (vertical line), the budgets where stock was
    OOM-killed (shaded) and where llamaflash runs stock (hatched); for an MoE model also the I/O
    bounds and, on a second axis, the hit rates (:func:`_plot_moe`). None without matplotlib."""
    plt = memlimit_report._pyplot()
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
    twin = _plot_moe(ax, pts, measured) if payload.get("moe") else None
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
    if twin is None:
        ax.legend(fontsize=8)
    else:  # both axes' entries, below the plot (the second axis would draw over a legend inside)
        handles, labels = ax.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        ax.legend(handles + more[0], labels + more[1], fontsize=8, ncol=2, loc="upper center",
                  bbox_to_anchor=(0.5, -0.13))  # fmt: skip
        fig.set_size_inches(9, 6.5)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_moe(ax, pts: list[dict[str, Any]], measured: bool):
    """An MoE sweep's additions to the plot: the I/O bound per budget, measured (the expert reads' disk
    rate ÷ the llamaflash config's bytes per token) and the expert plan's (dashed), in tok/s on ``ax``;
    the expert hit rate, measured and predicted, on a second axis (0..1), which is returned."""
    cfg = next((c["flash_config"] for c in pts if c.get("flash_config")), None)
    if measured:
        data = [(c["budget_mb"], c["io_bound_tps"]) for c in pts if c.get("io_bound_tps")]
        if data:
            ax.plot(*zip(*data), color="black", lw=1, marker="^", label=f"I/O bound of {cfg} (measured bytes/token)")
    data = [(c["budget_mb"], c["predicted_io_bound_tps"]) for c in pts if c.get("predicted_io_bound_tps")]
    if data:
        ax.plot(*zip(*data), color="gray", lw=1, linestyle="--", marker="^", label="I/O bound (PREDICTED by the plan)")
    hits = ax.twinx()
    if measured:
        data = [(c["budget_mb"], c["experts"]["hit_rate"]) for c in pts if (c.get("experts") or {}).get("hit_rate")]
        if data:
            hits.plot(*zip(*data), color="purple", lw=1, marker="s", alpha=0.7, label=f"expert hit rate of {cfg}")
            for x, y in data:
                hits.annotate(f"{y:.0%}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center",
                              fontsize=7, color="purple")  # fmt: skip
    data = [(c["budget_mb"], c["predicted_hit_rate"]) for c in pts if c.get("predicted_hit_rate") is not None]
    if data:
        hits.plot(*zip(*data), color="purple", lw=1, linestyle=":", marker="+", alpha=0.7,
                  label="expert hit rate (PREDICTED by the plan)")  # fmt: skip
    hits.set_ylim(0, 1.05)
    hits.set_ylabel("expert cache hit rate", color="purple")
    return hits


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
