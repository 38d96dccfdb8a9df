"""A sweep's measured runs against the planner's decode model (plugin/planning/decode_speed.py), part by part,
and the machine rates (decode_speed.MachineRates) the runs give.

    python -m llamaflash.bench.sweep_rates SWEEP.json [--fit-budget MiB [--inmemory IN.json ...]
        [--read-fit SWEEP.json:MiB ...]] [--rates RATES.json] [--json OUT.json]

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
run at the largest budget where llamaflash runs stock (else the built-in one), the sparse rate,
per-layer split cost and check rate from the non-speculative offload run at B (best one that reads
nothing: every cluster resident, so that the kernel's rate holds no cost of reading); with
``--read-fit SWEEP.json:MiB ...`` (two or more non-speculative offload runs that read, of the same
engine) the reads' CPU side (``read_layer_s``, ``read_bytes_per_s``: least squares over their sparse
lanes' time beyond the I/O wait, the gate GEMV, the kernel and the checks); the other budgets then
test the model. The token
overhead (what a token costs beyond its weight bytes) is DEFAULT_RATES', or with ``--inmemory`` the
intercept of the line through bench/bench_inmemory.py's stock runs of two or more models
(:func:`fit_token_overhead`). Without ``--fit-budget`` the rates are ``--rates`` (a JSON of
MachineRates fields) or decode_speed.DEFAULT_RATES.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any, Optional

import numpy as np

from llamaflash.planning.decode_speed import DEFAULT_RATES, MachineRates, offload_token_time, stock_token_seconds

from . import memlimit

NOSPEC = memlimit.NO_SPECULATION_CONFIG
#: Bytes a run must have checked for its check rate to be fitted (a run that read almost nothing times
#: a few milliseconds of checks).
MIN_CHECKED_BYTES = 1 << 30


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
    n_layers = int(fs["layers_served"])
    clusters = float(off["bytes_read_per_token"])
    # the plan's slots under the current cache model: the cold region holds every unpinned cluster
    resident = plan["hot_slots"] + plan["cold_slots"] >= plan["total_clusters"]
    plan_layers = plan.get("read_layers_per_token", 0.0 if resident else float(n_layers))
    return {
        "decode_s": run["decode_s"] / n_gen,
        "sparse_s": fs["sparse_seconds"] / tokens,
        "io_wait_s": float(off["io_wait_per_token"]),
        "flash_bytes": flash,
        "other_read_bytes": decode_read / n_gen - flash if decode_read is not None else float("nan"),
        "hit_rate": float(off["hit_rate"]),
        "active": float(fs["mean_active_fraction"]),
        "check_s_per_byte": off["verify_seconds"] / off["verified_bytes"] if off.get("verified_bytes") else 0.0,
        "checked_bytes": float(off.get("verified_bytes") or 0),
        "gate_bytes": float(off["gate_bytes_per_token"] if streamed else fs["resident_ffn_bytes"]),
        "gate_streamed": streamed,
        "updown_bytes": float(plan["total_clusters"] * plan["slot_bytes"]),
        "llama_bytes": float(plan["parts"]["llama_weights"]),
        "n_layers": n_layers,
        "cluster_bytes": clusters,
        # served layers that read per token: at most one per cluster read
        "read_layers": min(float(n_layers), clusters / float(off["slot_bytes"])),
        "plan_hit_rate": 1.0 if resident else float(plan["hit_rate"]),
        "plan_flash_bytes": 0.0 if resident else float(plan["flash_bytes_per_token"]),
        "plan_io_bound_tok_s": None if resident else plan.get("io_bound_tok_s"),
        "plan_read_layers": float(plan_layers),
        "plan_recorded_flash_bytes": float(plan["flash_bytes_per_token"]),
        "plan_recorded_io_bound_tok_s": plan.get("io_bound_tok_s"),
    }


def disk_bytes_per_s(c: dict[str, float]) -> Optional[float]:
    """The disk rate the plan assumed for its reads (its recorded bytes per token x I/O-bound tok/s)."""
    tok_s = c["plan_recorded_io_bound_tok_s"]
    return c["plan_recorded_flash_bytes"] * tok_s if tok_s else None


def predicted_from_counters(c: dict[str, float], rates: MachineRates, active: Optional[float] = None) -> float:
    """decode_speed's tok/s fed with a run's counters: its measured flash bytes (at the plan's disk
    rate), active share, gate placement; ``active`` overrides the measured share."""
    return counters_token_time(c, rates, active).tok_s


def counters_token_time(c: dict[str, float], rates: MachineRates, active: Optional[float] = None):
    """decode_speed.OffloadTokenTime of a run's counters (see :func:`predicted_from_counters`)."""
    rate = disk_bytes_per_s(c)
    return offload_token_time(
        io_seconds=c["flash_bytes"] / rate if rate else 0.0,
        llama_bytes=c["llama_bytes"],
        n_layers=c["n_layers"],
        gate_bytes=c["gate_bytes"],
        updown_bytes=c["updown_bytes"],
        active_fraction=c["active"] if active is None else active,
        flash_bytes=c["flash_bytes"],
        read_layers=c["read_layers"],
        cluster_bytes=c["cluster_bytes"],
        rates=rates,
    )


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
        read_layers=c["plan_read_layers"] if io else 0.0,
        cluster_bytes=max(c["plan_flash_bytes"] - (c["gate_bytes"] if c["gate_streamed"] else 0.0), 0.0) if io else 0.0,
        rates=rates,
    ).tok_s


