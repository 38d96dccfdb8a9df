#!/usr/bin/env python
"""Mixture-of-Experts models under memory limits: stock llama-cpp-python vs llamaflash's expert offload.

    python bench/bench_moe.py --model moe.gguf --fractions 0.333 0.5 --reps 2 --json out.json

The model is one that `python -m llamaflash.bench.moe_synth` generated (a real llama.cpp MoE
architecture with random weights: results are SYNTHETIC and labelled so) or any MoE GGUF, with its
expert sidecar (`llamaflash convert MODEL`). Every (rep, limit, config) runs in a fresh process in a
fresh memory cgroup of that limit, the files evicted first (bench/lab/memlimit.py). Configs:
  stock            llama-cpp-python defaults (repacks Q4_K experts into anonymous memory: OOM under
                   a limit smaller than the model)
  stock-norepack   use_extra_bufts=False + flash attention (llama-cli --no-repack): weights stay
                   file-backed; the stock configuration that runs under a limit, and the numerics
                   llamaflash reproduces exactly (its greedy tokens must equal llamaflash's)
  llamaflash-nospec  Llama(ram_budget_mb=limit): experts served from flash through the expert cache
  llamaflash-noprefetch  (with --prefetch-ab) the same with the next-layer prefetch off
                   ($LLAMAFLASH_EXPERT_PREFETCH=0)
  llamaflash-nooverlap   (with --overlap-ab) the same computing a layer's resident experts only
                   after its misses are read ($LLAMAFLASH_EXPERT_OVERLAP=0)
With --prefetch-ab (--overlap-ab) each rep runs stock-norepack and llamaflash-nospec in one harness
call and llamaflash-noprefetch (-nooverlap) in another, the two calls in alternating order from rep
to rep.
Per llamaflash row it adds the expert engine's statistics (hit rate, prefetch recall and waste, MB read
per token, I/O wait per token), the I/O bound (disk bandwidth for expert-sized direct reads over the
model, measured right before each run (--disk-probe-s; this VM's disk varies over the day), divided by
the bytes read per token) and decode as a share of it ("of"), the bound with the compute that cannot
overlap (1 / max(read time, stock-norepack's in-memory step) where the call ran stock-norepack above the
file's size; "of all"), the speed-up over stock-norepack, and the routing statistics recorded in the
sidecar.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401

from llamaflash.bench import memlimit  # noqa: E402

MiB = 1024 * 1024


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="MoE .gguf (its expert sidecar beside it, or --sidecar)")
    p.add_argument("--sidecar", default=None)
    p.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[1 / 3, 1 / 2],
        help="memory limits as fractions of the model file's size",
    )
    p.add_argument("--limits", type=int, nargs="*", default=None, help="memory limits in MiB (instead of fractions)")
    p.add_argument("--configs", default="stock,stock-norepack,llamaflash-nospec")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--n-gen", type=int, default=32)
    p.add_argument("--n-ctx", type=int, default=512)
    p.add_argument("--max-decode-s", type=float, default=60.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quiet-wait", type=float, default=30.0)
    p.add_argument("--label", default="synthetic (random weights)", help="what the model is, for the report")
    p.add_argument(
        "--prefetch-ab",
        action="store_true",
        help="also run llamaflash with the next-layer prefetch off (config llamaflash-noprefetch), alternated",
    )
    p.add_argument(
        "--overlap-ab",
        action="store_true",
        help="also run llamaflash computing resident experts only after the misses are read "
        "(config llamaflash-nooverlap), alternated",
    )
    p.add_argument(
        "--disk-probe-s",
        type=float,
        default=1.5,
        help="before each run, measure expert-sized direct reads over the model for this long: the I/O bound's "
        "rate (0: the saved disk profile's)",
    )
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def disk_mb_s(sidecar: Path, read_bytes: float, depth: int) -> tuple[float, str]:
    """The disk's throughput for reads of ``read_bytes`` at ``depth``: the saved probe of the sidecar's
    filesystem, measured now when there is none."""
    from llamaflash.planning import disk_probe
    from llamaflash.planning.planner import disk_throughput

    profile = disk_probe.saved_profile(sidecar)
    if profile is None:
        profile = disk_probe.resolve_profile("probe", sidecar)
    return disk_throughput(profile, read_bytes, depth) / 1e6, str(profile.get("saved_at", profile.get("source")))


def expert_read_rate(model: str, request_bytes: int, region: tuple[int, int], depth: int, seconds: float) -> dict:
    """The disk's throughput now for the expert lane's reads: random direct reads of one expert
    tensor's slice (rounded up to the alignment) at ``depth`` over the model's expert region
    (offset, bytes). Direct I/O: the page cache is neither used nor disturbed."""
    from llamaflash import _native

    reader = _native.FlashReader(model, "auto", depth, True)
    try:
        a = reader.alignment
        size = (request_bytes + a - 1) // a * a
        m = reader.measure_random_reads(size, depth, seconds, region[0], region[1])
    finally:
        reader.close()
    return {"mb_s": m["bytes"] / m["seconds"] / 1e6, "request_bytes": size, "depth": depth, "seconds": m["seconds"]}


def expert_region(model: Path) -> tuple[int, int, float]:
    """(offset, bytes) spanning every routed expert tensor of ``model``, and one tensor's slice bytes."""
    from llamaflash.files.experts import read_moe_model
    from llamaflash.files.gguf_header import read_gguf_header

    moe = read_moe_model(read_gguf_header(model))
    tensors = [t for layer in moe.layers for t in layer.tensors]
    start = min(t.offset for t in tensors)
    end = max(t.offset + t.expert_bytes * layer.n_expert for layer in moe.layers for t in layer.tensors)
    return start, end - start, moe.layers[0].expert_bytes / len(moe.layers[0].tensors)


