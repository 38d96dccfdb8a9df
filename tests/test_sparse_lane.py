"""The sparse decode lane inside llama.cpp (csrc/lanes/sparse_lane.*): routing by batch size and
sidecar, agreement with the dense lane when nothing is skipped, agreement with a reference
(tests/sparse_emulation.py: stock llama.cpp with the skipped neurons zeroed) at a real sparsity
level, statistics, and the Python API (flash_mode / flash_sparsity / set_flash_sparsity) with its
errors."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from llama_helpers import PROMPT, rel_max_diff, run_model
from sparse_emulation import SparseFfnEmulator
from synth import FAST_CONVERT

import llamaflash
from llamaflash.converters import convert
from llamaflash.converters.llama_runner import LlamaRunner
from llamaflash.files.sidecar import read_sidecar

KW = dict(n_ctx=128, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False, seed=0)
N_GEN = 12


@pytest.fixture(scope="module")
def converted(tiny_model_factory, tmp_path_factory):
    """A Q8_0 synthetic llama (SwiGLU) and its format-2 sidecar (levels 0.25 / 0.5 / 0.75, operating
    point 0.5), plus a bundle-only (format 1) sidecar of the same model."""
    src = tiny_model_factory(weight_type="Q8_0", n_embd=96, n_ff=192)
    d = tmp_path_factory.mktemp("sparse-lane")
    model = d / "m.gguf"
    shutil.copy(src, model)
    sidecar = convert(model, progress=False, sparsity=0.5, measure_quality=False, **FAST_CONVERT)
    v1 = convert(model, d / "m.v1.flash.gguf", progress=False, profile=False)
    return model, sidecar, v1


def _decode_logits(llm, n_gen=N_GEN):
    """Prompt in one batch (dense lane), then n_gen greedy single-token steps; the logits of each step."""
    run = run_model(llm, n_gen=n_gen)
    return run, np.array(llm.scores[len(llm.tokenize(PROMPT.encode())) : llm.n_tokens], dtype=np.float32)


def test_sparse_mode_needs_the_sidecars_thresholds(converted):
    model, sidecar, v1 = converted
    assert read_sidecar(sidecar).sparsity.threshold_levels == pytest.approx((0.25, 0.5, 0.75))
    llm = llamaflash.Llama(model_path=str(model), flash_mode="sparse", **KW)
    assert llm.flash_mode == "sparse" and "autotune" not in llm._flash.sparse_config  # the lane is fixed
    assert llm._flash.sparse_config["max_tokens"] == 1  # forced sparse: decode only unless asked
    llm.close()
    with pytest.raises(ValueError, match="format 1.*re-convert"):
        llamaflash.Llama(model_path=str(model), sidecar_path=str(v1), flash_mode="sparse", **KW)


def test_nothing_skipped_matches_dense_lane(converted):
    """flash_sparsity=0 on SwiGLU skips only exact zeros of silu (none): every neuron is computed
    by the kernel. Prefill runs on the dense lane (bit-identical); decode differs from the dense lane
    only by the kernel's numerics (f32 h instead of Q8 h, down_t requantized to Q8_0)."""
    model, _, _ = converted
    dense, dense_steps = _decode_logits(llamaflash.Llama(model_path=str(model), flash_mode="dense", **KW))
    llm = llamaflash.Llama(model_path=str(model), flash_mode="sparse", flash_sparsity=0, **KW)
    sparse, sparse_steps = _decode_logits(llm)
    assert np.array_equal(dense.prompt_logits, sparse.prompt_logits)
    # teacher-forced comparison would need the same tokens: check the first step exactly, then tokens
    assert rel_max_diff(dense_steps[0], sparse_steps[0]) < 2e-2
    assert sparse.generated[:4] == dense.generated[:4]
    st = sparse.stats
    assert st["sparse_lane_calls"] == 2 * N_GEN  # 2 layers × single-token steps
    assert st["dense_lane_calls"] == 2  # the prompt batch
    assert st["sparse_fallbacks"] == 0
    assert st["mean_active_fraction"] == pytest.approx(1.0)


def test_sparse_lane_matches_emulation_at_a_level(converted):
    """At level 0.5 the lane must skip exactly the neurons the reference emulation skips: same
    thresholds; the whole prompt goes through the lane as one batch (every token sparse, as in the
    emulation), logits close (only float/quantization differences) and far closer than to dense."""
    model, sidecar, _ = converted
    info = read_sidecar(sidecar)
    thresholds = {layer.layer: layer.threshold for layer in info.layers}

    llm = llamaflash.Llama(model_path=str(model), flash_mode="sparse", flash_max_sparse_tokens=128, **KW)
    tokens = llm.tokenize(PROMPT.encode())
    llm.reset()
    llm.eval(tokens)
    lane = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    st = llm.flash_stats()
    llm.close()
    assert st["sparse_lane_calls"] == 2 and st["dense_lane_calls"] == 0
    assert 0.3 < st["mean_active_fraction"] < 0.7

    runner = LlamaRunner(model, 128, n_threads=2)
    try:
        hook = SparseFfnEmulator(info.activation, thresholds)
        reference = runner.decode(np.array(tokens), hook).copy()
        stock = runner.decode(np.array(tokens)).copy()
    finally:
        runner.close()
    assert 1.0 - hook.measured_sparsity == pytest.approx(st["mean_active_fraction"], abs=0.02)
    # measured: 0.031 from the emulation, 0.168 from stock (neurons at the threshold may flip,
    # the kernel's h is f32 and its down_t Q8_0)
    assert rel_max_diff(reference, lane) < 5e-2
    assert rel_max_diff(reference, lane) < 0.3 * rel_max_diff(stock, lane)


