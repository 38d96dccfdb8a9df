"""The exact dense lane: llamaflash serving FFN layers from a sidecar gives stock llama.cpp's results.

Reference: stock llama-cpp-python on the same GGUF in the same process. The dense lane runs ggml's
own kernels on the same weight bytes in the same order, so the logits are bit-identical (asserted
equal) and so is greedy generation.
"""

from __future__ import annotations

import shutil
import warnings

import llama_cpp
import numpy as np
import pytest
from llama_helpers import run_model

import llamaflash
from llamaflash.converters import convert

# (weight_type, n_embd, n_ff): K-quants need multiples of 256; the others use dims where they don't fit
VARIANTS = [
    ("F32", 64, 128),
    ("F16", 64, 160),
    ("Q8_0", 96, 160),
    ("Q4_0", 64, 128),
    ("Q4_1", 64, 192),
    ("Q5_0", 96, 128),
    ("Q4_K", 256, 512),
    ("Q4_K_M", 256, 512),
    ("Q6_K", 256, 768),
]


def _model_with_sidecar(tiny_model_factory, tmp_path, weight_type, n_embd, n_ff, n_layer=2):
    src = tiny_model_factory(weight_type=weight_type, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer)
    model = tmp_path / src.name
    shutil.copy(src, model)
    sidecar = convert(model, progress=False)
    return model, sidecar


@pytest.mark.parametrize("weight_type,n_embd,n_ff", VARIANTS)
def test_dense_lane_matches_stock(tiny_model_factory, tmp_path, weight_type, n_embd, n_ff):
    model, sidecar = _model_with_sidecar(tiny_model_factory, tmp_path, weight_type, n_embd, n_ff)
    kwargs = dict(n_ctx=128, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False, seed=0)
    stock = run_model(llama_cpp.Llama(model_path=str(model), **kwargs))
    llm = llamaflash.Llama(model_path=str(model), flash_mode="dense", **kwargs)
    assert llm.flash_mode == "dense"
    flash = run_model(llm)

    assert np.array_equal(stock.prompt_logits, flash.prompt_logits)
    assert flash.generated == stock.generated
    n_prompt = stock.prompt_logits.shape[0]
    assert flash.stats["layers_served"] == 2
    assert flash.stats["tokens"] == n_prompt + 16  # the prompt batch, then 16 single-token steps
    assert flash.stats["ffn_evals"] == 2 * 17
    assert flash.stats["sidecar"] == str(sidecar)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_dense_lane_thread_counts_and_batches(tiny_model_factory, tmp_path, n_threads):
    model, _ = _model_with_sidecar(tiny_model_factory, tmp_path, "Q8_0", 96, 160)
    # n_batch 8 splits the prompt into several ubatches: batched (prefill) and single-token paths
    kwargs = dict(
        n_ctx=128, n_batch=8, n_ubatch=8, n_threads=n_threads, n_threads_batch=n_threads, logits_all=True, verbose=False
    )
    stock = run_model(llama_cpp.Llama(model_path=str(model), **kwargs))
    flash = run_model(llamaflash.Llama(model_path=str(model), flash_mode="dense", **kwargs))
    assert np.array_equal(stock.prompt_logits, flash.prompt_logits)
    assert flash.generated == stock.generated


def test_two_models_in_one_process(tiny_model_factory, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model_a, _ = _model_with_sidecar(tiny_model_factory, tmp_path / "a", "Q8_0", 96, 160)
    model_b, _ = _model_with_sidecar(tiny_model_factory, tmp_path / "b", "F16", 64, 160)
    kwargs = dict(n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    a = llamaflash.Llama(model_path=str(model_a), flash_mode="dense", **kwargs)
    b = llamaflash.Llama(model_path=str(model_b), flash_mode="dense", **kwargs)
    ra, rb = run_model(a), run_model(b)
    sa = run_model(llama_cpp.Llama(model_path=str(model_a), **kwargs))
    sb = run_model(llama_cpp.Llama(model_path=str(model_b), **kwargs))
    assert np.array_equal(sa.prompt_logits, ra.prompt_logits)
    assert np.array_equal(sb.prompt_logits, rb.prompt_logits)
    a.close()
    # b keeps working after a is freed
    assert run_model(b).generated == sb.generated


def test_no_sidecar_runs_stock_and_says_so_once(tiny_model_factory, tmp_path, monkeypatch):
    src = tiny_model_factory(weight_type="F32")
    model = tmp_path / src.name
    shutil.copy(src, model)
    monkeypatch.setattr("llamaflash.runtime.notices._warned_no_sidecar", False)
    kwargs = dict(n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = llamaflash.Llama(model_path=str(model), **kwargs)
        llamaflash.Llama(model_path=str(model), **kwargs)
    said = [w for w in caught if issubclass(w.category, llamaflash.LlamaflashWarning)]
    assert len(said) == 1 and "without acceleration" in str(said[0].message)
    assert llm.flash_mode == "stock"
    run = run_model(llm)
    stock = run_model(llama_cpp.Llama(model_path=str(model), **kwargs))
    assert run.generated == stock.generated
    assert llm.flash_stats()["layers_served"] == 0


def test_llama_api_keeps_working(tiny_model_factory, tmp_path):
    """Completion, streaming, chat, tokenize, save/load state through llamaflash.Llama."""
    model, _ = _model_with_sidecar(tiny_model_factory, tmp_path, "Q8_0", 96, 160)
    llm = llamaflash.Llama(model_path=str(model), flash_mode="dense", n_ctx=256, n_threads=2, verbose=False, seed=0)
    stock = llama_cpp.Llama(model_path=str(model), n_ctx=256, n_threads=2, verbose=False, seed=0)

    out = llm("the cat sat on", max_tokens=8, temperature=0.0)
    ref = stock("the cat sat on", max_tokens=8, temperature=0.0)
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]

    pieces = [c["choices"][0]["text"] for c in llm("the cat sat on", max_tokens=8, temperature=0.0, stream=True)]
    assert "".join(pieces) == ref["choices"][0]["text"]

    chat = llm.create_chat_completion(
        messages=[{"role": "user", "content": "hello world"}], max_tokens=4, temperature=0.0
    )
    assert chat["choices"][0]["message"]["role"] == "assistant"

    assert llm.tokenize(b"hello world") == stock.tokenize(b"hello world")

    llm.reset()
    llm.eval(llm.tokenize(b"once upon a time"))
    state = llm.save_state()
    first = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    llm.eval([first, first])
    llm.load_state(state)
    assert int(np.argmax(llm.scores[llm.n_tokens - 1])) == first
    assert llm.flash_stats()["ffn_evals"] > 0
