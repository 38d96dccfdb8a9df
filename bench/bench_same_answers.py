"""Cost of identical answers: stock, llamaflash's default (repeat-stable) and deterministic=True, side
by side, in memory and under a memory cgroup of a RAM budget.

Each run is a fresh process (stock never imports llamaflash) that loads the model, answers one chat
request (greedy, --gen tokens, end-of-answer tokens suppressed so that every answer is --gen tokens
long) and then the same request again. Recorded: prefill tok/s (prompt tokens / time to the first
token of the first answer), decode tok/s (the first answer's tokens after the first / the time they
took), whether the repeat gave the same text, a hash of the answer (configurations whose numerics differ
answer differently, and speculation accepts more or fewer drafts on each text: compare decode speeds of
such configurations on the same tokens with bench_forced_decode.py), and the speculation's acceptance.
With --previous-python, the configuration
"previous" is llamaflash's default run by another interpreter (a build of an earlier commit installed
in its own virtual environment), to compare the default with the build before it; --previous-configs
default,deterministic adds "previous-deterministic" likewise. Configurations
alternate within each repetition; medians over repetitions; under a budget the model file and the
sidecar are evicted from the page cache before each run and each run gets a fresh cgroup.

    python bench/bench_same_answers.py MODEL [--sidecar S] [--budgets 0,900] [--reps 2] [--prompt-tokens 500]
        [--gen 64] [--n-ctx 2048] [--n-ubatch 0] [--configs stock,default,deterministic]
        [--previous-python /path/to/venv/bin/python] [--previous-configs default,deterministic]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from common import RESULTS_DIR, machine_info, median, timestamp, write_json

from llamaflash.bench.cgroups import MemoryCgroup
from llamaflash.bench.pagecache import evict_files
from llamaflash.files import assets

RUN = textwrap.dedent("""
    import hashlib, json, sys, time
    cfg, model, sidecar, budget, n_prompt, n_gen, n_ctx, n_ubatch = sys.argv[1:9]
    budget, n_prompt, n_gen = int(budget), int(n_prompt), int(n_gen)
    kw = dict(n_ctx=int(n_ctx), n_threads=2, n_threads_batch=2, verbose=False)
    if int(n_ubatch):
        kw.update(n_batch=int(n_ubatch), n_ubatch=int(n_ubatch))
    if cfg == "stock":
        import llama_cpp
        llm = llama_cpp.Llama(model_path=model, **kw)
    else:
        import llamaflash
        if sidecar:
            kw["sidecar_path"] = sidecar
        if budget:
            kw["ram_budget_mb"] = budget
        if "deterministic" in cfg:
            kw["deterministic"] = True
        llm = llamaflash.Llama(model_path=model, **kw)
    text = open(sys.argv[9]).read()
    toks = llm.tokenize(text.encode())[:n_prompt]
    msgs = [{"role": "user", "content": "Continue this text:\\n" + llm.detokenize(toks).decode(errors="ignore")}]
    # every answer --gen tokens long: the end-of-generation and chat end tokens never sampled
    ends = {llm.token_eos()} | {t for s in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")
                                for t in llm.tokenize(s.encode(), add_bos=False, special=True)[-1:]
                                if llm.detokenize([t], special=True).decode(errors="ignore") == s}
    bias = {t: -1e9 for t in ends if t >= 0}

    def ask():
        t0 = time.perf_counter(); first = None; pieces = []; n = 0
        for chunk in llm.create_chat_completion(msgs, max_tokens=n_gen, temperature=0.0, stream=True, logit_bias=bias):
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
          "tokens": n, "repeat_same": a == b, "repeat_ttft_s": ttft2,
          "answer_sha256": hashlib.sha256(a.encode()).hexdigest()[:12],
          "package": None if cfg == "stock" else sys.modules["llamaflash"].__file__,
          "speculative": None if cfg == "stock" else {k: v for k, v in (llm.flash_stats().get("speculative") or {}).items()
                                                     if k in ("acceptance", "passes")}}))
