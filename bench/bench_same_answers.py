"""Cost of identical answers: stock, llamaflash's default (repeat-stable) and deterministic=True, side
by side, in memory and under a memory cgroup of a RAM budget.

Each run is a fresh process (stock never imports llamaflash) that loads the model, answers one chat
request (greedy, --gen tokens) and then the same request again. Recorded: prefill tok/s (prompt
tokens / time to the first token of the first answer), decode tok/s (the first answer's tokens after
the first / the time they took), and whether the repeat gave the same text. Configurations
alternate within each repetition; medians over repetitions; under a budget the model file and the
sidecar are evicted from the page cache before each run and each run gets a fresh cgroup.

    python bench/bench_same_answers.py MODEL [--sidecar S] [--budgets 0,900] [--reps 2] [--prompt-tokens 500]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from common import RESULTS_DIR, machine_info, median, timestamp, write_json

from llamaflash.bench.cgroups import MemoryCgroup
from llamaflash.bench.pagecache import evict_files
from llamaflash.files import assets

RUN = textwrap.dedent("""
    import json, sys, time
    cfg, model, sidecar, budget, n_prompt, n_gen = sys.argv[1:7]
    budget, n_prompt, n_gen = int(budget), int(n_prompt), int(n_gen)
    kw = dict(n_ctx=2048, n_threads=2, n_threads_batch=2, verbose=False)
    if cfg == "stock":
        import llama_cpp
        llm = llama_cpp.Llama(model_path=model, **kw)
    else:
        import llamaflash
        if sidecar:
            kw["sidecar_path"] = sidecar
        if budget:
            kw["ram_budget_mb"] = budget
        llm = llamaflash.Llama(model_path=model, deterministic=(cfg == "deterministic"), **kw)
    text = open(sys.argv[7]).read()
    toks = llm.tokenize(text.encode())[:n_prompt]
    msgs = [{"role": "user", "content": "Continue this text:\\n" + llm.detokenize(toks).decode(errors="ignore")}]

    def ask():
        t0 = time.perf_counter(); first = None; pieces = []; n = 0
        for chunk in llm.create_chat_completion(msgs, max_tokens=n_gen, temperature=0.0, stream=True):
            delta = chunk["choices"][0]["delta"].get("content")
            if delta is None:
                continue
            n += 1
            if first is None:
                first = time.perf_counter()
            pieces.append(delta)
        return "".join(pieces), first - t0, time.perf_counter() - first, n

    a, ttft, dt, n = ask()
    b, ttft2, _, _ = ask()
    n_in = len(llm.tokenize(msgs[0]["content"].encode()))
    mode = getattr(llm, "flash_mode", "stock")
    print("RESULT " + json.dumps({"config": cfg, "budget": budget, "mode": mode, "prompt_tokens": n_in,
          "ttft_s": ttft, "prefill_tok_s": n_in / ttft, "decode_tok_s": (n - 1) / dt if n > 1 else None,
          "tokens": n, "repeat_same": a == b, "repeat_ttft_s": ttft2}))
""")


def run_one(cfg, model, sidecar, budget, n_prompt, n_gen, text):
    cmd = [sys.executable, "-c", RUN, cfg, str(model), str(sidecar or ""), str(budget), str(n_prompt), str(n_gen), text]
    group = None
    if budget:
        evict_files([model] + ([sidecar] if sidecar else []))
        group = MemoryCgroup.create(budget << 20)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if group is not None:
        group.add_pid(proc.pid)
    out, err = proc.communicate(timeout=1800)
    oom = group.oom_kills() if group is not None else 0
    if group is not None:
        group.remove()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]) | {"ok": True}
    return {"config": cfg, "budget": budget, "ok": False, "oom_kills": oom, "stderr": err[-2000:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--sidecar", default=None)
    p.add_argument("--budgets", default="0", help="comma-separated MiB; 0 = in memory")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--gen", type=int, default=48)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    text = str(assets.fetch_text("shakespeare"))
    runs = []
    for budget in [int(b) for b in a.budgets.split(",")]:
        configs = ["stock", "default", "deterministic"]
        for rep in range(a.reps):
            for cfg in configs if rep % 2 == 0 else configs[::-1]:
                r = run_one(cfg, a.model, a.sidecar, budget, a.prompt_tokens, a.gen, text)
                r["rep"] = rep
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "stderr"}), flush=True)
    summary = []
    for budget in sorted({r["budget"] for r in runs}):
        rows = {}
        for cfg in ("stock", "default", "deterministic"):
            rs = [r for r in runs if r["budget"] == budget and r["config"] == cfg and r["ok"]]
            if rs:
                rows[cfg] = {
                    "prefill_tok_s": median([r["prefill_tok_s"] for r in rs]),
                    "decode_tok_s": median([r["decode_tok_s"] for r in rs if r["decode_tok_s"]]),
                    "repeat_same": [r["repeat_same"] for r in rs],
                    "runs": len(rs),
                }
        for cfg in ("default", "deterministic"):
            for base in ("stock", "default"):
                if cfg in rows and base in rows and cfg != base:
                    for k in ("prefill_tok_s", "decode_tok_s"):
                        rows[cfg][f"{k}_x_{base}"] = rows[cfg][k] / rows[base][k]
        summary.append({"budget_mb": budget, "configs": rows})
    payload = {
        "bench": "same_answers",
        "model": a.model,
        "sidecar": a.sidecar,
        "reps": a.reps,
        "prompt_tokens": a.prompt_tokens,
        "gen": a.gen,
        "machine": machine_info(),
        "runs": runs,
        "summary": summary,
    }
    out = Path(a.out) if a.out else RESULTS_DIR / f"same-answers-{Path(a.model).stem}-{timestamp()}.json"
    write_json(out, payload)
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
