"""A sweep's measured runs against the planner's decode model (plugin/planning/decode_speed.py), part by part,
and the machine rates (decode_speed.MachineRates) the runs give.

    python -m llamaflash.bench.sweep_rates SWEEP.json [--fit-budget MiB [--inmemory IN.json ...]]
        [--rates RATES.json] [--json OUT.json]

For every measured point it prints, from counters that do not depend on a quiet CPU, the plan's
prediction beside the run's ``flash_stats``: hit rate, bytes read from flash per token (the cluster
reads, and the gate where it is streamed), bytes the decode read from disk beyond those (re-read
pages of mmapped weights: /proc/self/io during the decode less the engine's reads), the active share
of neurons; and the timed parts per token: decode, the sparse lane (gate GEMV + kernel + I/O wait),
the I/O wait, the rest (llama.cpp's graph, the splits' hand-off, the page faults). Then the
predicted tok/s three ways: the sweep's own (as recorded), the model's from the plan's numbers,
and the model's from the run's counters (its measured hit rate and bytes, active share, gate
placement; the disk rate the plan assumed), each with measured / predicted - 1.

``--fit-budget B`` derives the rates from this sweep (:func:`fit_rates`): the dense rate from a stock
run at the largest budget where llamaflash runs stock, the sparse rate, per-layer split cost and check
rate from the non-speculative offload run at B; the other budgets then test the model. The token
overhead (what a token costs beyond its weight bytes) is DEFAULT_RATES', or with ``--inmemory`` the
intercept of the line through bench/bench_inmemory.py's stock runs of two or more models
(:func:`fit_token_overhead`). Without ``--fit-budget`` the rates are ``--rates`` (a JSON of
MachineRates fields) or decode_speed.DEFAULT_RATES.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any, Optional

from llamaflash.planning.decode_speed import DEFAULT_RATES, MachineRates, offload_token_time, stock_token_seconds

from . import memlimit

NOSPEC = memlimit.NO_SPECULATION_CONFIG


def run_counters(run: dict[str, Any]) -> Optional[dict[str, float]]:
    """Per decoded token, the counters of an ok offload run (None for another run): ``decode_s``,
    ``sparse_s`` (the sparse lane, its I/O wait included), ``io_wait_s``, ``flash_bytes`` (cluster reads
    + a streamed gate), ``other_read_bytes`` (read from disk during the decode beyond those),
    ``hit_rate``, ``active`` (mean active share of neurons), ``check_s_per_byte`` (thread-seconds per
    checked byte), ``gate_bytes``, ``gate_streamed``, ``updown_bytes`` (every neuron's up + down_t
    rows: the plan's slots), ``llama_bytes``, ``n_layers``, and the plan's ``plan_hit_rate``,
    ``plan_flash_bytes``, ``plan_io_bound_tok_s``."""
    fs = run.get("flash_stats") or {}
    off = fs.get("offload")
    if not run.get("ok") or fs.get("mode") != "offload" or not off or not off.get("tokens"):
        return None
    plan = (run.get("ram_budget") or {}).get("plan") or off.get("plan") or {}
    tokens, n_gen = float(off["tokens"]), max(int(run["n_gen_done"]), 1)
    flash = float(off["bytes_read_per_token"]) + float(off.get("gate_bytes_per_token") or 0)
    decode_read = (run.get("read_bytes_phases") or {}).get("decode")
    streamed = bool(off.get("gate_streamed"))
    return {
        "decode_s": run["decode_s"] / n_gen,
        "sparse_s": fs["sparse_seconds"] / tokens,
        "io_wait_s": float(off["io_wait_per_token"]),
        "flash_bytes": flash,
        "other_read_bytes": decode_read / n_gen - flash if decode_read is not None else float("nan"),
        "hit_rate": float(off["hit_rate"]),
        "active": float(fs["mean_active_fraction"]),
        "check_s_per_byte": off["verify_seconds"] / off["verified_bytes"] if off.get("verified_bytes") else 0.0,
        "gate_bytes": float(off["gate_bytes_per_token"] if streamed else fs["resident_ffn_bytes"]),
        "gate_streamed": streamed,
        "updown_bytes": float(plan["total_clusters"] * plan["slot_bytes"]),
        "llama_bytes": float(plan["parts"]["llama_weights"]),
        "n_layers": int(fs["layers_served"]),
        "plan_hit_rate": float(plan["hit_rate"]),
        "plan_flash_bytes": float(plan["flash_bytes_per_token"]),
        "plan_io_bound_tok_s": plan.get("io_bound_tok_s"),
    }


def disk_bytes_per_s(c: dict[str, float]) -> Optional[float]:
    """The disk rate the plan assumed for its reads (its bytes per token x its I/O-bound tok/s)."""
    return c["plan_flash_bytes"] * c["plan_io_bound_tok_s"] if c["plan_io_bound_tok_s"] else None


def predicted_from_counters(c: dict[str, float], rates: MachineRates, active: Optional[float] = None) -> float:
    """decode_speed's tok/s fed with a run's counters: its measured flash bytes (at the plan's disk
    rate), active share, gate placement; ``active`` overrides the measured share."""
    rate = disk_bytes_per_s(c)
    return offload_token_time(
        io_seconds=c["flash_bytes"] / rate if rate else 0.0,
        llama_bytes=c["llama_bytes"],
        n_layers=c["n_layers"],
        gate_bytes=c["gate_bytes"],
        updown_bytes=c["updown_bytes"],
        active_fraction=c["active"] if active is None else active,
        flash_bytes=c["flash_bytes"],
        rates=rates,
    ).tok_s


def predicted_from_plan(c: dict[str, float], rates: MachineRates, active: float) -> float:
    """decode_speed's tok/s from the plan's own numbers (its I/O bound and flash bytes) at the share
    ``active`` the planner expects."""
    io = 1.0 / c["plan_io_bound_tok_s"] if c["plan_io_bound_tok_s"] else 0.0
    return offload_token_time(
        io_seconds=io,
        llama_bytes=c["llama_bytes"],
        n_layers=c["n_layers"],
        gate_bytes=c["gate_bytes"],
        updown_bytes=c["updown_bytes"],
        active_fraction=active,
        flash_bytes=c["plan_flash_bytes"] if io else 0.0,
        rates=rates,
    ).tok_s


def stock_weight_bytes(run: dict[str, Any]) -> Optional[float]:
    """The weights a run reads per token where llamaflash ran stock (its decision's ``model_weights``)."""
    d = ((run.get("flash_stats") or {}).get("decision") or {}).get("detail") or {}
    return float(d["parts"]["model_weights"]) if d.get("lane") == "stock" else None


def fit_rates(payload: dict[str, Any], fit_budget: int, base: MachineRates = DEFAULT_RATES) -> MachineRates:
    """The rates one sweep gives (``base``'s token overhead and thread count kept; docstring of
    decode_speed.DEFAULT_RATES for the derivation): the dense rate from the stock-lane runs at the
    largest budget where llamaflash ran stock (median of stock's and llamaflash's per-token times there),
    the sparse rate, split cost and check rate from the non-speculative offload run at ``fit_budget``."""
    runs = [r for r in payload["runs"] if r.get("ok")]
    stock_budgets = [r["limit_mb"] for r in runs if stock_weight_bytes(r)]
    if not stock_budgets:
        raise ValueError("the sweep has no run where llamaflash ran stock: no dense rate to fit")
    top = max(stock_budgets)
    weights = next(stock_weight_bytes(r) for r in runs if r["limit_mb"] == top and stock_weight_bytes(r))
    per_token = statistics.median(r["decode_s"] / r["n_gen_done"] for r in runs if r["limit_mb"] == top)
    dense = weights / (per_token - base.token_overhead_s)
    fit = [run_counters(r) for r in runs if r["limit_mb"] == fit_budget and r["config"] == NOSPEC]
    c = next((x for x in fit if x is not None), None)
    if c is None:
        raise ValueError(f"the sweep has no non-speculative offload run at {fit_budget} MiB to fit")
    check_wall = c["flash_bytes"] * c["check_s_per_byte"] / base.n_threads
    kernel = c["sparse_s"] - c["io_wait_s"] - c["gate_bytes"] / dense - check_wall
    if kernel <= 0:
        raise ValueError(f"the run at {fit_budget} MiB leaves no time for the sparse kernel: not a fit point")
    llama = base.token_overhead_s + c["llama_bytes"] / dense
    return MachineRates(
        token_overhead_s=base.token_overhead_s,
        dense_bytes_per_s=dense,
        sparse_bytes_per_s=c["active"] * c["updown_bytes"] / kernel,
        split_overhead_s=max(c["decode_s"] - c["sparse_s"] - llama, 0.0) / c["n_layers"],
        check_bytes_per_s=1.0 / c["check_s_per_byte"] if c["check_s_per_byte"] else base.check_bytes_per_s,
        n_threads=base.n_threads,
        source=f"fitted to {payload.get('model', {}).get('name', '?')} sweep: stock at {top} MiB, offload at {fit_budget} MiB",
    )


def fit_token_overhead(inmemory: list[dict[str, Any]]) -> tuple[float, float]:
    """(token overhead s, bytes/s): the least-squares line t = overhead + bytes / rate through the
    stock runs of bench/bench_inmemory.py results (their ``bound.stock``: weight bytes per token and
    the median ms per token), one point per model; at least two models."""
    pts = [(float(p["bound"]["stock"]["bytes_per_token"]), p["bound"]["stock"]["ms_per_token"] / 1e3) for p in inmemory]
    if len({b for b, _ in pts}) < 2:
        raise ValueError("fitting the token overhead needs the in-memory stock runs of at least two models")
    n = len(pts)
    mb, mt = sum(b for b, _ in pts) / n, sum(t for _, t in pts) / n
    slope = sum((b - mb) * (t - mt) for b, t in pts) / sum((b - mb) ** 2 for b, _ in pts)
    return mt - slope * mb, 1.0 / slope


def compare(payload: dict[str, Any], rates: MachineRates) -> list[dict[str, Any]]:
    """Per ok non-speculative offload run and per stock-lane run: measured and predicted tok/s (the
    sweep's recorded prediction, the model's from the plan, the model's from the counters) and the
    counters (:func:`run_counters`)."""
    view = payload.get("predictions") or {}
    active_plan = view.get("active_fraction")
    # where llamaflash ran stock, stock's own runs read the same weights
    stock_lane = {r["limit_mb"]: stock_weight_bytes(r) for r in payload["runs"] if stock_weight_bytes(r)}
    rows = []
    for r in sorted(payload["runs"], key=lambda r: (r["limit_mb"], r["config"])):
        if not r.get("ok") or r.get("decode_tps") is None:
            continue
        recorded = (view.get("budgets") or {}).get(str(r["limit_mb"]), {})
        weights = stock_lane.get(r["limit_mb"]) if r["config"] == "stock" else stock_weight_bytes(r)
        c = run_counters(r) if r["config"] == NOSPEC else None
        if c is None and weights is None:
            continue
        row = {"budget_mb": r["limit_mb"], "config": r["config"], "measured_tok_s": r["decode_tps"]}
        if weights is not None:
            row.update(
                lane="stock", recorded=recorded.get("stock_tok_s"), model=1.0 / stock_token_seconds(weights, rates)
            )
        else:
            row.update(
                lane="offload",
                recorded=recorded.get("nospec_tok_s"),
                model=predicted_from_plan(c, rates, active_plan if active_plan is not None else c["active"]),
                counters_model=predicted_from_counters(c, rates),
                counters=c,
                active_source="plan" if active_plan is not None else "measured (the sweep predates it)",
            )
        rows.append(row)
    return rows


def _pct(measured: float, predicted: Optional[float]) -> str:
    return "-" if not predicted else f"{predicted:6.2f} ({measured / predicted - 1:+.0%})"


def format_rows(rows: list[dict[str, Any]], rates: MachineRates) -> str:
    out = [
        f"rates: {rates.source or 'given'}: overhead {rates.token_overhead_s * 1e3:.1f} ms/token, dense "
        f"{rates.dense_bytes_per_s / 1e9:.1f} GB/s, sparse {rates.sparse_bytes_per_s / 1e9:.2f} GB/s, split "
        f"{rates.split_overhead_s * 1e3:.2f} ms/layer, check {rates.check_bytes_per_s / 1e9:.1f} GB/s/thread",
        "",
        "budget  config             measured  recorded (meas/pred-1)  model from plan   model from counters",
    ]
    for w in rows:
        out.append(
            f"{w['budget_mb']:>6}  {w['config']:<18} {w['measured_tok_s']:7.2f}  {_pct(w['measured_tok_s'], w['recorded']):>22}"
            f"  {_pct(w['measured_tok_s'], w['model']):>16}  {_pct(w['measured_tok_s'], w.get('counters_model')):>16}"
        )
    out.append("")
    out.append(
        "per token (offload, no speculation): hit rate plan/measured; flash MB plan/measured; other disk MB;"
        " active; decode, sparse lane, I/O wait, rest ms"
    )
    for w in rows:
        c = w.get("counters")
        if not c:
            continue
        out.append(
            f"{w['budget_mb']:>6}  hit {c['plan_hit_rate']:.3f}/{c['hit_rate']:.3f}  flash "
            f"{c['plan_flash_bytes'] / 1e6:.1f}/{c['flash_bytes'] / 1e6:.1f}  other {c['other_read_bytes'] / 1e6:.1f}  "
            f"active {c['active']:.3f}  decode {c['decode_s'] * 1e3:.1f}  sparse {c['sparse_s'] * 1e3:.1f}  "
            f"io wait {c['io_wait_s'] * 1e3:.1f}  rest {(c['decode_s'] - c['sparse_s']) * 1e3:.1f}"
        )
    return "\n".join(out)


def load_rates(path: str) -> MachineRates:
    data = json.loads(Path(path).read_text())
    fields = {f.name for f in dataclasses.fields(MachineRates)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{path}: not MachineRates fields: {', '.join(unknown)} (fields: {', '.join(sorted(fields))})")
    return MachineRates(**data)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", help="a sweep's JSON (llamaflash bench MODEL --sweep --json ...)")
    ap.add_argument(
        "--fit-budget", type=int, default=None, help="derive the rates from this sweep (offload run at MiB)"
    )
    ap.add_argument("--rates", default=None, help="a JSON of decode_speed.MachineRates fields (default: built in)")
    ap.add_argument(
        "--inmemory",
        nargs="+",
        default=None,
        help="with --fit-budget: bench_inmemory.py results of two or more models, to fit the token overhead",
    )
    ap.add_argument("--json", default=None, help="write the rates and the comparison here")
    args = ap.parse_args(argv)
    payload = json.loads(Path(args.sweep).read_text())
    try:
        if args.fit_budget is not None:
            base = DEFAULT_RATES
            if args.inmemory:
                overhead, rate = fit_token_overhead([json.loads(Path(p).read_text()) for p in args.inmemory])
                print(f"in-memory stock: {overhead * 1e3:.2f} ms per token + weight bytes at {rate / 1e9:.1f} GB/s")
                base = dataclasses.replace(base, token_overhead_s=overhead)
            rates = fit_rates(payload, args.fit_budget, base)
        elif args.rates:
            rates = load_rates(args.rates)
        else:
            rates = DEFAULT_RATES
    except (ValueError, OSError, TypeError) as e:
        ap.error(str(e))
    rows = compare(payload, rates)
    print(format_rows(rows, rates))
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": dataclasses.asdict(rates), "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