def stock_weight_bytes(run: dict[str, Any]) -> Optional[float]:
    """The weights a run reads per token where llamaflash ran stock (its decision's
    ``weights_read_bytes``; from decisions that predate it, ``model_weights``)."""
    d = ((run.get("flash_stats") or {}).get("decision") or {}).get("detail") or {}
    if d.get("lane") != "stock":
        return None
    return float(d.get("weights_read_bytes") or d["parts"]["model_weights"])


def non_speculative(run: dict[str, Any]) -> bool:
    """The run decoded without speculation: the non-speculative config, or another whose speculation
    was off (``flash_stats()["speculative"]["enabled"]`` false, e.g. off by default where every
    cluster is resident)."""
    spec = (run.get("flash_stats") or {}).get("speculative") or {}
    return run["config"] == NOSPEC or spec.get("enabled") is False


def offload_run(payload: dict[str, Any], budget: int) -> dict[str, float]:
    """The counters of the sweep's non-speculative offload run at ``budget`` (ValueError: none)."""
    runs = [run_counters(r) for r in payload["runs"] if r["limit_mb"] == budget and non_speculative(r)]
    c = next((x for x in runs if x is not None), None)
    if c is None:
        raise ValueError(f"the sweep has no non-speculative offload run at {budget} MiB to fit")
    return c


def fit_overlap_loss(reading: list[dict[str, float]], rates: MachineRates) -> float:
    """decode_speed.MachineRates.overlap_loss from runs that read: least squares of measured seconds per
    token - max(t_io, t_compute) = loss x min(t_io, t_compute) over them (t_io at the disk rate each
    plan assumed, t_compute from the run's counters at ``rates``), clipped to [0, 1]."""
    num = den = 0.0
    for c in reading:  # (a run without the plan's disk rate has t_io 0: it adds nothing)
        t = counters_token_time(c, dataclasses.replace(rates, overlap_loss=0.0))
        short = min(t.io, t.compute)
        num += (c["decode_s"] - max(t.io, t.compute)) * short
        den += short * short
    return min(max(num / den, 0.0), 1.0) if den > 0 else rates.overlap_loss


def lane_beyond_kernel(c: dict[str, float], rates: MachineRates) -> float:
    """Seconds per token of a run's sparse lane beyond its I/O wait, the gate GEMV (at the dense rate),
    the checks of what it read and the kernel (at ``rates``' sparse rate): the reads' CPU side."""
    check_wall = c["flash_bytes"] * c["check_s_per_byte"] / rates.n_threads
    kernel = c["active"] * c["updown_bytes"] / rates.sparse_bytes_per_s
    return c["sparse_s"] - c["io_wait_s"] - c["gate_bytes"] / rates.dense_bytes_per_s - check_wall - kernel


def fit_read_cost(reading: list[dict[str, float]], rates: MachineRates) -> tuple[float, float]:
    """(read_layer_s, read_bytes_per_s): least squares of :func:`lane_beyond_kernel` = read_layers x
    read_layer_s + cluster_bytes / read_bytes_per_s over runs that read (two or more); a negative
    per-byte part is dropped (then the per-layer part alone)."""
    if len(reading) < 2:
        raise ValueError("fitting the reads' CPU side needs two or more offload runs that read")
    a = np.array([[c["read_layers"], c["cluster_bytes"]] for c in reading])
    y = np.array([lane_beyond_kernel(c, rates) for c in reading])
    (per_layer, per_byte), *_ = np.linalg.lstsq(a, y, rcond=None)
    if per_byte <= 0:
        per_layer, per_byte = float(a[:, 0] @ y / (a[:, 0] @ a[:, 0])), 0.0
    return max(float(per_layer), 0.0), (1.0 / per_byte if per_byte > 0 else float("inf"))


