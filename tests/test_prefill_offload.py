"""Prefill under a RAM budget at a large n_ubatch: the dense lane's token chunks over the streamed
base-file views give the in-memory lane's logits bit for bit, and flash_stats()["offload"]["prefill"]
counts the micro-batches and the bytes they streamed beside the plan's prediction.

Reference: the in-memory sparse lane (its prefill is the same dense lane over resident weights) at the
same n_batch = n_ubatch, batch-invariant as offload runs. The cache is forced (offload_helpers.make_plan)."""

from __future__ import annotations

import numpy as np
from llama_helpers import run_model
from offload_helpers import KW, make_plan

import llamaflash

N_UBATCH = 128
PROMPT = " ".join(["the quick brown fox jumps over a lazy dog and seven cats sleep on warm mats"] * 12)


def test_large_micro_batches_match_in_memory_and_are_counted(converted, forced_plan):
    model, sidecar = converted
    kw = dict(KW, n_ctx=512, n_batch=N_UBATCH, n_ubatch=N_UBATCH)
    ref_llm = llamaflash.Llama(model_path=str(model), flash_mode="sparse", flash_dense_up=False, **kw)
    n_prompt = len(ref_llm.tokenize(PROMPT.encode()))
    assert n_prompt > N_UBATCH + 8  # two micro-batches, the first one chunked (> 64 tokens)
    ref = run_model(ref_llm, prompt=PROMPT, n_gen=4)
    ref_llm.close()

    plan = make_plan(sidecar, hot_per_layer=2)
    plan.n_batch = plan.n_ubatch = N_UBATCH
    plan.prefill = {"stream_bytes": 1000, "passes": 2, "ttft_s": 1.0}
    forced_plan(plan)
    # no speculation: decode rows alone, as the reference decodes them (with speculation a lone row past
    # 256 positions gets a filler row: batch-invariant numerics, not the reference's split-KV attention)
    llm = llamaflash.Llama(model_path=str(model), ram_budget_mb=64, flash_speculative=False, **kw)
    assert llm.flash_mode == "offload"
    llm.reset_flash_stats()
    run = run_model(llm, prompt=PROMPT, n_gen=4)
    assert np.array_equal(run.prompt_logits, ref.prompt_logits)
    assert run.generated == ref.generated

    pre = run.stats["offload"]["prefill"]
    n_layers = len(llm._flash.served_layers)
    micro_batches = -(-n_prompt // N_UBATCH)
    # logits_all: every layer sees every prompt token, so each micro-batch runs every layer densely
    assert pre["dense_splits"] == micro_batches * n_layers
    assert pre["micro_batches"] == micro_batches
    assert pre["stream_bytes"] == micro_batches * 1000
    assert pre["predicted"]["passes"] == 2 and pre["n_ubatch"] == N_UBATCH
    llm.close()
