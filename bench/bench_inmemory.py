#!/usr/bin/env python
"""In-memory benchmark: stock llama-cpp-python vs llamaflash, same run.

    python bench/bench_inmemory.py --model smollm2-135m --reps 3 --n-gen 64 --threads 2 \\
        --prompt-tokens 205 --configs stock,dense [--json out.json]

Every (config, rep) runs in a fresh subprocess (llamaflash/bench/worker.py); the configs alternate
within each rep (stock, dense, stock, dense, ...) so slow drifts of the machine hit all of them.
All configs get the identical prompt token ids (tokenised once, by a separate worker).  The model
file (and sidecar) are read once beforehand so every run starts with them in the page cache.

Configs: "stock" (llama_cpp.Llama), "stock2" (the same again: a check that the ratios come out at
~1.0), anything else is a llamaflash ``flash_mode`` ("dense", ...) and uses the sidecar
``<stem>.flash.gguf`` beside the model (or --sidecar), converted first with
``python -m llamaflash.cli.cli convert`` when missing or with --reconvert (conversion time is reported).

The machine may be shared: before each run the script waits (--quiet-wait) until the cores are
idle, every run measures the share of the cores other processes used while it was timed ("other
load"), and a run above --max-other-load is discarded and repeated (--retry-noisy times; the
discarded attempts stay in the JSON).

Prints a table of medians and ratios versus stock, and writes every run to --json (default
bench/results/<model>-<timestamp>.json).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="smollm2-135m", help="asset name (llamaflash.files.assets.MODELS) or a .gguf path"
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--n-gen", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=205)
    p.add_argument("--n-ctx", type=int, default=512)
    p.add_argument("--n-batch", type=int, default=512)
    p.add_argument("--configs", default="stock,dense", help="comma-separated; 'stock' is the baseline")
    p.add_argument(
        "--sidecar", type=Path, default=None, help="sidecar path (default <stem>.flash.gguf beside the model)"
    )
    p.add_argument("--reconvert", action="store_true", help="convert the sidecar again even if it exists")
    p.add_argument(
        "--json", type=Path, default=None, help="output JSON (default bench/results/<model>-<timestamp>.json)"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=60,
        help="before each run, wait up to this many seconds for the machine to be <=10%% busy (0: don't)",
    )
    p.add_argument(
        "--max-other-load",
        type=float,
        default=0.05,
        help="a run during which other processes used more than this share of the cores is noisy",
    )
    p.add_argument("--retry-noisy", type=int, default=2, help="re-run a noisy run up to this many times")
    p.add_argument("--no-warm-cache", action="store_true", help="don't read the model file before the runs")
    p.add_argument(
        "--ppl-tokens",
        type=int,
        default=1024,
        help="quality: perplexity of every config on this many tokens of held-out text (Shakespeare, "
        "never used for calibration), in windows of --n-ctx scoring their second half; 0: skip",
    )
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not args.configs:
        p.error("--configs is empty")
    if len(set(args.configs)) != len(args.configs):
        p.error("--configs has duplicates")
    if args.prompt_tokens + args.n_gen + 1 > args.n_ctx:
        p.error("--prompt-tokens + --n-gen must fit in --n-ctx")
    if args.prompt_tokens <= 8:
        p.error("--prompt-tokens must be > 8 (the warm-up evaluates 8 of them)")
    return args


def ensure_sidecar(model: Path, sidecar: Path, force: bool = False) -> dict | None:
    """Convert once when the sidecar is missing (or ``force``); returns what was done (or None)."""
    if sidecar.is_file() and not force:
        return None
    cmd = [sys.executable, "-m", "llamaflash.cli.cli", "convert", str(model)]
    if sidecar != common.sidecar_path_for(model):
        cmd += ["-o", str(sidecar)]
    if force:
        cmd.append("--force")
    print(f"converting: {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if proc.returncode != 0 or not sidecar.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-25:])
        raise SystemExit(f"conversion failed (exit {proc.returncode}, {dt:.1f}s), no {sidecar}:\n{tail}")
    print(f"converted in {dt:.1f}s -> {sidecar} ({sidecar.stat().st_size / 1e6:.1f} MB)", flush=True)
    return {"cmd": cmd, "seconds": dt, "sidecar_bytes": sidecar.stat().st_size}


def report_bound(model_path: Path, sidecar: Path | None, runs: list[dict], args, bandwidth: dict) -> dict:
    """Per config: weight bytes per decoded token, the bound they give at the measured bandwidth, how
    close the median decode gets, and the decode time per token split into the llamaflash FFN
    splits and everything else (attention, output, llama.cpp and Python overhead)."""
    import statistics

    from bound import decode_bytes

    from llamaflash.files.sidecar import read_sidecar

    info = read_sidecar(sidecar) if sidecar is not None else None
    bw = bandwidth["bytes_per_second"]
    print(
        f"bound: read bandwidth {bw / 1e9:.1f} GB/s ({args.threads} threads, best of "
        f"{bandwidth['repetitions']}; median {bandwidth['median_bytes_per_second'] / 1e9:.1f}); weight bytes per "
        f"decoded token ÷ bandwidth"
    )
    out = {}
    for config in args.configs:
        ok = [r for r in runs if r.get("ok") and r["config"] == config]
        if not ok:
            continue
        decode_tps = statistics.median(r["decode_tps"] for r in ok)
        fractions = {}
        stats = [r.get("flash_stats") or {} for r in ok]
        for st in stats:
            for layer, f in (st.get("active_fraction") or {}).items():
                if f is not None:
                    fractions.setdefault(int(layer), []).append(f)
        frac = {layer: statistics.median(v) for layer, v in fractions.items()}
        dense_up = any((st.get("sparse_config") or {}).get("up_by_ggml") for st in stats)
        b = decode_bytes(model_path, info, frac or None, dense_up=dense_up)
        per_token = b.sparse if b.sparse is not None else b.stock
        ms = 1e3 / decode_tps
        ffn_ms = (
            statistics.median(st.get("compute_seconds", 0.0) for st in stats) * 1e3 / args.n_gen if any(stats) else None
        )
        # the rest's weights (attention, output, embedding row) at the bandwidth bound; what the rest
        # takes beyond that is compute above the bound plus llama.cpp / Python / sampling overhead
        rest_weights_ms = (b.stock - b.ffn) / bw * 1e3
        row = {
            "bytes_per_token": per_token,
            "dense_up": dense_up,
            "bound_tps": bw / per_token,
            "decode_tps": decode_tps,
            "of_bound": decode_tps / (bw / per_token),
            "ms_per_token": ms,
            "ffn_ms_per_token": ffn_ms,
            "rest_weights_bound_ms": rest_weights_ms,
            "mean_active_fraction": statistics.median(frac.values()) if frac else None,
        }
        out[config] = row
        split = (
            ""
            if ffn_ms is None
            else (
                f"  per token {ms:.1f} ms = FFN splits {ffn_ms:.1f} + rest {ms - ffn_ms:.1f} (its weights at the bound "
                f"{rest_weights_ms:.1f}, overhead {ms - ffn_ms - rest_weights_ms:.1f})"
            )
        )
        print(
            f"  {config:<12} {per_token / 1e6:7.1f} MB/token  bound {row['bound_tps']:6.1f} tok/s  "
            f"decode {decode_tps:6.1f} = {row['of_bound']:.0%} of bound{split}"
        )
    return out


def measure_quality(args, model_path: Path, sidecar: Path, flash_configs: list[str]) -> dict:
    """Perplexity of every config on the same held-out tokens (one worker each)."""
    from llamaflash.converters import texts

    text = texts.default_validation(args.ppl_tokens * 8).text
    tok = common.run_worker(
        {"mode": "tokenize", "model": str(model_path), "config": "tokenize", "prompt_text": text,
         "n_prompt": args.ppl_tokens, "threads": args.threads}, timeout=args.timeout)  # fmt: skip
    out = {}
    for config in args.configs:
        spec = {"mode": "ppl", "model": str(model_path), "config": config, "threads": args.threads,
                "sidecar_path": str(sidecar) if config in flash_configs else None,
                "ppl_tokens": tok["prompt_tokens"], "n_ctx": args.n_ctx}  # fmt: skip
        try:
            out[config] = common.run_worker(spec, timeout=max(args.timeout, 3600))
        except common.WorkerError as e:
            out[config] = {"ok": False, "error": str(e)}
        q = out[config]
        if q.get("ok"):
            print(f"  quality {config:<12} ppl {q['ppl']:.3f} ({q['seconds']:.0f} s)", flush=True)
    return out


def top1_agreement(q: dict, base_q: dict) -> float | None:
    """Share of the scored positions where config ``q`` and the baseline pick the same top-1 token."""
    a, b = q.get("argmax"), (base_q or {}).get("argmax")
    if not a or not b or len(a) != len(b):
        return None
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main(argv=None) -> int:
    args = parse_args(argv)
    model_path, model_name, model_sha = common.resolve_model(args.model)
    flash_configs = [c for c in args.configs if c not in common.STOCK_CONFIGS]
    sidecar = (args.sidecar or common.sidecar_path_for(model_path)).resolve()
    conversion = ensure_sidecar(model_path, sidecar, force=args.reconvert) if flash_configs else None
    if not args.no_warm_cache:
        common.warm_page_cache(model_path)
        if flash_configs:
            common.warm_page_cache(sidecar)

    tok = common.run_worker(
        {"mode": "tokenize", "model": str(model_path), "config": "tokenize",
         "prompt_text": common.PROMPT_TEXT, "n_prompt": args.prompt_tokens, "threads": args.threads},
        timeout=args.timeout,
    )  # fmt: skip
    if not tok.get("ok"):
        raise SystemExit(f"tokenisation failed: {tok.get('error')}\n{tok.get('traceback', '')}")
    prompt_tokens = tok["prompt_tokens"]

    machine = common.machine_info()

    print(f"machine : {machine['cpu']}, {machine['cores_usable']}/{machine['cores_online']} cores, "
          f"{machine['mem_total_mb']} MB, SIMD {','.join(machine['simd']) or '?'}; load avg {machine['loadavg']}")  # fmt: skip
    print(f"software: llama-cpp-python {machine['llama_cpp_python']}, llamaflash {machine['llamaflash']}, "
          f"python {machine['python']}")  # fmt: skip
    print(f"model   : {model_path} (sha256 {model_sha[:12]}, {model_path.stat().st_size / 1e6:.1f} MB)")
    if flash_configs:
        print(f"sidecar : {sidecar} ({sidecar.stat().st_size / 1e6:.1f} MB)")
    print(f"run     : {len(prompt_tokens)} prompt tokens, {args.n_gen} generated, {args.threads} threads, "
          f"n_ctx {args.n_ctx}, {args.reps} reps of {', '.join(args.configs)}", flush=True)  # fmt: skip

    runs = []
    for rep in range(args.reps):
        for config in args.configs:
            spec = {
                "mode": "run", "model": str(model_path), "config": config, "rep": rep,
                "sidecar_path": str(sidecar) if config in flash_configs else None,
                "prompt_tokens": prompt_tokens, "n_gen": args.n_gen, "threads": args.threads,
                "n_ctx": args.n_ctx, "n_batch": args.n_batch,
            }  # fmt: skip
            noisy_attempts = []
            while True:
                busy_before = common.wait_until_quiet(args.quiet_wait) if args.quiet_wait > 0 else None
                try:
                    r = common.run_worker(spec, timeout=args.timeout)
                except common.WorkerError as e:
                    r = {"ok": False, "config": config, "rep": rep, "error": str(e)}
                r["machine_busy_before"] = busy_before
                if not (
                    r.get("ok") and r["foreign_cpu"] > args.max_other_load and len(noisy_attempts) < args.retry_noisy
                ):
                    break
                noisy_attempts.append({k: r[k] for k in ("foreign_cpu", "prefill_tps", "decode_tps")})
                print(f"  rep {rep} {config:<8} other processes used {r['foreign_cpu']:.0%} of the cores: "
                      f"discarded, running it again", flush=True)  # fmt: skip
            r["noisy_attempts"] = noisy_attempts
            runs.append(r)
            if r.get("ok"):
                print(f"  rep {rep} {config:<8} prefill {r['prefill_tps']:8.1f} tok/s  decode {r['decode_tps']:7.1f} tok/s  "
                      f"peak RSS {r['peak_rss_mb']:6.0f} MB  load {r['load_s']:.2f} s  "
                      f"other load {r['foreign_cpu']:.1%}", flush=True)  # fmt: skip
            else:
                print(f"  rep {rep} {config:<8} FAILED: {r.get('error')}", flush=True)

    quality = measure_quality(args, model_path, sidecar, flash_configs) if args.ppl_tokens > 0 else {}

    baseline = "stock" if "stock" in args.configs else args.configs[0]
    rows = common.summarize(runs, args.configs, baseline=baseline)
    for row in rows:
        q = quality.get(row["config"])
        if q and q.get("ok"):
            row["ppl"] = q["ppl"]
            base_q = quality.get(baseline, {})
            row["ppl_delta"] = q["ppl"] / base_q["ppl"] - 1 if base_q.get("ok") else None
            row["top1_agreement"] = top1_agreement(q, base_q)
    print()
    print(common.format_table(rows))
    print(f"medians over reps; x = ratio to {baseline}; greedy agree = fraction of the {args.n_gen + 1} greedy "
          f"tokens equal to {baseline} rep 0 (@ first divergence); other load = max share of the cores other "
          f"processes used during the timed sections; anon MB = RssAnon after generation. Spread (min..max):")  # fmt: skip
    print(common.format_spread(rows))
    if quality:
        print(
            f"quality: perplexity on {args.ppl_tokens} tokens of held-out text (sparse configs: every token "
            f"through the sparse lane); top-1 = share of the scored positions whose most likely next token "
            f"equals {baseline}'s (teacher-forced greedy agreement: unlike the free-running greedy agreement "
            f"above, one near tie does not decide it)"
        )
        for config in args.configs:
            q = quality.get(config, {})
            if not q.get("ok"):
                print(f"  {config:<12} FAILED: {q.get('error')}")
                continue
            base_q = quality.get(baseline, {})
            delta = f"{q['ppl'] / base_q['ppl'] - 1:+.2%}" if base_q.get("ok") else "?"
            frac = (q.get("flash_stats") or {}).get("mean_active_fraction")
            agree = top1_agreement(q, base_q)
            print(
                f"  {config:<12} ppl {q['ppl']:8.3f}  vs {baseline} {delta:>8}  "
                f"top-1 {'?' if agree is None else f'{agree:.1%}'}  "
                f"active neurons {'' if frac is None else f'{frac:.1%}'}  ({q['seconds']:.0f} s)"
            )
    # Measured last: the probe's 1 GiB buffer would raise the peak RSS of every worker started after it
    # (Linux keeps ru_maxrss across fork + exec).
    from llamaflash import _native_testing

    common.wait_until_quiet(args.quiet_wait) if args.quiet_wait > 0 else None
    bandwidth = _native_testing.measure_read_bandwidth(1 << 30, args.threads, 5)
    bound = report_bound(model_path, sidecar if flash_configs else None, runs, args, bandwidth)
    noisy = [r for r in runs if r.get("ok") and r.get("foreign_cpu", 0) > args.max_other_load]
    if noisy:
        print(f"WARNING: {len(noisy)} run(s) shared the CPU with other processes (>{args.max_other_load:.0%} of the "
              f"cores while timed, after {args.retry_noisy} retries; 'other load' column): their numbers are not clean.")  # fmt: skip

    out = args.json or common.RESULTS_DIR / f"{model_name}-{common.timestamp()}.json"
    payload = {
        "benchmark": "inmemory",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine,
        "system_info": tok.get("system_info"),
        **common.files_record(model_path, model_name, model_sha, sidecar if flash_configs else None),
        "conversion": conversion,
        "prompt_tokens": prompt_tokens,
        "summary": rows,
        "quality": quality,
        "bandwidth": bandwidth,
        "bound": bound,
        "runs": runs,
    }
    print(f"wrote {common.write_json(out, payload)}")
    return 0 if all(r.get("ok") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
