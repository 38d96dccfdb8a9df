#!/usr/bin/env python
"""A long conversation under a memory limit: does the budget hold while the KV cache grows?

    python bench/bench_moe_long.py --model moe.gguf --limit-mb 8192 --n-ctx 4096 --tokens 2000 \
        --json bench/results/moe-long-8192.json

One `llamaflash.Llama(model, ram_budget_mb=LIMIT, n_ctx=N_CTX)` runs a conversation in a fresh
process inside a fresh memory cgroup of LIMIT MiB (process memory + page cache, as every benchmark
here; bench/lab/cgroups.py), the model and sidecar evicted first. Turns alternate a "user" message
(the next ``--turn-prompt`` tokens of the calibration text) and ``--turn-tokens`` greedy tokens, the
conversation continued in the KV cache (llama-cpp-python's generate reuses the cached prefix), until the context
holds ``--tokens`` tokens. Every turn reports the tokens in the context, prefill and decode tok/s,
the process's resident, anonymous and locked memory (VmRSS, RssAnon, VmLck, VmHWM), the cgroup's
usage (process + page cache) and, for an MoE model, the expert cache's hit rate and reads per token.
The end of a generation (EOS) is not a stop: random-weight models end at random.

What it checks: the process is never OOM-killed; its unreclaimable memory (anonymous + locked) stays
under the limit with the KV cache's growth, and under the plan's total for everything but the page
cache (``flash_stats()["plan"]["parts"]``, which counts the KV cache at the full n_ctx).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401

MiB = 1024 * 1024
MARK = "@@long "


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmLck", "VmHWM"):
                out[key + "_mb"] = int(value.split()[0]) / 1024
    return out


def _cgroup_usage_mb() -> float | None:
    """This process's memory cgroup usage (process + page cache), MiB; None without one."""
    from llamaflash.bench import cgroups

    mount = cgroups._v1_mount("memory")
    if mount is None:
        return None
    usage = cgroups._read_int(mount / cgroups._own_group("memory").lstrip("/") / "memory.usage_in_bytes")
    return None if usage is None else usage / MiB