def moe_rows(payload: dict, model: Path, sidecar: Path) -> list[dict]:
    """Per (limit, config): decode/prefill medians, the expert statistics and the I/O bound."""
    from llamaflash.bench.decode_report import expert_columns
    from llamaflash.files import expert_sidecar
    from llamaflash.files.experts import read_moe_model
    from llamaflash.files.gguf_header import read_gguf_header
    from llamaflash.planning.expert_plan import EXPERT_READ_DEPTH

    moe = read_moe_model(read_gguf_header(model))
    info = expert_sidecar.read_expert_sidecar(sidecar)
    tensor_bytes = moe.layers[0].expert_bytes / len(moe.layers[0].tensors)
    mb_s, profile = disk_mb_s(sidecar, tensor_bytes, EXPERT_READ_DEPTH)
    # the bound with the compute that cannot overlap: a token takes at least stock-norepack's in-memory
    # step (its runs of this payload at a limit above the file) and its reads at the rate measured
    # before the run
    in_memory = [
        r["decode_tps"]
        for r in payload["runs"]
        if r.get("ok")
        and r["config"] == "stock-norepack"
        and r.get("decode_tps")
        and r["limit_mb"]
        and r["limit_mb"] * MiB >= model.stat().st_size
    ]
    rows = []
    for limit in payload["limits_mb"]:
        by_config = {}
        for config in payload["options"]["configs"]:
            runs = [r for r in payload["runs"] if r["config"] == config and r["limit_mb"] == limit]
            ok = [r for r in runs if r.get("ok")]
            row = {
                "limit_mb": limit,
                "config": config,
                "runs": len(runs),
                "ok": len(ok),
                "status": sorted({r["status"] for r in runs}),
                "decode_tps": median([r["decode_tps"] for r in ok if r.get("decode_tps")]) if ok else None,
                "prefill_tps": median([r["prefill_tps"] for r in ok]) if ok else None,
                "load_s": median([r["load_s"] for r in ok]) if ok else None,
                "cg_peak_mb": median([r["cg_peak_mb"] for r in ok if r.get("cg_peak_mb")]) if ok else None,
                "decode_read_mb_per_tok": median(
                    [r["read_bytes_phases"]["decode"] / max(1, r["n_gen_done"]) / 1e6 for r in ok]
                )
                if ok
                else None,
                "tokens": ok[0].get("tokens") if ok else None,
            }
            rates = [r["disk_before"]["mb_s"] for r in ok if r.get("disk_before")]
            row["disk_mb_s_in_run"] = median(rates) if rates else None
            experts = expert_columns(ok)
            if experts:
                per_tok = experts["bytes_read_per_token"]
                rate = row["disk_mb_s_in_run"] or mb_s
                row["experts"] = experts
                row["io_bound_tps"] = rate * 1e6 / per_tok if per_tok else None
                row["io_bound_tps_profile"] = mb_s * 1e6 / per_tok if per_tok else None
                row["of_io_bound"] = (
                    row["decode_tps"] / row["io_bound_tps"] if row["io_bound_tps"] and row["decode_tps"] else None
                )
            by_config[config] = row
            rows.append(row)
        for row in by_config.values():
            if in_memory and row.get("io_bound_tps") and row.get("decode_tps"):
                row["bound_tps"] = 1.0 / max(1.0 / row["io_bound_tps"], 1.0 / median(in_memory))
                row["of_bound"] = row["decode_tps"] / row["bound_tps"]
        ref = by_config.get("stock-norepack")
        for config, row in by_config.items():
            if ref and ref.get("decode_tps") and row.get("decode_tps"):
                row["x_stock_norepack"] = row["decode_tps"] / ref["decode_tps"]
            if ref and ref.get("tokens") and row.get("tokens") and config != "stock-norepack":
                # over the tokens both decoded (a run stopped by --max-decode-s decodes fewer)
                n = min(len(row["tokens"]), len(ref["tokens"]))
                row["tokens_equal_stock_norepack"] = row["tokens"][:n] == ref["tokens"][:n]
                row["tokens_compared"] = n
    payload["moe"] = {
        "label": payload.get("label"),
        "disk_mb_s": mb_s,  # the saved profile's (bound of rows without an in-run measurement)
        "disk_profile": profile,
        "disk_mb_s_in_run": [r["disk_before"]["mb_s"] for r in payload["runs"] if r.get("disk_before")],
        "read_bytes": tensor_bytes,
        "architecture": moe.architecture,
        "n_layer": len(moe.layers),
        "n_expert": moe.n_expert,
        "n_used": moe.n_used,
        "file_bytes": moe.file_size,
        "expert_bytes": moe.expert_bytes_total,
        "routing": {
            "tokens": info.routing_tokens,
            "source": info.routing_source,
            "reuse_mean": float(sum(s.reuse for s in info.layers) / len(info.layers)),
        },
    }
    return rows


