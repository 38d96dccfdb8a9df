#!/usr/bin/env python3
"""Self-draft acceptance against memory: the resident-only draft and the draft copy, by RAM budget.

For each budget and draft kind, one fresh worker process decodes a prompt set greedily with
``Llama(model, ram_budget_mb=B, flash_draft_copy=..., flash_speculative=SELF_DRAFT)``: speculation
with the self-draft only (no prompt lookup), a fixed draft length, every draft verified. Reported per
run: the self-draft's acceptance (drafted tokens the model kept), tokens per verify pass, the mean
draft step and verify pass times, the resident share of the clusters the draft needed, the memory the
draft uses (the copy, or the pinned clusters), and the plan's own choice and prediction.

Acceptance depends only on the plan (what is resident) and the draft, not on the disk or a cgroup:
this runs without memory limits (cluster reads are direct I/O either way). Delivered speed under a
real limit, stock in the same run, comes from bench/bench_memlimit.py (configs llamaflash-copy,
llamaflash-resident). Tokens are checked equal across every run (exact speculation).

    .venv/bin/python bench/bench_draft.py --model qwen2.5-coder-1.5b --sidecar S --budgets 1000 1200 1400 \\
        --prompt-set chat --n-gen 48 --out bench/results/draft-acceptance-qwen2.5-chat.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from llamaflash.bench import benchkit, prompt_sets

#: self-draft only, a fixed draft length, no early stop: acceptance is the draft's own
SELF_DRAFT = {"prompt_lookup": False, "adaptive": False, "max_draft": 4, "min_confidence": 0.0}
KINDS = {"resident": False, "copy": True}


def run(
    model: Path,
    sidecar: Path,
    budget: int,
    kind: str,
    prompts: list,
    n_gen: int,
    threads: int,
    n_ctx: int,
    timeout: float,
) -> dict[str, Any]:
    spec = {
        "mode": "generate",
        "model": str(model),
        "config": "llamaflash",
        "sidecar_path": str(sidecar),
        "threads": threads,
        "n_ctx": n_ctx,
        "n_batch": 512,
        "flash_mode": None,
        "ram_budget_mb": budget,
        "flash_speculative": SELF_DRAFT,
        "flash_draft_copy": KINDS[kind],
        "prompts_tokens": prompts,
        "n_gen": n_gen,
    }
    r = benchkit.run_worker(spec, timeout=timeout)
    row: dict[str, Any] = {"budget_mb": budget, "draft": kind, "ok": bool(r.get("ok"))}
    if not r.get("ok"):
        row["error"] = (r.get("error") or "")[:300]
        return row
    s = r["flash_stats"]["speculative"]
    plan = (r.get("ram_budget") or {}).get("plan") or {}
    passes = max(1, s.get("passes", 0))
    row.update(
        tokens=r["tokens"],
        decode_tps=r["decode_tps"],
        n_gen_done=r["n_gen_done"],
        drafted=s.get("drafted"),
        accepted=s.get("accepted"),
        acceptance=s.get("acceptance"),
        tokens_per_pass=s.get("tokens_per_pass"),
        draft_seconds_per_token=(s.get("draft_seconds", 0) / max(1, s.get("draft_tokens_evaluated") or 1)),
        verify_seconds_per_pass=s.get("verify_seconds", 0) / passes,
        draft_resident_fraction=s.get("draft_resident_fraction"),
        draft_copy_mb=s.get("draft_copy_bytes", 0) / 2**20,
        hot_slots_mb=plan.get("parts", {}).get("hot_slots", 0) / 2**20,
        plan_choice=plan.get("draft_choice"),
        flash_mb_per_pass=((r["flash_stats"].get("offload") or {}).get("bytes_read_per_token") or 0) / 1e6,
    )
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--sidecar", required=True, help="a sidecar with a draft copy (llamaflash convert --draft-type)")
    p.add_argument("--budgets", type=int, nargs="+", default=[1000, 1200, 1400])
    p.add_argument("--kinds", default="resident,copy")
    p.add_argument("--prompt-set", default="chat", choices=["chat", "code"])
    p.add_argument("--n-prompts", type=int, default=3, help="the first N prompts of the set")
    p.add_argument("--n-gen", type=int, default=48)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    model, model_name, _ = benchkit.resolve_model(a.model)
    tok = benchkit.run_worker(
        {
            "mode": "tokenize",
            "model": str(model),
            "config": "tokenize",
            "threads": a.threads,
            "chat_prompts": prompt_sets.prompt_set(a.prompt_set)[: a.n_prompts],
        },
        timeout=a.timeout,
    )
    if not tok.get("ok"):
        raise SystemExit(f"tokenisation failed: {tok.get('error')}")
    rows = []
    for budget in a.budgets:
        for kind in a.kinds.split(","):
            row = run(
                model, Path(a.sidecar), budget, kind, tok["prompts_tokens"], a.n_gen, a.threads, a.n_ctx, a.timeout
            )
            rows.append(row)
            if row["ok"]:
                print(
                    f"{budget:>6} MiB {kind:<9} acceptance {row['acceptance']:.3f}  tokens/pass "
                    f"{row['tokens_per_pass']:.2f}  resident {row['draft_resident_fraction'] or 0:.2f}  copy "
                    f"{row['draft_copy_mb']:.0f} MiB  hot {row['hot_slots_mb']:.0f} MiB  draft step "
                    f"{1e3 * row['draft_seconds_per_token']:.0f} ms  pass {1e3 * row['verify_seconds_per_pass']:.0f} "
                    f"ms  {row['decode_tps']:.2f} tok/s (no limit)",
                    flush=True,
                )
            else:
                print(f"{budget:>6} MiB {kind:<9} {row['error']}", flush=True)
    good = [r for r in rows if r["ok"]]
    same = all(r["tokens"] == good[0]["tokens"] for r in good)
    print(f"tokens identical across runs: {same}")
    if a.out:
        benchkit.write_json(
            a.out,
            {
                "model": model_name,
                "sidecar": str(a.sidecar),
                "prompt_set": a.prompt_set,
                "n_prompts": a.n_prompts,
                "n_gen": a.n_gen,
                "settings": SELF_DRAFT,
                "machine": benchkit.machine_info(),
                "tokens_identical": same,
                "rows": rows,
            },
        )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
