"""Synthetic MoE models of real llama.cpp architectures (llamaflash.bench.moe_synth): stock
llama-cpp-python loads and runs every architecture, files are deterministic, writing is atomic,
bad specs are refused with a clear message."""

from __future__ import annotations

import hashlib
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from llamaflash.bench import moe_layout, moe_synth

ARCHS = ["qwen3moe", "llama", "gpt-oss", "qwen2moe"]
#: gpt-oss and qwen2moe get the 32000-token SentencePiece vocabulary here instead of their default
#: (Qwen2's 151936 tokens, which qwen3moe tests): five times smaller models, same loader paths
TEST_VOCAB = {"gpt-oss": "llama-spm", "qwen2moe": "llama-spm"}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_stock_llama_cpp_runs_each_architecture(tiny_moe_factory, arch):
    path = tiny_moe_factory(arch, "shaped", vocab=TEST_VOCAB.get(arch))
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False, seed=0)
    try:
        meta = llm.metadata
        assert meta["general.architecture"] == moe_layout.ARCHS[arch].name
        assert int(meta[f"{arch}.expert_count"]) == 8
        assert int(meta[f"{arch}.expert_used_count"]) == 2
        tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog.")
        llm.eval(tokens)
        logits = np.asarray(llm.scores[: llm.n_tokens])
        assert logits.shape == (len(tokens), llm.n_vocab())
        assert np.isfinite(logits).all()
        # random weights, logits of standard deviation about moe_weights.LOGIT_STD (3): sane, not flat
        assert 0.5 < float(logits.std()) < 20.0
        out = llm("Once upon a time", max_tokens=8, temperature=0.0)
        assert out["usage"]["completion_tokens"] > 0
    finally:
        llm.close()


def test_same_spec_gives_byte_identical_files(tmp_path):
    spec = moe_synth.preset_spec("tiny", "llama", "shaped")
    a = moe_synth.generate(spec, tmp_path / "a.gguf")
    b = moe_synth.generate(spec, tmp_path / "b.gguf")
    assert _sha256(a) == _sha256(b)
    c = moe_synth.generate(moe_synth.preset_spec("tiny", "llama", "shaped", seed=1), tmp_path / "c.gguf")
    assert _sha256(c) != _sha256(a)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]  # no temporaries left


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"old")

    def broken(src, dst, quant, n_threads):
        Path(dst).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(moe_synth, "_quantize", broken)
    with pytest.raises(KeyboardInterrupt):
        moe_synth.generate(moe_synth.preset_spec("tiny", "llama"), out)
    assert out.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_tensor_layout_of_each_architecture():
    dims = moe_synth.preset_spec("tiny", "gpt-oss").dims(1000)
    names = {n for n, _ in moe_layout.tensor_shapes(moe_layout.ARCHS["gpt-oss"], dims)}
    for t in (
        "attn_sinks.weight",
        "attn_output.bias",
        "ffn_gate_inp.bias",
        "ffn_up_exps.bias",
        "ffn_gate_exps.bias",
        "ffn_down_exps.bias",
        "post_attention_norm.weight",
    ):
        assert f"blk.0.{t}" in names
    shapes = dict(moe_layout.tensor_shapes(moe_layout.ARCHS["qwen3moe"], dims))
    assert shapes["blk.1.ffn_gate_exps.weight"] == (8, 64, 64)
    assert shapes["blk.1.ffn_down_exps.weight"] == (8, 64, 64)
    assert "blk.1.attn_q_norm.weight" in shapes
    q2 = dict(moe_layout.tensor_shapes(moe_layout.ARCHS["qwen2moe"], dims))
    assert q2["blk.0.ffn_gate_inp_shexp.weight"] == (64,)


def test_bench_preset_is_the_benchmark_model():
    spec = moe_synth.preset_spec("bench", routing="shaped")
    assert (spec.arch, spec.n_layer, spec.n_expert, spec.n_expert_used, spec.n_embd, spec.n_ff_exp, spec.quant) == (
        "qwen3moe",
        24,
        64,
        8,
        1024,
        768,
        "Q4_K_M",
    )
    assert spec.routing.structured


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(arch="mamba"), "unknown arch"),
        (dict(n_expert_used=9), "n_expert_used must not exceed n_expert"),
        (dict(quant="Q4_K_M"), "multiples of 256"),
        (dict(n_head_kv=3), "multiple of n_head_kv"),
        (dict(n_layer=0), "n_layer must be positive"),
    ],
)
def test_bad_spec_is_refused_with_the_way_out(change, message):
    with pytest.raises(ValueError, match=message):
        moe_synth.preset_spec("tiny", **{"arch": change.pop("arch", None)}, **change)


def test_cli_refuses_a_missing_output_directory(tmp_path, capsys):
    rc = moe_synth.main(["--arch", "llama", "-o", str(tmp_path / "no" / "such.gguf")])
    assert rc == 1
    assert "does not exist" in capsys.readouterr().err
