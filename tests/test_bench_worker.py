"""The benchmark worker's quality mode (llamaflash/bench/worker.py `_ppl`) against a direct NumPy
computation on the same llama.cpp logits: perplexity over the second half of each window and the
teacher-forced top-1 tokens the in-memory bench compares between configs."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from llamaflash.bench import worker as bench_worker

N_CTX = 32


def _reference(model, tokens):
    llm = llama_cpp.Llama(
        model_path=str(model), n_ctx=N_CTX, n_batch=N_CTX, n_threads=1, logits_all=True, verbose=False, seed=0
    )
    nll, n, top1 = 0.0, 0, []
    for start in range(0, len(tokens) - N_CTX + 1, N_CTX):
        window = tokens[start : start + N_CTX]
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(window)
        logits = np.array(llm.scores[:N_CTX], dtype=np.float64)[N_CTX // 2 : -1]
        targets = window[N_CTX // 2 + 1 :]
        for row, t in zip(logits, targets):
            lse = row.max() + np.log(np.exp(row - row.max()).sum())
            nll += lse - row[t]
            top1.append(int(np.argmax(row)))
            n += 1
    llm.close()
    return float(np.exp(nll / n)), top1


def test_ppl_mode_reports_perplexity_and_top1_per_scored_position(tiny_llama_q8_0):
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(3, 200, size=2 * N_CTX + 5)]  # 2 windows; the tail is not scored
    out = bench_worker._ppl(
        {
            "mode": "ppl",
            "model": str(tiny_llama_q8_0),
            "config": "stock",
            "threads": 1,
            "ppl_tokens": tokens,
            "n_ctx": N_CTX,
        }
    )
    ppl, top1 = _reference(tiny_llama_q8_0, tokens)
    assert out["ok"] and out["scored_tokens"] == 2 * (N_CTX // 2 - 1) == len(out["argmax"])
    assert out["ppl"] == pytest.approx(ppl, rel=1e-9)
    assert out["argmax"] == top1