def worker(opts: argparse.Namespace) -> None:
    """Runs inside the cgroup: the conversation, one JSON line per turn on stdout."""
    from llamaflash import Llama
    from llamaflash.files import assets

    t0 = time.perf_counter()
    llm = Llama(
        opts.model,
        ram_budget_mb=opts.limit_mb,
        n_ctx=opts.n_ctx,
        n_threads=opts.threads,
        seed=0,
        verbose=False,
        flash_speculative=False if opts.no_speculation else None,
    )
    load_s = time.perf_counter() - t0
    stats = llm.flash_stats()
    plan = stats.get("experts") or stats.get("offload", {}).get("plan") or {}
    print(MARK + json.dumps({"event": "loaded", "load_s": load_s, "flash_mode": llm.flash_mode,
                             "plan_parts": plan.get("plan_parts") or plan.get("parts"), "budget_bytes": plan.get("budget_bytes"),
                             **_status(), "cgroup_mb": _cgroup_usage_mb()}), flush=True)  # fmt: skip
    text = assets.held_out_text("calibration", 150_000)  # English and code, not what convert calibrated on
    corpus = llm.tokenize(text.encode(), add_bos=False)
    history = llm.tokenize(b"", add_bos=True)
    cursor, turn = 0, 0
    while len(history) < opts.tokens:
        user = corpus[cursor : cursor + opts.turn_prompt]
        cursor += opts.turn_prompt
        if len(user) < opts.turn_prompt:
            cursor, user = 0, corpus[: opts.turn_prompt]
        tokens = history + user
        before = llm.flash_stats().get("experts") or {}
        t_start = time.perf_counter()
        t_first = None
        out = []
        for token in llm.generate(tokens, top_k=1, temp=0.0):  # reuses the cached prefix
            if t_first is None:
                t_first = time.perf_counter()
            out.append(int(token))
            if len(out) >= opts.turn_tokens:
                break
        t_end = time.perf_counter()
        after = llm.flash_stats().get("experts") or {}
        history = tokens + out
        row = {
            "event": "turn",
            "turn": turn,
            "context_tokens": len(history),
            "kv_tokens": llm.n_tokens,
            "prompt_tokens": len(user),
            "ttft_s": t_first - t_start,
            "decode_tok_s": (len(out) - 1) / (t_end - t_first) if len(out) > 1 else None,
            **_status(),
            "cgroup_mb": _cgroup_usage_mb(),
        }
        for key in ("hits", "experts_needed", "bytes_read", "io_wait_seconds", "tokens"):
            if key in after and key in before:
                row["d_" + key] = after[key] - before[key]
        print(MARK + json.dumps(row), flush=True)
        turn += 1
    final = llm.flash_stats()
    print(MARK + json.dumps({"event": "end", "experts": final.get("experts"), **_status()}, default=str), flush=True)
    llm.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--limit-mb", type=int, required=True)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=2000, help="context tokens the conversation reaches")
    p.add_argument("--turn-prompt", type=int, default=150)
    p.add_argument("--turn-tokens", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-speculation", action="store_true")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--label", default="")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.worker:
        worker(opts)
        return 0
    from llamaflash.bench import cgroups
    from llamaflash.files.sidecar import default_sidecar_path

    model = Path(opts.model)
    files = [model, default_sidecar_path(model)]
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", *(argv if argv is not None else sys.argv[1:])]
    oc = cgroups.run_in_cgroup(argv, opts.limit_mb, timeout=opts.timeout, evict_paths=files, blkio_file=model)
    rows = [json.loads(line[len(MARK) :]) for line in oc.stdout.splitlines() if line.startswith(MARK)]
    turns = [r for r in rows if r["event"] == "turn"]
    loaded = next((r for r in rows if r["event"] == "loaded"), {})
    parts = loaded.get("plan_parts") or {}
    unreclaimable = max((r.get("RssAnon_mb", 0) + r.get("VmLck_mb", 0) for r in turns), default=None)
    payload = {
        "label": opts.label,
        "model": str(model),
        "limit_mb": opts.limit_mb,
        "n_ctx": opts.n_ctx,
        "status": oc.status,
        "returncode": oc.returncode,
        "signal": oc.signal,
        "wall_s": oc.wall_s,
        "cgroup": oc.cgroup,
        "blkio_read_bytes": oc.blkio_read_bytes,
        "notes": oc.notes,
        "plan_total_mb": sum(parts.values()) / MiB if parts else None,
        "plan_kv_cache_mb": parts.get("kv_cache", 0) / MiB if parts else None,
        "max_anon_plus_locked_mb": unreclaimable,
        "rows": rows,
        "stderr_tail": oc.stderr.strip().splitlines()[-20:],
    }
    print(f"status {oc.status}; {len(turns)} turns; context {turns[-1]['context_tokens'] if turns else 0} tokens")
    print("turn ctx  ttft_s  decode  RssAnon VmLck  VmHWM  cgroup  hit-rate MB/token")
    for r in turns:
        hits, needed = r.get("d_hits"), r.get("d_experts_needed")
        rate = hits / needed if hits is not None and needed else None
        per_tok = r["d_bytes_read"] / MiB / r["d_tokens"] if r.get("d_tokens") else None
        print(f"{r['turn']:4d} {r['context_tokens']:5d} {r['ttft_s']:6.1f} {r['decode_tok_s'] or 0:7.2f} "
              f"{r.get('RssAnon_mb', 0):7.0f} {r.get('VmLck_mb', 0):5.0f} {r.get('VmHWM_mb', 0):6.0f} "
              f"{r.get('cgroup_mb') or 0:7.0f}  {rate if rate is not None else float('nan'):.3f}   "
              f"{per_tok if per_tok is not None else float('nan'):.1f}")  # fmt: skip
    if oc.cgroup:
        print(f"cgroup peak {oc.cgroup.get('max_usage_bytes', 0) / MiB:.0f} MiB of {opts.limit_mb}; "
              f"OOM kills {oc.cgroup.get('oom_kill')}; plan total {payload['plan_total_mb']} MiB "
              f"(KV cache {payload['plan_kv_cache_mb']} MiB); max anon+locked {unreclaimable} MiB")  # fmt: skip
    if oc.status != "ok":
        print("\n".join(payload["stderr_tail"]))
    if opts.json:
        Path(opts.json).write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return 0 if oc.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