""")


KV_QUALITY = textwrap.dedent("""
    import json, sys
    import numpy as np
    import llamaflash
    model, kv, n_window, n_windows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    llm = llamaflash.Llama(model_path=model, deterministic=True, type_k=kv, type_v=kv, n_ctx=n_window,
                           n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
    toks = llm.tokenize(sys.argv[5].encode())
    nll, n = 0.0, 0
    for w in range(n_windows):
        window = toks[w * n_window : (w + 1) * n_window]
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
        top = logits.max(1)
        logz = np.log(np.exp(logits - top[:, None]).sum(1)) + top
        nll += float((logz - logits[np.arange(len(window) - 1), window[1:]]).sum())
        n += len(window) - 1
    print("RESULT " + json.dumps({"kv_type": kv, "tokens": n, "perplexity": float(np.exp(nll / n))}))
""")


def kv_quality(model, n_window=512, n_windows=2):
    """deterministic=True's perplexity on held-out Shakespeare with an f16 and a q8_0 KV cache (the
    quality cost of the q8_0 default): n_windows windows of n_window tokens, every position scored."""
    text = assets.held_out_text("shakespeare", 4 * n_window * n_windows)
    out = []
    for kv in (1, 8):  # ggml F16, Q8_0
        cmd = [sys.executable, "-c", KV_QUALITY, str(model), str(kv), str(n_window), str(n_windows), text]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        out.append(json.loads(line[-1][7:]) if line else {"kv_type": kv, "error": res.stderr[-1500:]})
        print(json.dumps(out[-1]), flush=True)
    return out


# --previous-configs: the earlier build's configurations, by the name the runs record
PREVIOUS = {"default": "previous", "deterministic": "previous-deterministic"}


def run_one(cfg, model, sidecar, budget, n_prompt, n_gen, n_ctx, n_ubatch, text, previous_python=None):
    python = previous_python if cfg.startswith("previous") else sys.executable
    cmd = [
        python,
        "-c",
        RUN,
        cfg,
        str(model),
        str(sidecar or ""),
        str(budget),
        str(n_prompt),
        str(n_gen),
        str(n_ctx),
        str(n_ubatch),
        text,
    ]
    group = None
    if budget:
        evict_files([model] + ([sidecar] if sidecar else []))
        group = MemoryCgroup.create(budget << 20)
    # deterministic-cli: deterministic=True in the environment `llamaflash run/chat/serve --deterministic`
    # give the process (ggml-cpu's tiled kernel off: batches of up to 63 rows)
    env = dict(os.environ, GGML_CPU_TILED_MM="0") if cfg == "deterministic-cli" else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
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
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument(
        "--n-ubatch", type=int, default=0, help="n_batch = n_ubatch for every config (0: each its own default)"
    )
    p.add_argument(
        "--configs",
        default="stock,default,deterministic",
        help="comma-separated, of stock, default, deterministic, deterministic-cli (with the command line's "
        "GGML_CPU_TILED_MM=0)",
    )
    p.add_argument(
        "--previous-python",
        default=None,
        help="interpreter of a venv with an earlier llamaflash build: adds the config 'previous'",
    )
    p.add_argument(
        "--previous-configs",
        default="default",
        help="with --previous-python: the earlier build's configs, of default ('previous') and deterministic "
        "('previous-deterministic')",
    )
    p.add_argument(
        "--kv-quality",
        action="store_true",
        help="also: deterministic perplexity with an f16 and a q8_0 KV cache (held-out text)",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args()
    text = str(assets.fetch_text("shakespeare"))
    runs = []
    for budget in [int(b) for b in a.budgets.split(",")]:
        previous = [PREVIOUS[c] for c in a.previous_configs.split(",")] if a.previous_python else []
        configs = a.configs.split(",") + previous
        for rep in range(a.reps):
            for cfg in configs if rep % 2 == 0 else configs[::-1]:
                r = run_one(
                    cfg,
                    a.model,
                    a.sidecar,
                    budget,
                    a.prompt_tokens,
                    a.gen,
                    a.n_ctx,
                    a.n_ubatch,
                    text,
                    a.previous_python,
                )
                r["rep"] = rep
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "stderr"}), flush=True)
    summary = []
    for budget in sorted({r["budget"] for r in runs}):
        rows = {}
        for cfg in ("stock", "default", "deterministic", "deterministic-cli", "previous", "previous-deterministic"):
            rs = [r for r in runs if r["budget"] == budget and r["config"] == cfg and r["ok"]]
            if rs:
                rows[cfg] = {
                    "prefill_tok_s": median([r["prefill_tok_s"] for r in rs]),
                    "decode_tok_s": median([r["decode_tok_s"] for r in rs if r["decode_tok_s"]]),
                    "repeat_same": [r["repeat_same"] for r in rs],
                    "runs": len(rs),
                }
        for cfg in ("default", "deterministic", "deterministic-cli"):
            for base in ("stock", "default", "previous" if cfg == "default" else "previous-deterministic"):
                if cfg in rows and base in rows and cfg != base:
                    for k in ("prefill_tok_s", "decode_tok_s"):
                        rows[cfg][f"{k}_x_{base}"] = rows[cfg][k] / rows[base][k]
        summary.append({"budget_mb": budget, "configs": rows})
    quality = kv_quality(a.model) if a.kv_quality else None
    payload = {
        "bench": "same_answers",
        "kv_quality": quality,
        "model": a.model,
        "sidecar": a.sidecar,
        "reps": a.reps,
        "prompt_tokens": a.prompt_tokens,
        "gen": a.gen,
        "n_ctx": a.n_ctx,
        "n_ubatch": a.n_ubatch,
        "previous_python": a.previous_python,
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
