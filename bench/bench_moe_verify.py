#!/usr/bin/env python
"""What a speculative verify pass costs on an MoE model served from flash, against its batch size.

    python bench/bench_moe_verify.py --model moe.gguf --budget-mb 790 --batches 1 2 4 8 --passes 24

A verify pass evaluates 1 + k tokens as one batch: the expert lane reads the union of their experts
once. On a model with random weights acceptance is meaningless (its greedy text repeats), so this
measures what is structural, per batch size: distinct experts per MoE layer (the union), MB read and
seconds per pass, on a context of real text. From those it PREDICTS delivered tokens/s for published
acceptance rates a (expected tokens per pass (1 - a^(k+1)) / (1 - a) divided by the pass time),
labelled as a prediction: for a free draft (prompt lookup) the pass is the verify batch of k + 1
tokens; for the self-draft (cache-conditional routing: draft tokens route among the resident experts,
nothing is read) k measured draft steps come first. The model runs with the expert slots the planner gives `--budget-mb`
(the engine's memory is fixed by its slots; the dense part is anonymous memory, the experts are read
with direct I/O, so no cgroup is needed for the engine's behaviour; no other process should run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

#: Published per-token draft acceptance rates to predict from (prompt lookup on code editing; on chat;
#: a small draft model on chat), as fractions.
ACCEPTANCE = (0.3, 0.5, 0.7)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--budget-mb", type=float, required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 7])
    p.add_argument("--passes", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    from llamaflash import Llama
    from llamaflash.converters import texts

    llm = Llama(
        a.model,
        n_ctx=1024,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        verbose=False,
        ram_budget_mb=a.budget_mb,
        flash_speculative=False,
    )
    if llm.flash_mode != "experts":
        print(f"the model runs {llm.flash_mode!r} at {a.budget_mb} MiB: {llm.flash_stats()['decision']['reason']}")
        return 2
    text = texts.default_calibration(None).text
    context = llm.tokenize(text[:20000].encode())[:256]
    rows = []
    for k in a.batches:
        llm.reset()
        llm.eval(context[:128])
        pos = 128
        llm.reset_flash_stats()
        t0 = time.perf_counter()
        for _ in range(a.passes):
            batch = context[pos : pos + k] if pos + k <= len(context) else context[128 : 128 + k]
            llm.eval(batch)
            pos += k
            if llm.n_tokens + k >= 1000:
                break
        wall = time.perf_counter() - t0
        s = llm.flash_stats()["experts"]
        passes = a.passes
        row = {
            "batch": k,
            "passes": passes,
            "s_per_pass": wall / passes,
            "union_experts_per_layer": s["experts_computed"] / max(1, s["splits"]),
            "mb_read_per_pass": s["bytes_read"] / passes / 1e6,
            "hit_rate": s["hit_rate"],
            "io_wait_per_pass_s": s["io_wait_seconds"] / passes,
        }
        rows.append(row)
        print(
            f"batch {k}: {row['s_per_pass'] * 1e3:7.1f} ms/pass  union {row['union_experts_per_layer']:5.1f} "
            f"experts/layer  {row['mb_read_per_pass']:6.1f} MB/pass  hit {row['hit_rate']:.2f}"
        )
    # the self-draft's step: one token in draft mode (no reads), KV rolled back after each
    llm.reset()
    llm.eval(context[:128])
    llm.reset_flash_stats()
    steps = []
    for i in range(a.passes):
        llm._experts.draft = True
        t0 = time.perf_counter()
        try:
            llm.eval([context[128 + i % 64]])
        finally:
            llm._experts.draft = False
        steps.append(time.perf_counter() - t0)
        llm.n_tokens -= 1
        llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)
    s = llm.flash_stats()["experts"]
    draft_step = float(np.median(steps))
    substituted = s["draft_substituted"] / max(1, s["draft_pairs"])
    print(
        f"self-draft step: {draft_step * 1e3:.1f} ms (median), {substituted:.0%} of routed experts replaced by "
        f"resident ones, {s['bytes_read'] / 1e6:.1f} MB read"
    )
    base = next(r for r in rows if r["batch"] == 1)["s_per_pass"]
    print("PREDICTION (published acceptance rates, not measured on this random-weight model):")
    for r in rows:
        k = r["batch"] - 1
        r["predicted_tok_s"], r["predicted_tok_s_self_draft"] = {}, {}
        for acc in ACCEPTANCE:
            tokens = (1 - acc ** (k + 1)) / (1 - acc)
            r["predicted_tok_s"][acc] = tokens / r["s_per_pass"]
            r["predicted_tok_s_self_draft"][acc] = tokens / (r["s_per_pass"] + k * draft_step)
        print(
            f"  verify batch {r['batch']} (k={k}), free draft: "
            + ", ".join(f"a={acc}: {v:.2f} tok/s ({v * base:.2f}x)" for acc, v in r["predicted_tok_s"].items())
        )
        print(
            f"  {'':>17} self-draft: "
            + ", ".join(
                f"a={acc}: {v:.2f} tok/s ({v * base:.2f}x)" for acc, v in r["predicted_tok_s_self_draft"].items()
            )
        )
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "model": a.model,
                    "budget_mb": a.budget_mb,
                    "label": "synthetic",
                    "rows": rows,
                    "acceptance_assumed": ACCEPTANCE,
                    "self_draft_step_s": draft_step,
                    "self_draft_substituted_share": substituted,
                    "self_draft_bytes_read": s["bytes_read"],
                },
                indent=1,
            )
        )
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