NO_PREFETCH_CONFIG = "llamaflash-noprefetch"
NO_OVERLAP_CONFIG = "llamaflash-nooverlap"


def switch_ab(opts: memlimit.BenchOptions, env: str, off_config: str) -> dict:
    """Per rep: one harness call with ``opts.configs`` (the engine switch ``env`` on) and one with
    llamaflash-nospec under ``env``=0, in alternating order; the runs merged into one payload (the
    second call's config renamed ``off_config``). The model's sha256 is computed once."""
    import dataclasses
    import os

    from llamaflash.bench import benchkit

    sha = {}
    plain_sha = benchkit.sha256_file
    benchkit.sha256_file = lambda path: sha.setdefault(str(path), plain_sha(path))
    payload, runs = None, []
    try:
        for rep in range(opts.reps):
            on = dataclasses.replace(opts, reps=1, configs=opts.configs if rep % 2 == 0 else opts.configs[::-1])
            off = dataclasses.replace(opts, reps=1, configs=[memlimit.NO_SPECULATION_CONFIG])
            for which, o in (("on", on), ("off", off)) if rep % 2 == 0 else (("off", off), ("on", on)):
                os.environ[env] = "1" if which == "on" else "0"
                part = memlimit.run_benchmark(o)
                for r in part["runs"]:
                    r["rep"] = rep
                    if which == "off":
                        r["config"] = off_config
                    runs.append(r)
                payload = payload or part
    finally:
        os.environ.pop(env, None)
        benchkit.sha256_file = plain_sha
    payload["runs"] = runs
    payload["options"]["configs"] = list(opts.configs) + [off_config]
    payload["options"]["reps"] = opts.reps
    payload["switch_ab"] = env
    payload.pop("summary", None)  # per-call summaries; moe_rows summarises the merged runs
    return payload


