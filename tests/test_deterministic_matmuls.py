"""deterministic=True: the K-quant matmuls computed by llamaflash, every row as alone
(plugin/runtime/matmul_rows.py, csrc/backend/matmul_rows.h).

Reference: stock llama.cpp with plain weights, flash attention and the same q8_0 KV cache evaluating
one token per call (ggml-cpu's vec_dot for every K-quant output), compared bit for bit at every
position. With every K-quant matmul computed so, deterministic batches take up to 63 rows in this
process, whose ggml-cpu keeps its tiled kernel (stock's own 63-row batches then differ: shown).
Models: tiny synthetic Q4_K_M GGUFs (Q4_K and Q6_K weights), a dense llama and a qwen3moe.
"""

from __future__ import annotations

import shutil

import llama_cpp
import llama_cpp.llama_cpp as raw
import numpy as np
import pytest

import llamaflash
from llamaflash import _native
from llamaflash.files.gguf_header import read_gguf_header
from llamaflash.runtime import eval_shapes
from llamaflash.runtime.matmul_rows import taken_weights
from llamaflash.runtime.speculative import batch_invariant_weights

KW = dict(n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False, logits_all=True, seed=0)
Q4_K, Q6_K, Q8_0 = 12, 14, 8


@pytest.fixture(scope="module")
def dense_model(tiny_model_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "m.gguf"
    shutil.copy(tiny_model_factory(weight_type="Q4_K_M", n_embd=256, n_ff=512), path)
    return path


@pytest.fixture(scope="module", params=["qwen3moe", "qwen2moe"])
def moe_model(request, tiny_moe_factory, tmp_path_factory):
    """A tiny MoE with its expert sidecar: qwen3moe (routed experts only) and qwen2moe (a shared
    expert, ffn_*_shexp, beside them)."""
    from llamaflash.converters.pipeline import convert

    path = tmp_path_factory.mktemp("rows-moe") / f"{request.param}.gguf"
    spec = dict(n_embd=256, head_dim=64, n_ff_exp=256, n_ff_shexp=256, quant="Q4_K_M", direct=True)
    shutil.copyfile(tiny_moe_factory(request.param, **spec), path)
    convert(path, force=True, progress=False, profile=False)
    return path


def _prompt(llm, n_words: int = 70):
    return llm.tokenize(" ".join(f"w{i}" for i in range(n_words)).encode())


def _stock_scores(path, ids, **batches):
    """Stock with plain weights, flash attention, a q8_0 KV cache; one token per call unless batches."""
    with batch_invariant_weights():
        s = llama_cpp.Llama(str(path), flash_attn=True, type_k=8, type_v=8, **{**KW, **batches})
    if batches:
        s.eval(ids)
    else:
        for t in ids:
            s.eval([t])
    scores = np.array(s.scores[: len(ids)])
    s.close()
    return scores


def _ours(path, n_batch=None, **kw):
    batches = {} if n_batch is None else dict(n_batch=n_batch, n_ubatch=n_batch)
    llm = llamaflash.Llama(str(path), deterministic=True, **KW, **batches, **kw)
    ids = _prompt(llm)
    llm.eval(ids)
    for _ in range(4):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    ids = list(llm.input_ids[: llm.n_tokens])
    scores = np.array(llm.scores[: llm.n_tokens])
    stats = llm.flash_stats()["numerics"]
    sizes = sorted({s.size for s in llm._kv_history.segments})
    llm.close()
    return ids, scores, stats, sizes


def test_which_weights_are_taken():
    take = _native.invariant_matmul_weight
    assert take("blk.0.attn_q.weight", Q4_K, [256, 256])
    assert take("blk.3.ffn_down.weight", Q6_K, [512, 256])
    assert take("output.weight", Q6_K, [256, 1000])
    assert not take("token_embd.weight", Q4_K, [256, 1000])  # GET_ROWS on the CPU
    assert not take("blk.0.attn_q.weight", Q8_0, [256, 256])  # not a Q8_K dot: tinyBLAS's
    assert take("blk.0.ffn_up_shexp.weight", Q4_K, [256, 512])  # a shared expert: dense
    assert not take("blk.0.ffn_gate_exps.weight", Q4_K, [256, 256, 8])  # experts: the expert lane's
    assert not take("blk.0.ffn_gate_inp_shexp.weight", Q4_K, [256, 256])  # not a projection named here
    assert not take("blk.0.attn_norm.weight", 0, [256])
    assert not take("blk.0.attn_q.weight", Q4_K, [100, 256])  # not whole superblocks


def test_dense_model_every_position_equals_stock_one_token_per_call_in_63_row_batches(dense_model):
    ids, scores, stats, sizes = _ours(dense_model)
    assert stats["invariant_rows"] == eval_shapes.UNTILED_MAX_ROWS
    m = stats["matmuls"]
    header_names = taken_weights(read_gguf_header(dense_model))
    assert m["weights"] == len(header_names) > 0 and m["computed"] > 0 and m["rows"] > 0
    assert max(sizes) == min(63, len(ids) - 4)  # the 70-token prompt in 63 + 7
    assert "one token per call" in stats["equals_stock"]
    ref = _stock_scores(dense_model, ids)
    assert np.array_equal(scores, ref)
    stock_63 = _stock_scores(dense_model, ids, n_batch=63, n_ubatch=63)
    assert not np.array_equal(stock_63, ref), "stock's own 63-row batches lost the tiled kernel"


@pytest.mark.parametrize("n_batch", [7, 16])
def test_dense_model_any_batch_size_gives_the_same_bits(dense_model, n_batch):
    _, default, _, _ = _ours(dense_model)
    _, other, _, sizes = _ours(dense_model, n_batch=n_batch)
    assert max(sizes) == n_batch
    assert np.array_equal(other, default)


def test_a_repeated_request_gives_the_same_logprobs(dense_model):
    llm = llamaflash.Llama(str(dense_model), deterministic=True, **KW)
    prompt = " ".join(f"w{i}" for i in range(90))

    def answer():
        c = llm.create_completion(prompt, max_tokens=12, temperature=0.0, logprobs=1)["choices"][0]
        return c["text"], c["logprobs"]["token_logprobs"]

    first = answer()
    assert answer() == first
    llm.create_completion("w5 w6 w7", max_tokens=4, temperature=0.0)
    assert answer() == first
    llm.close()


def test_moe_in_memory_equals_stock_one_token_per_call_at_any_batch(moe_model):
    ids, scores, stats, sizes = _ours(moe_model)
    assert stats["matmuls"] is not None and stats["matmuls"]["computed"] > 0
    assert stats["matmuls"]["weights"] == len(taken_weights(read_gguf_header(moe_model)))
    assert stats["invariant_rows"] == eval_shapes.UNTILED_MAX_ROWS  # experts and routers: the lane's rows
    assert stats["matmuls"]["in_place"] == 0  # in memory: copies (anonymous memory streams faster)
    assert max(sizes) == min(63, len(ids) - 4)
    assert np.array_equal(scores, _stock_scores(moe_model, ids))
    _, small, _, _ = _ours(moe_model, n_batch=16)
    assert np.array_equal(small, scores)


def test_under_a_budget_equals_stock_one_token_per_call_with_the_weights_read_in_place(moe_model):
    """Experts from flash through 3 slots per layer: the matmuls are llamaflash's too (63-row
    batches), their weights read in place from the model file's mapping (held once)."""
    ids, scores, stats, sizes = _ours(moe_model, ram_budget_mb=4000, flash_expert_slots=3)
    assert stats["matmuls"] is not None and stats["matmuls"]["computed"] > 0
    assert stats["invariant_rows"] == eval_shapes.UNTILED_MAX_ROWS
    assert max(sizes) == min(63, len(ids) - 4)
    assert np.array_equal(scores, _stock_scores(moe_model, ids))
    _, small, _, _ = _ours(moe_model, n_batch=7, ram_budget_mb=4000, flash_expert_slots=3)
    assert np.array_equal(small, scores)
    assert stats["matmuls"]["in_place"] == stats["matmuls"]["weights"]  # the file's pages, not a copy


def test_the_default_keeps_ggml_matmuls(dense_model):
    llm = llamaflash.Llama(str(dense_model), **KW)
    assert llm.flash_stats()["numerics"]["matmuls"] is None
    llm.close()


def test_no_sidecar_notice_for_deterministic_in_memory(dense_model, monkeypatch):
    """deterministic=True in memory needs no sidecar (llamaflash computes the matmuls): no "running as
    stock without acceleration" warning; the default still says it."""
    import warnings

    from llamaflash.runtime import notices

    for deterministic, expected in ((True, 0), (False, 1)):
        monkeypatch.setattr(notices, "_warned_no_sidecar", False)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            llamaflash.Llama(str(dense_model), deterministic=deterministic, **KW).close()
        said = [w for w in seen if "no sidecar" in str(w.message)]
        assert len(said) == expected, [str(w.message) for w in said]


def test_inner_batches_compute_no_logits_and_change_no_bit(dense_model):
    """A prompt longer than one deterministic batch, logits_all=False: the batches before the last
    ask for no logits (nothing samples them: no product by the output matrix), and the last position's
    logits equal those of the evaluation where every row is an output."""
    llm = llamaflash.Llama(str(dense_model), deterministic=True, **{**KW, "logits_all": False})
    ids = _prompt(llm)
    outputs, decode = [], llm._ctx.decode

    def counting(batch):
        outputs.append(sum(int(batch.batch.logits[i]) for i in range(batch.batch.n_tokens)))
        return decode(batch)

    llm._ctx.decode = counting
    llm.eval(ids)
    last = np.ctypeslib.as_array(raw.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()
    llm.close()
    assert len(outputs) >= 2 and outputs == [0] * (len(outputs) - 1) + [1]
    _, scores, _, _ = _ours(dense_model)
    assert np.array_equal(last, scores[len(ids) - 1])


@pytest.fixture(scope="module")
def dense_converted(tiny_model_factory, tmp_path_factory):
    """A Q4_K_M dense model (n_ff 512: 16 clusters of 32 per layer) with its calibrated sidecar."""
    from synth import FAST_CONVERT

    from llamaflash.converters import convert

    d = tmp_path_factory.mktemp("rows-dense-engine")
    model = d / "m.gguf"
    shutil.copy(tiny_model_factory(weight_type="Q4_K_M", n_embd=256, n_ff=512), model)
    sidecar = convert(model, progress=False, sparsity=0.5, measure_quality=False, **FAST_CONVERT)
    return model, sidecar


def test_dense_lane_equals_stock_one_token_per_call_in_63_row_batches(dense_converted):
    """The exact dense lane (flash_mode="dense") computes the FFN's MUL_MATs rows as alone, beside the
    attention's: every position equals stock evaluating one token per call."""
    model, sidecar = dense_converted
    ids, scores, stats, sizes = _ours(model, sidecar_path=str(sidecar), flash_mode="dense")
    assert stats["invariant_rows"] == eval_shapes.UNTILED_MAX_ROWS
    assert max(sizes) == 63
    header = read_gguf_header(model)
    n_ffn = sum(1 for n in taken_weights(header) if ".ffn_" in n)
    assert n_ffn > 0 and stats["matmuls"]["weights"] == len(taken_weights(header)) - n_ffn  # the lane keeps them
    assert np.array_equal(scores, _stock_scores(model, ids))


@pytest.mark.parametrize("n_batch", [7, 16])
def test_sparse_lane_in_memory_takes_63_row_batches_with_the_bits_of_any_other(dense_converted, n_batch):
    """The sparse lane (lossy) in memory: its gate product computed rows as alone, its own dots per
    row; a prompt in batches of 63, 16 or 7 gives every position the same bits."""
    model, sidecar = dense_converted
    kw = dict(sidecar_path=str(sidecar), flash_mode="sparse")
    ids, scores, stats, sizes = _ours(model, **kw)
    assert stats["invariant_rows"] == eval_shapes.UNTILED_MAX_ROWS and max(sizes) == 63
    assert stats["lossless"] is False
    other_ids, other, _, other_sizes = _ours(model, n_batch=n_batch, **kw)
    assert max(other_sizes) == n_batch
    assert other_ids == ids and np.array_equal(other, scores)


def test_offload_chunks_are_the_batch_the_planner_counts_scratch_for():
    from llamaflash.planning import plan_budget

    assert _native.SPARSE_CHUNK_TOKENS == plan_budget.VERIFY_ROWS


@pytest.mark.parametrize("n_batch", [7, 16])
def test_offload_computes_whole_layers_equal_to_stock_one_token_per_call(dense_converted, forced_plan, n_batch):
    """Flash offload with deterministic=True: every FFN computed whole over the layer read from flash
    (the layer stream; the sparse lane off), so every position equals stock evaluating one token per
    call, in 63-row batches and in batches of 7 or 16; the stream read layers and pinned one."""
    from offload_helpers import make_plan

    model, sidecar = dense_converted
    forced_plan(make_plan(sidecar, 4, prefetch_layers=1))
    kw = dict(sidecar_path=str(sidecar), ram_budget_mb=64)
    llm = llamaflash.Llama(str(model), deterministic=True, **KW, **kw)
    stats = llm.flash_stats()
    assert stats["offload"]["whole_layers"] is True and stats["offload"]["cold_slots"] == 2
    assert "whole layers" in stats["speculative"]["self_draft_off_reason"]  # prompt lookup stays
    llm.close()
    ids, scores, stats, sizes = _ours(model, **kw)
    assert stats["invariant_rows"] == eval_shapes.UNTILED_MAX_ROWS and max(sizes) == 63
    assert stats["lossless"] is True and stats["matmuls"]["computed"] > 0
    assert np.array_equal(scores, _stock_scores(model, ids))
    other_ids, other, _, other_sizes = _ours(model, n_batch=n_batch, **kw)
    assert max(other_sizes) == n_batch
    assert other_ids == ids and np.array_equal(other, scores)