def fit_rates(
    payload: dict[str, Any],
    fit_budget: int,
    base: MachineRates = DEFAULT_RATES,
    reading: Optional[list[dict[str, float]]] = None,
) -> MachineRates:
    """The rates one sweep gives (``base``'s token overhead and thread count kept; docstring of
    decode_speed.DEFAULT_RATES for the derivation): the dense rate from the stock-lane runs at the
    largest budget where llamaflash ran stock (median of stock's and llamaflash's per-token times
    there; ``base``'s where none ran stock), the sparse rate, split cost and check rate from the
    non-speculative offload run at ``fit_budget``, and with ``reading`` (:func:`run_counters` of runs
    that read) the reads' CPU side (:func:`fit_read_cost`; else ``base``'s), fitted in turn with the
    sparse rate until both settle (the fit run's own reads are charged at the read cost), and then how
    much of the shorter of reads and compute does not overlap (:func:`fit_overlap_loss`)."""
    runs = [r for r in payload["runs"] if r.get("ok")]
    stock_budgets = [r["limit_mb"] for r in runs if stock_weight_bytes(r)]
    dense, source = base.dense_bytes_per_s, f"dense rate {base.dense_bytes_per_s / 1e9:.1f} GB/s given"
    if stock_budgets:
        top = max(stock_budgets)
        weights = next(stock_weight_bytes(r) for r in runs if r["limit_mb"] == top and stock_weight_bytes(r))
        per_token = statistics.median(r["decode_s"] / r["n_gen_done"] for r in runs if r["limit_mb"] == top)
        dense, source = weights / (per_token - base.token_overhead_s), f"stock at {top} MiB"
    c = offload_run(payload, fit_budget)
    rates = dataclasses.replace(base, dense_bytes_per_s=dense)
    for _ in range(8):  # the kernel's rate and the read cost depend on each other only through the fit run's reads
        reads = c["read_layers"] * rates.read_layer_s + c["cluster_bytes"] / rates.read_bytes_per_s
        kernel = lane_beyond_kernel(c, dataclasses.replace(rates, sparse_bytes_per_s=math.inf)) - reads
        if kernel <= 0:
            raise ValueError(f"the run at {fit_budget} MiB leaves no time for the sparse kernel: not a fit point")
        rates = dataclasses.replace(rates, sparse_bytes_per_s=c["active"] * c["updown_bytes"] / kernel)
        if reading:
            layer_s, bytes_per_s = fit_read_cost(reading, rates)
            rates = dataclasses.replace(rates, read_layer_s=layer_s, read_bytes_per_s=bytes_per_s)
    llama = base.token_overhead_s + c["llama_bytes"] / dense
    rates = dataclasses.replace(
        rates,
        split_overhead_s=max(c["decode_s"] - c["sparse_s"] - llama, 0.0) / c["n_layers"],
        # the check rate from a run that checked enough to time (MIN_CHECKED_BYTES), else base's
        check_bytes_per_s=(
            1.0 / c["check_s_per_byte"] if c["checked_bytes"] >= MIN_CHECKED_BYTES else base.check_bytes_per_s
        ),
        source=f"fitted to {payload.get('model', {}).get('name', '?')} sweep: {source}, offload at {fit_budget} MiB"
        + (f", reads from {len(reading)} runs" if reading else ""),
    )
    if reading:
        rates = dataclasses.replace(rates, overlap_loss=fit_overlap_loss(reading, rates))
    return rates


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
        c = run_counters(r) if non_speculative(r) else None
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
        f"{rates.split_overhead_s * 1e3:.2f} ms/layer, check {rates.check_bytes_per_s / 1e9:.1f} GB/s/thread, reads "
        f"{rates.read_layer_s * 1e3:.2f} ms/layer + {rates.read_bytes_per_s / 1e9:.1f} GB/s, overlap loss "
        f"{rates.overlap_loss:.2f}",
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
        " active; decode, sparse lane, I/O wait, rest ms; sparse lane beyond I/O wait, gate, checks, kernel ms"
        " (the reads' CPU side); plan: the recorded plan's slots under the current cache model"
    )
    for w in rows:
        c = w.get("counters")
        if not c:
            continue
        out.append(
            f"{w['budget_mb']:>6}  hit {c['plan_hit_rate']:.3f}/{c['hit_rate']:.3f}  flash "
            f"{c['plan_flash_bytes'] / 1e6:.1f}/{c['flash_bytes'] / 1e6:.1f}  other {c['other_read_bytes'] / 1e6:.1f}  "
            f"active {c['active']:.3f}  decode {c['decode_s'] * 1e3:.1f}  sparse {c['sparse_s'] * 1e3:.1f}  "
            f"io wait {c['io_wait_s'] * 1e3:.1f}  rest {(c['decode_s'] - c['sparse_s']) * 1e3:.1f}  "
            f"beyond {lane_beyond_kernel(c, rates) * 1e3:.1f} ({c['read_layers']:.1f} layers read)"
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
    ap.add_argument(
        "--read-fit",
        nargs="+",
        default=None,
        metavar="SWEEP.json:MiB",
        help="with --fit-budget: non-speculative offload runs that read (two or more, same engine), to fit the reads' CPU side",
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
            reading = None
            if args.read_fit:
                reading = []
                for spec in args.read_fit:
                    path, _, mib = spec.rpartition(":")
                    if not path or not mib.isdigit():
                        raise ValueError(f"--read-fit {spec}: expected SWEEP.json:MiB")
                    reading.append(offload_run(json.loads(Path(path).read_text()), int(mib)))
            rates = fit_rates(payload, args.fit_budget, base, reading)
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
