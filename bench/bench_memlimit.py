#!/usr/bin/env python
"""Benchmark under memory limits: stock llama-cpp-python vs llamaflash.

    python bench/bench_memlimit.py --model qwen2.5-coder-1.5b --limits 1400 1100 900 700 \\
        --configs stock,llamaflash --reps 2 --threads 2 [--json out.json] [--png out.png]

Every (rep, limit, config) runs in a fresh process inside a fresh cgroup v1 memory group of that
limit (the whole process and the page cache it faults in), after the model (and sidecar) were
evicted from the page cache.  A run the OOM killer ends is reported as OOM; a collapsing run stops
decoding after --max-decode-s and reports tok/s over the tokens it finished.  Prints a table of
medians, writes every run to JSON and a PNG of tok/s versus the limit (matplotlib: the optional
extra ``pip install '.[bench]'``).  Without usable memory cgroups it says so and measures without a
limit.  The same harness is ``llamaflash bench MODEL --ram-limit-mb ...``; the code is in
``llamaflash.bench.memlimit``.

Configs: stock; llamaflash (``ram_budget_mb=<limit>``; falls back to the dense lane without a budget
while llamaflash refuses budgets, marked '*' in the table); or a llamaflash flash_mode (dense, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from llamaflash.bench import memlimit  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    d = memlimit.BenchOptions(model="", limits_mb=[])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="qwen2.5-coder-1.5b", help="asset name (llamaflash.files.assets.MODELS) or a .gguf path"
    )
    p.add_argument("--limits", type=int, nargs="+", default=[1400, 1100, 900, 700], help="memory limits in MB")
    p.add_argument(
        "--configs",
        default="stock,llamaflash",
        help="comma-separated: stock, llamaflash (ram_budget_mb = "
        "the limit; speculative), llamaflash-nospec (the same without speculative decoding), llamaflash-copy / "
        "llamaflash-resident (speculative, the self-draft from the sidecar's draft copy / from the "
        "resident clusters only), a flash_mode",
    )
    p.add_argument(
        "--prompt-set",
        default=None,
        choices=["chat", "code", "prose"],
        help="decode the prompt set (llamaflash.bench.prompt_sets) with llm.generate, n_gen tokens or EOS "
        "per prompt, instead of one text prompt token by token",
    )
    p.add_argument("--sidecar", default=None, help="sidecar path (default <stem>.flash.gguf beside the model)")
    p.add_argument("--reps", type=int, default=d.reps)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--prompt-tokens", type=int, default=d.n_prompt)
    p.add_argument("--n-gen", type=int, default=d.n_gen)
    p.add_argument("--n-ctx", type=int, default=d.n_ctx)
    p.add_argument("--n-batch", type=int, default=d.n_batch)
    p.add_argument(
        "--flash-n-ubatch", type=int, default=None, help="llamaflash configs: this n_ubatch instead of the plan's"
    )
    p.add_argument(
        "--max-decode-s",
        type=float,
        default=d.max_decode_s,
        help="stop decoding after this many seconds (tok/s over the tokens done)",
    )
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per run, load included")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=d.quiet_wait_s,
        help="before each run, wait up to this long for the cores to be idle (0: don't)",
    )
    p.add_argument("--no-cgroup", action="store_true", help="run without memory limits (cold page cache only)")
    p.add_argument(
        "--private-copy",
        default=None,
        metavar="DIR",
        help="benchmark copies of the model/sidecar made in DIR (removed afterwards): use it when other "
        "processes may map the same files (their pages cannot be evicted)",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        metavar="JSON",
        help="run nothing: summarize the runs of an earlier JSON again and redraw its table and plot",
    )
    p.add_argument("--json", type=Path, default=None, help="default bench/results/memlimit-<model>-<timestamp>.json")
    p.add_argument("--png", type=Path, default=None, help="default: the JSON path with .png")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        payload = json.loads(args.from_json.read_text())
        payload["summary"] = memlimit.summarize(payload["runs"], payload["options"]["configs"], payload["limits_mb"])
        out = args.json or args.from_json
        memlimit.report(payload, out, args.png or out.with_suffix(".png"))
        return 0
    opts = memlimit.BenchOptions(
        model=args.model,
        limits_mb=args.limits,
        configs=args.configs,
        sidecar=args.sidecar,
        reps=args.reps,
        threads=args.threads,
        n_prompt=args.prompt_tokens,
        n_gen=args.n_gen,
        n_ctx=args.n_ctx,
        n_batch=args.n_batch,
        flash_n_ubatch=args.flash_n_ubatch,
        max_decode_s=args.max_decode_s,
        timeout_s=args.timeout,
        quiet_wait_s=args.quiet_wait,
        use_cgroup=not args.no_cgroup,
        private_copy_dir=args.private_copy,
        prompt_set=args.prompt_set,
    )
    try:
        opts.validate()
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    payload = memlimit.run_benchmark(opts)
    payload["command"] = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    out = args.json or common.RESULTS_DIR / f"memlimit-{payload['model']['name']}-{common.timestamp()}.json"
    memlimit.report(payload, out, args.png or out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
