"""Full-size synthetic MoE presets written as quantized blocks (llamaflash.bench.moe_direct): the
random blocks follow the law the float generator draws from, the writer's files load and run in
stock llama.cpp, are deterministic, and the full-size presets have the real models' shapes."""

from __future__ import annotations

import hashlib

import gguf
import llama_cpp
import numpy as np
import pytest
from gguf import quants

from llamaflash.bench import moe_direct, moe_layout, moe_synth

#: tiny models in the full-size presets' mixes (Q4_K needs rows of 256 weights)
TINY_DIRECT = {
    "qwen3moe": dict(quant="Q4_K_M", n_embd=256, n_ff_exp=256, n_head=4, n_head_kv=2, head_dim=64, vocab=None),
    "gpt-oss": dict(quant="MXFP4", n_embd=64, n_ff_exp=64, n_head=4, n_head_kv=2, head_dim=16, vocab="llama-spm"),
}


@pytest.mark.parametrize("type_name,n,std", [("Q4_K", 768, 0.0221), ("MXFP4", 2880, 0.0186), ("MXFP4", 64, 0.3)])
def test_random_blocks_follow_the_requested_law(type_name, n, std):
    rng = np.random.default_rng(0)
    zero = np.arange(96) % 3 == 0
    rows = moe_direct.random_blocks(rng, 96, n, type_name, std, zero_rows=zero)
    assert rows.shape == (96, moe_direct.row_bytes(type_name, n))
    ref = quants.dequantize(rows, getattr(gguf.GGMLQuantizationType, type_name))  # gguf-py's decoder
    np.testing.assert_array_equal(ref, moe_direct.dequantize_random(rows, type_name))
    assert not ref[zero].any()
    live = ref[~zero]
    # mean 0 and the requested std: sampling error of 64*n values is far below these tolerances
    assert abs(float(live.mean())) < 0.02 * std
    assert float(live.std()) == pytest.approx(std, rel=0.03)


def test_quantize_rows_is_ggml_quantizer_output():
    x = np.random.default_rng(1).standard_normal((64, 512), dtype=np.float32)
    for t, tol in (("Q4_K", 0.15), ("Q6_K", 0.04), ("Q8_0", 0.01)):
        q = moe_direct.quantize_rows(x, t, n_threads=3)
        assert q.shape == (64, moe_direct.row_bytes(t, 512))
        back = quants.dequantize(q, getattr(gguf.GGMLQuantizationType, t))
        assert float(np.sqrt(np.mean((back - x) ** 2))) < tol  # rms error relative to std 1
        np.testing.assert_array_equal(q, moe_direct.quantize_rows(x, t, n_threads=1))  # threads change nothing


def _direct_spec(arch: str, routing: str = "shaped", **extra) -> moe_synth.MoeSpec:
    sizes = dict(TINY_DIRECT[arch])
    sizes.update(extra)
    return moe_synth.preset_spec("tiny", arch, routing, direct=True, **sizes)


@pytest.mark.parametrize("arch", sorted(TINY_DIRECT))
def test_direct_models_run_in_stock_llama_cpp(tmp_path, arch):
    spec = _direct_spec(arch)
    path = moe_synth.generate(spec, tmp_path / "m.gguf", n_threads=2)
    mix = moe_direct.MIXES[spec.quant]
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == mix.experts
    assert types["blk.0.ffn_down_exps.weight"] == mix.experts
    assert types["blk.0.attn_v.weight"] == mix.attn_v
    assert types["output.weight"] == mix.output
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False, use_extra_bufts=False)
    try:
        tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog.")
        llm.eval(tokens)
        logits = np.asarray(llm.scores[: llm.n_tokens])
        assert np.isfinite(logits).all()
        assert 0.5 < float(logits.std()) < 20.0  # random weights: logits of std about LOGIT_STD (3)
    finally:
        llm.close()
    again = moe_synth.generate(spec, tmp_path / "again.gguf", n_threads=1)
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(again.read_bytes()).digest()


def _file_bytes(spec: moe_synth.MoeSpec, n_vocab: int) -> tuple[int, int]:
    """(expert tensor bytes, all tensor bytes) of a direct spec, from its shapes and mix."""
    mix = moe_direct.MIXES[spec.quant]
    experts = total = 0
    for name, shape in moe_layout.tensor_shapes(moe_layout.ARCHS[spec.arch], spec.dims(n_vocab)):
        t = mix.tensor_type(name, moe_layout.stored_as_f32(name, shape))
        nbytes = int(np.prod(shape[:-1])) * moe_direct.row_bytes(t, shape[-1])
        total += nbytes
        experts += nbytes if name.endswith("_exps.weight") else 0
    return experts, total


def test_full_size_presets_have_the_real_shapes():
    q = moe_synth.preset_spec("qwen3-30b-a3b", routing="shaped")
    assert (q.n_layer, q.n_expert, q.n_expert_used, q.n_embd, q.n_ff_exp) == (48, 128, 8, 2048, 768)
    assert q.direct and q.routing == moe_synth.PRESET_SHAPED["qwen3-30b-a3b"]
    experts, total = _file_bytes(q, 151936)
    assert experts == 48 * 3 * 128 * 768 * 2048 // 256 * 144  # every expert Q4_K
    assert 16.5e9 < total < 18.0e9  # Qwen3-30B-A3B Q4_K_M: about 17-18.5 GB
    g = moe_synth.preset_spec("gpt-oss-20b", routing="uniform")
    assert (g.n_layer, g.n_expert, g.n_expert_used, g.n_embd, g.n_ff_exp) == (24, 32, 4, 2880, 2880)
    experts, total = _file_bytes(g, 151936)
    assert experts == 24 * 3 * 32 * 2880 * 2880 // 32 * 17  # every expert MXFP4
    assert 11.0e9 < total < 12.5e9  # gpt-oss-20b MXFP4: about 12 GB (with the smaller Qwen2 vocabulary)


def test_direct_specs_are_checked():
    with pytest.raises(ValueError, match="not a multiple of Q4_K's block of 256"):
        moe_synth.preset_spec("tiny", "qwen3moe", direct=True, quant="Q4_K_M")  # n_embd 64
    with pytest.raises(ValueError, match="direct writing knows the mixes"):
        moe_synth.preset_spec("tiny", "qwen3moe", direct=True, quant="Q5_0")
    with pytest.raises(ValueError, match="the qwen3-30b-a3b preset is qwen3moe"):
        moe_synth.preset_spec("qwen3-30b-a3b", "llama")
    with pytest.raises(ValueError, match="expert_rms must be >= 0"):
        moe_synth.RoutingShape(structured=True, expert_rms=-0.1)
