"""The dense lane's token chunks: a prompt batch longer than kDenseChunkTokens (64) is computed chunk
by chunk through the lane's scratch, and the logits stay those of stock llama.cpp bit for bit.

Reference: stock llama-cpp-python on the same GGUF, the prompt evaluated as one batch (n_batch =
n_ubatch = the prompt's length), in the same process. Each output element is the same dot product of
the same quantized weight row and quantized token row whichever chunk its token falls in, so the
arrays are asserted equal, not close.
"""

from __future__ import annotations

import shutil

import llama_cpp
import numpy as np
import pytest
from llama_helpers import run_model

import llamaflash
from llamaflash.converters import convert

# (weight_type, n_embd, n_ff)
VARIANTS = [
    ("F16", 64, 160),
    ("Q4_0", 64, 128),
    ("Q4_K_M", 256, 512),
    ("Q6_K", 256, 768),
]
# prompt tokens -> chunks of the FFN split: 150 = 64 + 64 + 22; 130 = 64 + 66 (a rest of 2 joins the
# chunk before it); 520 = 7 x 72 + 16 (at most kDenseMaxChunks = 8 chunks: chunks of ceil(520 / 8)
# rounded up to a multiple of 8)
LENGTHS = [150, 130, 520]


def _prompt(llm, n_tokens: int) -> str:
    words = "the quick brown fox jumps over a lazy dog while seven cats sleep on warm mats".split()
    text, i = "", 0
    while len(llm.tokenize(text.encode())) < n_tokens:
        text += words[i % len(words)] + " "
        i += 1
    return text


@pytest.mark.parametrize("weight_type,n_embd,n_ff", VARIANTS)
@pytest.mark.parametrize("n_tokens", LENGTHS)
def test_chunked_prefill_matches_stock(tiny_model_factory, tmp_path, weight_type, n_embd, n_ff, n_tokens):
    src = tiny_model_factory(weight_type=weight_type, n_embd=n_embd, n_ff=n_ff, n_layer=2)
    model = tmp_path / src.name
    shutil.copy(src, model)
    convert(model, progress=False)
    kwargs = dict(
        n_ctx=1024, n_batch=1024, n_ubatch=1024, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False
    )
    stock_llm = llama_cpp.Llama(model_path=str(model), seed=0, **kwargs)
    prompt = _prompt(stock_llm, n_tokens)
    stock = run_model(stock_llm, prompt=prompt, n_gen=4)
    llm = llamaflash.Llama(model_path=str(model), flash_mode="dense", seed=0, **kwargs)
    flash = run_model(llm, prompt=prompt, n_gen=4)

    assert stock.prompt_logits.shape[0] >= n_tokens
    assert np.array_equal(stock.prompt_logits, flash.prompt_logits)
    assert flash.generated == stock.generated
