#!/usr/bin/env python
"""Are llamaflash's logits on a large MoE model bit-identical to stock llama.cpp with plain weights?

    python bench/bench_moe_exact.py --model moe.gguf --stock-limit-mb 8192 \
        --flash 8192:0 --flash 20000:128 --prompt-tokens 700 --decode 16 --json out.json

Every run is one process in a fresh memory cgroup (bench/lab/cgroups.py), the model's files evicted
first. The reference is stock llama-cpp-python with plain weights (``use_extra_bufts=False``, the
numerics llamaflash reproduces) and flash attention, as llamaflash runs it under a budget; stock's
default repacks Q4_K experts (another summation order for 4+ rows) and is not the reference. Each
``--flash BUDGET:SLOTS`` runs ``llamaflash.Llama(ram_budget_mb=BUDGET)`` (SLOTS 0: the planner's
expert slots; else ``flash_expert_slots=SLOTS``, e.g. every expert resident) in a cgroup of BUDGET.

The text: ``--prompt-tokens`` tokens of the calibration corpus, evaluated as one prompt (prefill in
batches of ``--n-batch``, the ubatch too; more tokens than a batch exercises several batches), then ``--decode``
greedy tokens, one at a time. Compared: every prompt position's logits and every decode step's
logits (exact equality of float32 bits), and the greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401

MiB = 1024 * 1024


def _prompt(n_tokens: int, tokenize) -> list[int]:
    from llamaflash.converters import texts

    text = texts.default_calibration().text
    window = texts.calibration_tokens(tokenize, text, n_tokens, n_tokens)[0]
    if window.size < n_tokens:
        raise RuntimeError(f"the calibration text gave {window.size} tokens, fewer than {n_tokens}")
    return [int(t) for t in window[:n_tokens]]


def run_child(a) -> int:
    """One run: write prompt logits, decode logits and tokens to ``a.out`` (npz)."""
    # the same batches for both (ggml-cpu picks kernels by rows per batch, so the split matters)
    kw = dict(n_ctx=a.n_ctx, n_batch=a.n_batch, n_ubatch=a.n_batch, n_threads=a.threads, logits_all=True, verbose=False)
    t0 = time.perf_counter()
    if a.mode == "stock":
        import llama_cpp

        from llamaflash.runtime.speculative import batch_invariant_weights

        with batch_invariant_weights():
            llm = llama_cpp.Llama(a.model, flash_attn=True, **kw)
        stats = None
    else:
        from llamaflash import Llama

        budget, slots = (int(x) for x in a.mode.split(":"))
        extra = {"flash_expert_slots": slots} if slots else {}
        llm = Llama(a.model, ram_budget_mb=budget, flash_speculative=False, **extra, **kw)
    load_s = time.perf_counter() - t0
    prompt = _prompt(a.prompt_tokens, lambda s: np.array(llm.tokenize(s.encode(), add_bos=False, special=False)))
    t1 = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t1
    prompt_logits = np.array(llm.scores[: len(prompt)], dtype=np.float32)
    decode_logits, tokens = [], []
    t2 = time.perf_counter()
    for _ in range(a.decode):
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        tok = int(np.argmax(last))
        tokens.append(tok)
        llm.eval([tok])
        decode_logits.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
    decode_s = time.perf_counter() - t2
    if a.mode != "stock":
        stats = llm.flash_stats()
    np.savez(
        a.out,
        prompt=np.array(prompt),
        prompt_logits=prompt_logits,
        decode_logits=np.array(decode_logits),
        tokens=np.array(tokens),
    )
    info = {
        "load_s": load_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "flash_mode": getattr(llm, "flash_mode", None),
        "experts": (stats or {}).get("experts"),
    }
    Path(a.out + ".json").write_text(json.dumps(info, default=str))
    llm.close()
    return 0


def compare(ref: dict, got: dict) -> dict:
    pl_ref, pl = ref["prompt_logits"], got["prompt_logits"]
    dl_ref, dl = ref["decode_logits"], got["decode_logits"]
    same_prompt = [bool(np.array_equal(pl_ref[i], pl[i])) for i in range(len(pl_ref))]
    n = min(len(dl_ref), len(dl))
    same_decode = [bool(np.array_equal(dl_ref[i], dl[i])) for i in range(n)]
    return {
        "prompt_positions": len(same_prompt),
        "prompt_logits_identical": int(sum(same_prompt)),
        "first_prompt_difference": next((i for i, s in enumerate(same_prompt) if not s), None),
        "prompt_max_abs_diff": float(np.max(np.abs(pl_ref - pl))),
        "decode_steps": n,
        "decode_logits_identical": int(sum(same_decode)),
        "decode_max_abs_diff": float(np.max(np.abs(dl_ref[:n] - dl[:n]))) if n else 0.0,
        "tokens_equal": ref["tokens"].tolist() == got["tokens"].tolist(),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--stock-limit-mb", type=int, default=None, help="cgroup of the stock run (default: none)")
    p.add_argument("--flash", action="append", default=[], help="BUDGET_MB:SLOTS (SLOTS 0: the planner's)")
    p.add_argument("--prompt-tokens", type=int, default=700)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--n-batch", type=int, default=256, help="n_batch = n_ubatch of every run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", default=None)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # child: stock or BUDGET:SLOTS
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.mode:
        return run_child(a)

    from llamaflash.bench.cgroups import run_in_cgroup

    model = str(Path(a.model).resolve())
    files = [model, str(Path(model).with_name(Path(model).stem + ".flash.gguf"))]
    common_args = ["--model", model, "--prompt-tokens", str(a.prompt_tokens), "--decode", str(a.decode)]
    common_args += ["--n-ctx", str(a.n_ctx), "--n-batch", str(a.n_batch), "--threads", str(a.threads)]
    runs = [("stock", a.stock_limit_mb)] + [(f, int(f.split(":")[0])) for f in a.flash]
    results, arrays = [], {}
    with tempfile.TemporaryDirectory(prefix="moe-exact-") as tmp:
        for mode, limit in runs:
            out = os.path.join(tmp, mode.replace(":", "_") + ".npz")
            argv_ = [sys.executable, __file__, *common_args, "--mode", mode, "--out", out]
            print(f"[bench_moe_exact] {mode} in a {limit} MiB cgroup", file=sys.stderr, flush=True)
            r = run_in_cgroup(argv_, limit, timeout=a.timeout, evict_paths=[f for f in files if os.path.exists(f)])
            row = {"mode": mode, "limit_mb": limit, "status": r.status, "wall_s": r.wall_s}
            row["peak_mb"] = ((r.cgroup or {}).get("max_usage_bytes") or 0) / MiB
            if r.status == "ok":
                row.update(json.loads(Path(out + ".json").read_text()))
                with np.load(out) as z:
                    arrays[mode] = {k: z[k] for k in z.files}
            else:
                row["stderr_tail"] = r.stderr.splitlines()[-8:]
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "experts"}), file=sys.stderr, flush=True)
    ref = arrays.get("stock")
    for row in results[1:]:
        if ref is not None and row["mode"] in arrays:
            row["vs_stock"] = compare(ref, arrays[row["mode"]])
    payload = {"model": model, "label": "synthetic (random weights)", "options": vars(a), "runs": results}
    for row in results:
        print(row["mode"], row["status"], json.dumps(row.get("vs_stock")))
    if a.json:
        Path(a.json).write_text(json.dumps(payload, indent=1, default=str))
    return 0 if all(r.get("vs_stock", {}).get("tokens_equal", True) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
