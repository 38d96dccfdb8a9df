#!/usr/bin/env python
"""What the expert lane costs beside the compute: decode with every expert resident, in memory.

    python bench/bench_moe_lane.py --model moe.gguf --reps 2 --tokens 96 --json bench/results/moe-lane.json

``stock-norepack`` is llama-cpp-python with plain, file-backed weights and flash attention (the
numerics the expert lane reproduces); ``lane`` is ``llamaflash.Llama(model, ram_budget_mb=BIG,
flash_expert_slots=n_expert)``: the experts served by the expert lane from a cache that holds all of
them (no speculation). Each run is a fresh process without a memory limit: a prompt, ``--tokens``
greedy steps (which bring every expert the text routes to into the cache), then the same steps again
from the end of the prompt, timed one ``eval`` per token. The difference of the median steps is the
lane's own time per token: its graph splits, per-expert matmul nodes, gathers and scatters, cache
bookkeeping and the next layer's router (reads are ~0 in the timed steps: the lane's counters are
reported). Configurations alternate, the order reversed every repetition; medians over repetitions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401

MARK = "@@lane "
PROMPT = b"The history of the city begins in the early middle ages, when a small settlement grew around the bridge."


def worker(opts: argparse.Namespace) -> None:
    common_kwargs = dict(
        n_ctx=512, n_threads=opts.threads, n_threads_batch=opts.threads, flash_attn=True, verbose=False
    )
    if opts.worker == "stock-norepack":
        from llama_cpp import Llama

        from llamaflash.runtime.speculative import batch_invariant_weights

        with batch_invariant_weights():
            llm = Llama(opts.model, **common_kwargs)
    else:
        from llamaflash import Llama
        from llamaflash.runtime import model_plan

        moe = model_plan.identify_model(model_plan.LoadRequest(model_path=opts.model)).moe
        llm = Llama(opts.model, ram_budget_mb=opts.ram_mb, flash_expert_slots=moe.n_expert,
                    flash_speculative=False, **common_kwargs)  # fmt: skip
    prompt = llm.tokenize(PROMPT)
    llm.eval(prompt)

    def decode(n: int) -> list[float]:
        steps = []
        for _ in range(n):
            token = llm.sample(temp=0.0)
            t0 = time.perf_counter()
            llm.eval([token])
            steps.append(time.perf_counter() - t0)
        return steps

    decode(opts.tokens)  # every expert the text routes to comes into the cache
    before = llm.flash_stats().get("experts", {}) if opts.worker == "lane" else {}
    llm.n_tokens = len(prompt)
    steps = decode(opts.tokens)
    after = llm.flash_stats().get("experts", {}) if opts.worker == "lane" else {}
    print(MARK + json.dumps({
        "config": opts.worker, "median_step_ms": statistics.median(steps) * 1e3, "step_ms": [s * 1e3 for s in steps],
        "bytes_read_timed": after.get("bytes_read", 0) - before.get("bytes_read", 0) if after else None,
        "split_seconds_per_token": (after["split_seconds"] - before["split_seconds"]) / len(steps) if after else None,
        "compute_seconds_per_token": (after["compute_seconds"] - before["compute_seconds"]) / len(steps) if after else None,
    }), flush=True)  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an MoE .gguf with its expert sidecar beside it")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ram-mb", type=int, default=200_000, help="the lane's budget: above everything")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.worker is not None:
        worker(opts)
        return 0
    configs, runs = ["stock-norepack", "lane"], []
    for rep in range(opts.reps):
        for config in configs if rep % 2 == 0 else configs[::-1]:
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", config, "--model", opts.model,
                    "--tokens", str(opts.tokens), "--threads", str(opts.threads), "--ram-mb", str(opts.ram_mb)]  # fmt: skip
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            result = json.loads([ln for ln in out.splitlines() if ln.startswith(MARK)][-1][len(MARK) :])
            result["rep"] = rep
            runs.append(result)
            print(f"rep {rep} {config:>14}: median step {result['median_step_ms']:.1f} ms", flush=True)
    summary = {c: statistics.median(r["median_step_ms"] for r in runs if r["config"] == c) for c in configs}
    summary["lane_ms_per_token"] = summary["lane"] - summary["stock-norepack"]
    print(json.dumps(summary))
    if opts.json:
        from llamaflash.bench import benchkit

        payload = {"benchmark": "moe_lane", "machine": benchkit.machine_info(), "model": opts.model,
                   "options": vars(opts), "summary": summary, "runs": runs, "command": " ".join(sys.argv)}  # fmt: skip
        Path(opts.json).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