def test_batches_route_by_max_sparse_tokens(converted):
    model, _, _ = converted
    llm = llamaflash.Llama(model_path=str(model), flash_mode="sparse", flash_max_sparse_tokens=3, **KW)
    tokens = llm.tokenize(PROMPT.encode())
    llm.reset()
    llm.eval(tokens[:3])  # one ubatch of 3 tokens: sparse
    st = llm.flash_stats()
    assert st["sparse_lane_calls"] == 2 and st["dense_lane_calls"] == 0
    llm.eval(tokens[3:10])  # 7 tokens: dense
    st = llm.flash_stats()
    assert st["sparse_lane_calls"] == 2 and st["dense_lane_calls"] == 2
    assert st["tokens"] == 10
    llm.close()


def test_switching_levels_and_errors(converted):
    model, _, v1 = converted
    llm = llamaflash.Llama(model_path=str(model), flash_mode="sparse", flash_sparsity=0.25, **KW)
    fractions = {}
    for level in (0.25, 0.75):
        llm.set_flash_sparsity(level)
        llm.reset_flash_stats()
        run_model(llm, n_gen=6)
        fractions[level] = llm.flash_stats()["mean_active_fraction"]
    assert fractions[0.75] < fractions[0.25]
    with pytest.raises(ValueError, match=r"0\.33.*levels: 0\.25, 0\.5, 0\.75"):
        llm.set_flash_sparsity(0.33)
    llm.close()
    with pytest.raises(ValueError, match="format 1.*re-convert"):
        llamaflash.Llama(model_path=str(model), sidecar_path=str(v1), flash_mode="sparse", **KW)
    with pytest.raises(ValueError, match="flash_max_sparse_tokens"):
        llamaflash.Llama(model_path=str(model), flash_max_sparse_tokens=0, **KW)
    dense = llamaflash.Llama(model_path=str(model), flash_mode="dense", **KW)
    with pytest.raises(ValueError, match="flash_mode='sparse'"):
        dense.set_flash_sparsity(0.5)
    dense.close()


def test_up_by_ggml_matches_kernel_up(converted):
    """u for every neuron from ggml's dense up GEMV (then only down_t rows in the kernel) gives the
    kernel's result up to summation order: same selection, same quantized x."""
    model, _, _ = converted
    out = {}
    for up_by_ggml in (False, True):
        llm = llamaflash.Llama(model_path=str(model), flash_mode="sparse", **KW)
        llm._flash.set_sparse_config(True, max_tokens=1, up_by_ggml=up_by_ggml)
        assert llm._flash.sparse_config["up_by_ggml"] == up_by_ggml
        run, steps = _decode_logits(llm, n_gen=4)
        out[up_by_ggml] = (run, steps, llm.flash_stats()["mean_active_fraction"])
        llm.close()
    assert out[True][0].generated == out[False][0].generated
    assert rel_max_diff(out[False][1], out[True][1]) < 1e-3
    assert out[True][2] == pytest.approx(out[False][2])


def test_hot_order_sidecar_takes_the_gate_from_the_kernel(converted, tmp_path):
    """Bundles in hot-first order (`convert --order hot`) do not line up with the base gate that ggml's
    GEMV computes over: the kernel computes g from the bundles itself and sums by range. Same model,
    same level: the same neurons are selected (up to float rounding at the threshold) and the same
    tokens come out as with the base-order sidecar, whose g comes from ggml and whose sum runs by
    cluster."""
    model, sidecar, _ = converted
    hot = convert(
        model,
        tmp_path / "m.hot.flash.gguf",
        progress=False,
        sparsity=0.5,
        measure_quality=False,
        order="hot",
        **FAST_CONVERT,
    )
    assert read_sidecar(hot).sparsity.bundle_order == "hot"
    out = {}
    for name, path in (("base", sidecar), ("hot", hot)):
        llm = llamaflash.Llama(
            model_path=str(model), sidecar_path=str(path), flash_mode="sparse", flash_sparsity=0.5, **KW
        )
        out[name] = _decode_logits(llm, n_gen=4)
        llm.close()
    (base, base_steps), (hot_run, hot_steps) = out["base"], out["hot"]
    assert hot_run.generated == base.generated
    assert hot_run.stats["sparse_lane_calls"] == 2 * 4 and hot_run.stats["sparse_fallbacks"] == 0
    assert hot_run.stats["mean_active_fraction"] == pytest.approx(base.stats["mean_active_fraction"], abs=0.02)
    assert rel_max_diff(base_steps, hot_steps) < 1e-2
