#!/usr/bin/env python
"""Decode speed of two settings on the same tokens: teacher-forced decode under a memory limit.

    python bench/bench_forced_decode.py --model qwen.gguf --sidecar qwen.flash.gguf --limit-mb 900 \
        --configs plan,32 --reps 3 --prompt-tokens 200 --tokens 192 --json bench/results/forced-decode-900.json

Greedy decoding compares settings on different texts wherever a setting changes the numerics (for
example n_ubatch: flash attention tiles prompt batches of 64 rows or more, so the prompt's logits and
the greedy continuation differ). This benchmark removes the text from the comparison: every run
evaluates the first ``--prompt-tokens`` tokens of a held-out text as its prompt, then the next
``--tokens`` tokens of the same text one at a time (``Llama.eval([token])``, no sampling), so every
configuration computes the same rows.

Each run is a fresh process in a fresh memory cgroup of ``--limit-mb`` (process + page cache,
bench/lab/cgroups.py), the model and sidecar evicted first; configurations alternate within a
repetition and their order reverses every repetition. A configuration is ``plan`` (the planner's
n_ubatch) or an n_ubatch. Per run: prefill time, decode tok/s, the median step from the fifth on,
the flash I/O wait and bytes read per token (``flash_stats()["offload"]``). The summary gives
medians per configuration and each one's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401

MARK = "@@forced "


def worker(opts: argparse.Namespace) -> None:
    """Runs inside the cgroup: one configuration, one JSON line on stdout."""
    from llamaflash import Llama
    from llamaflash.files import assets

    kwargs = dict(n_ctx=opts.n_ctx, n_threads=opts.threads, n_threads_batch=opts.threads, verbose=False,
                  sidecar_path=opts.sidecar, ram_budget_mb=opts.limit_mb)  # fmt: skip
    if opts.worker != "plan":
        kwargs["n_ubatch"] = int(opts.worker)
    t0 = time.perf_counter()
    llm = Llama(opts.model, **kwargs)
    load_s = time.perf_counter() - t0
    text = assets.held_out_text("calibration", 60_000)
    tokens = llm.tokenize(text.encode(), add_bos=False)[: opts.prompt_tokens + opts.tokens]
    prompt, forced = tokens[: opts.prompt_tokens], tokens[opts.prompt_tokens :]
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t0
    before = llm.flash_stats().get("offload", {})
    steps = []
    for token in forced:
        t0 = time.perf_counter()
        llm.eval([token])
        steps.append(time.perf_counter() - t0)
    stats = llm.flash_stats()
    after = stats.get("offload", {})
    n = len(steps)

    def per_token(key: str) -> float | None:
        return (after[key] - before.get(key, 0.0)) / n if key in after else None

    print(MARK + json.dumps({
        "config": opts.worker, "n_ubatch": llm.context_params.n_ubatch,
        "flash_mode": stats.get("mode"), "hot_slots": after.get("hot_slots"), "load_s": load_s,
        "prefill_s": prefill_s, "prefill_tps": len(prompt) / prefill_s, "decode_tps": n / sum(steps),
        "median_step_ms": statistics.median(steps[4:]) * 1e3, "step_ms": [s * 1e3 for s in steps],
        "io_wait_ms_per_token": None if per_token("io_wait_seconds") is None else per_token("io_wait_seconds") * 1e3,
        "bytes_read_per_token": per_token("bytes_read"),
    }), flush=True)  # fmt: skip


def run(opts: argparse.Namespace) -> dict:
    from llamaflash.bench import benchkit, cgroups

    files = [opts.model] + ([opts.sidecar] if opts.sidecar else [])
    runs = []
    for rep in range(opts.reps):
        order = opts.configs if rep % 2 == 0 else opts.configs[::-1]
        for config in order:
            time.sleep(opts.quiet_wait)
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", config] + opts.passthrough
            oc = cgroups.run_in_cgroup(argv, opts.limit_mb, timeout=opts.timeout, evict_paths=files)
            lines = [line[len(MARK) :] for line in oc.stdout.splitlines() if line.startswith(MARK)]
            result = json.loads(lines[-1]) if lines and oc.status == "ok" else {"config": config}
            result.update(rep=rep, status=oc.status, limit_mb=opts.limit_mb)
            if oc.status != "ok":
                result["stderr_tail"] = oc.stderr[-2000:]
            runs.append(result)
            print(f"rep {rep} {config:>6}: {oc.status}"
                  + (f"  decode {result['decode_tps']:.2f} tok/s, step {result['median_step_ms']:.0f} ms, "
                     f"wait {result['io_wait_ms_per_token']:.0f} ms/token, prefill {result['prefill_tps']:.1f} tok/s"
                     if oc.status == "ok" else ""), flush=True)  # fmt: skip
    summary = {}
    for config in opts.configs:
        ok = [r for r in runs if r["config"] == config and r["status"] == "ok"]
        if ok:
            summary[config] = {key: statistics.median(r[key] for r in ok)
                               for key in ("decode_tps", "median_step_ms", "io_wait_ms_per_token", "prefill_tps")}  # fmt: skip
    first = summary.get(opts.configs[0])
    for config, s in summary.items():
        if first:
            s["decode_x_first"] = s["decode_tps"] / first["decode_tps"]
    return {"benchmark": "forced_decode", "machine": benchkit.machine_info(), "model": opts.model,
            "sidecar": opts.sidecar, "limit_mb": opts.limit_mb, "configs": opts.configs, "reps": opts.reps,
            "prompt_tokens": opts.prompt_tokens, "tokens": opts.tokens, "summary": summary, "runs": runs,
            "command": " ".join(sys.argv)}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--sidecar", default=None)
    p.add_argument("--limit-mb", type=int, required=True)
    p.add_argument("--configs", default="plan,32", help="comma-separated: plan (the planner's n_ubatch) or an n_ubatch")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--tokens", type=int, default=192, help="tokens decoded one at a time (teacher-forced)")
    p.add_argument("--n-ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quiet-wait", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    opts.configs = opts.configs.split(",")
    if opts.prompt_tokens + opts.tokens + 1 > opts.n_ctx:
        p.error("--prompt-tokens + --tokens must fit in --n-ctx")
    opts.passthrough = ["--model", opts.model, "--limit-mb", str(opts.limit_mb), "--prompt-tokens",
                        str(opts.prompt_tokens), "--tokens", str(opts.tokens), "--n-ctx", str(opts.n_ctx),
                        "--threads", str(opts.threads)] + (["--sidecar", opts.sidecar] if opts.sidecar else [])  # fmt: skip
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.worker is not None:
        worker(opts)
        return 0
    payload = run(opts)
    for config, s in payload["summary"].items():
        print(f"{config:>6}: decode {s['decode_tps']:.2f} tok/s ({s.get('decode_x_first', 1):.2f}x {opts.configs[0]}), "
              f"step {s['median_step_ms']:.0f} ms, wait {s['io_wait_ms_per_token']:.0f} ms/token, "
              f"prefill {s['prefill_tps']:.1f} tok/s (medians)")  # fmt: skip
    if opts.json:
        Path(opts.json).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