def format_rows(rows: list[dict]) -> str:
    out = [
        f"{'limit':>6} {'config':<18} {'decode':>7} {'x':>6} {'prefill':>8} {'hit':>5} {'MB/tok':>7} "
        f"{'disk':>6} {'bound':>6} {'of':>5} {'of all':>6} {'recall':>6} {'waste':>6} {'wait/tok':>8} {'same':>5} status"
    ]
    for r in rows:
        e = r.get("experts") or {}

        def f(v, spec):
            return format(v, spec) if v is not None else "-"

        out.append(
            f"{r['limit_mb']!s:>6} {r['config']:<18} {f(r['decode_tps'], '7.2f')} {f(r.get('x_stock_norepack'), '6.2f')} "
            f"{f(r['prefill_tps'], '8.1f')} {f(e.get('hit_rate'), '5.2f')} "
            f"{f((e.get('bytes_read_per_token') or 0) / 1e6 if e else None, '7.1f')} "
            f"{f(r.get('disk_mb_s_in_run'), '6.0f')} {f(r.get('io_bound_tps'), '6.2f')} {f(r.get('of_io_bound'), '5.2f')} "
            f"{f(r.get('of_bound'), '6.2f')} "
            f"{f(e.get('prefetch_recall'), '6.2f')} {f(e.get('prefetch_waste'), '6.2f')} "
            f"{f(e.get('io_wait_per_token_s'), '8.3f')} {str(r.get('tokens_equal_stock_norepack', '-')):>5} "
            f"{','.join(r['status'])}"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    a = parse_args(argv)
    model = Path(a.model).expanduser().resolve()
    sidecar = Path(a.sidecar).expanduser().resolve() if a.sidecar else model.with_name(model.stem + ".flash.gguf")
    size_mib = model.stat().st_size / MiB
    limits = a.limits or [int(size_mib * f) for f in a.fractions]
    opts = memlimit.BenchOptions(
        model=str(model),
        limits_mb=limits,
        configs=a.configs.split(","),
        sidecar=str(sidecar),
        reps=a.reps,
        threads=a.threads,
        n_prompt=a.prompt_tokens,
        n_gen=a.n_gen,
        n_ctx=a.n_ctx,
        n_batch=256,
        max_decode_s=a.max_decode_s,
        timeout_s=a.timeout,
        quiet_wait_s=a.quiet_wait,
    )
    if a.disk_probe_s > 0:
        from llamaflash.planning.expert_plan import EXPERT_READ_DEPTH

        start, span, tensor_bytes = expert_region(model)
        opts.disk_probe = functools.partial(
            expert_read_rate, str(model), int(tensor_bytes), (start, span), EXPERT_READ_DEPTH, a.disk_probe_s
        )
    print(f"model {model} ({size_mib:.0f} MiB, {a.label}); limits {limits} MiB")
    from llamaflash.runtime.expert_runtime import OVERLAP_ENV, PREFETCH_ENV

    if a.prefetch_ab and a.overlap_ab:
        raise SystemExit("--prefetch-ab and --overlap-ab: one switch per run")
    if a.prefetch_ab:
        payload = switch_ab(opts, PREFETCH_ENV, NO_PREFETCH_CONFIG)
    elif a.overlap_ab:
        payload = switch_ab(opts, OVERLAP_ENV, NO_OVERLAP_CONFIG)
    else:
        payload = memlimit.run_benchmark(opts)
    payload["label"] = a.label
    rows = moe_rows(payload, model, sidecar)
    payload["moe_rows"] = rows
    print(format_rows(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(payload, indent=1, default=str))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
