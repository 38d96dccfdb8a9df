"""The synthetic test models are real models: stock llama_cpp loads and runs them."""

from __future__ import annotations

import math

import gguf
import pytest
from synth import TinyModelSpec

from llamaflash.files.gguf_model import read_base_model

llama_cpp = pytest.importorskip("llama_cpp")

EXPECTED_FFN_TYPES = {
    "F32": "F32",
    "F16": "F16",
    "Q8_0": "Q8_0",
    "Q4_0": "Q4_0",
    "Q4_1": "Q4_1",
    "Q5_0": "Q5_0",
    "Q4_K": "Q4_K",
    "Q6_K": "Q6_K",
}


def load(path):
    return llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, verbose=False, seed=0)


@pytest.mark.parametrize("weight_type", sorted(EXPECTED_FFN_TYPES))
def test_fixture_models_have_the_requested_ffn_type(tiny_model_factory, weight_type):
    kquant = weight_type.endswith("_K")
    path = tiny_model_factory(weight_type=weight_type, **(dict(n_embd=256, n_ff=512) if kquant else {}))
    info = read_base_model(path)
    for ffn in info.ffn_layers:
        for loc in (ffn.gate, ffn.up, ffn.down):
            assert gguf.GGMLQuantizationType(loc.ggml_type).name == EXPECTED_FFN_TYPES[weight_type]


def test_q4_k_m_mixes_types_like_llama_cpp(tiny_model_factory):
    info = read_base_model(tiny_model_factory(weight_type="Q4_K_M", n_embd=256, n_ff=512))
    names = {gguf.GGMLQuantizationType(f.down.ggml_type).name for f in info.ffn_layers}
    assert names <= {"Q4_K", "Q6_K"} and "Q6_K" in names


@pytest.mark.parametrize("fixture", ["tiny_llama_f32", "tiny_llama_q8_0"])
def test_fixture_models_load_tokenize_and_generate(request, fixture):
    llm = load(request.getfixturevalue(fixture))
    tokens = llm.tokenize(b"the quick brown fox jumps over the lazy dog.")
    assert tokens[0] == 1  # <s>
    pieces = [llm.detokenize([t]) for t in tokens[1:]]
    assert pieces[:4] == [b" the", b" quick", b" brown", b" fox"]
    out = llm("once upon a time", max_tokens=8, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1
    llm.reset()
    llm.eval(tokens)
    # llm.scores is only written with logits_all=True (otherwise it is uninitialised memory):
    # read the last position's logits from llama.cpp itself
    last = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    assert all(math.isfinite(last[i]) for i in range(16))


def test_k_quant_model_generates(tiny_model_factory):
    llm = load(tiny_model_factory(weight_type="Q4_K_M", n_embd=256, n_ff=512))
    assert llm("hello world", max_tokens=4, temperature=0.0)["choices"][0]["text"] is not None


def test_spec_rejects_dims_the_weight_type_cannot_hold():
    with pytest.raises(ValueError, match="multiples of 256"):
        TinyModelSpec(weight_type="Q4_K", n_embd=64)
    with pytest.raises(ValueError, match="multiples of 32"):
        TinyModelSpec(weight_type="Q8_0", n_embd=48)
