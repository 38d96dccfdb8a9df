"""The same request gets the same answer (plugin/runtime/eval_shapes.py).

Repeat-stable (the default): a request repeated, right away or after other requests took the cache,
gives the tokens and logprobs (log-softmax of the logits, compared exactly) of its first evaluation,
in memory (stock lane, sparse lane), under a budget with speculation on, and on the MoE expert lane.
Deterministic (deterministic=True): a conversation replayed from scratch gives the answer it got
continued in the KV cache, and a prompt gives the same answer at any n_batch / n_ubatch.
Reference: the same Llama's (or a fresh one's) first answer; llama-cpp-python itself re-evaluates a
cached prompt's last token alone and can answer differently (shown on a K-quant model where it does).
Models: tiny synthetic GGUFs (tests/synth.py, llamaflash.bench.moe_synth), contexts past 256 tokens
so that flash attention's split-KV path for lone rows is exercised.
"""

from __future__ import annotations

import os
import shutil

import llama_cpp
import numpy as np
import pytest
from offload_helpers import make_plan
from synth import synthetic_text

import llamaflash
from llamaflash.runtime import eval_shapes, flash_stats
from llamaflash.runtime.eval_shapes import KvHistory, PromptRecord, PromptRecords, Segment
from llamaflash.runtime.speculative import batch_invariant_weights

KW = dict(n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False, logits_all=True, seed=0)
N_GEN = 24


def long_prompt(n_words: int = 260) -> str:
    """Over 256 tokens: past them a lone decode row takes flash attention's split-KV path."""
    return " ".join(synthetic_text(n_words, seed=3).split()[:n_words])


class NoDrafts:
    """A draft model (llama-cpp-python's LlamaDraftModel interface) that never proposes a token."""

    def __call__(self, input_ids, **kwargs):
        return np.empty(0, dtype=np.intc)


OTHER = "the other request shares nothing with the first one but a few words of the synthetic vocabulary"


def answer(llm, prompt: str, n: int = N_GEN):
    r = llm.create_completion(prompt, max_tokens=n, temperature=0.0, logprobs=1)
    c = r["choices"][0]
    return c["text"], list(c["logprobs"]["token_logprobs"])


def assert_repeat_stable(llm, prompt: str):
    first = answer(llm, prompt)
    assert len(first[1]) == N_GEN
    assert answer(llm, prompt) == first, "repeated right away"
    answer(llm, OTHER)
    assert answer(llm, prompt) == first, "repeated after another request"
    llm.reset()
    assert answer(llm, prompt) == first, "repeated after reset()"
    return first


# -- shapes (no model) ------------------------------------------------------------------------------


@pytest.mark.parametrize("max_rows", [3, 4, 7])
@pytest.mark.parametrize("n_past", [0, 1, 100, 255, 256, 600])
@pytest.mark.parametrize("n", [1, 2, 4, 7, 8, 9, 15, 100])
def test_invariant_chunks_cover_the_tokens_in_batches_of_at_most_7(n_past, n, max_rows):
    chunks = eval_shapes.invariant_chunks(n_past, n, max_rows)
    pos = n_past
    for first, rows in chunks:
        assert first == pos and 1 <= rows <= max_rows
        assert rows > 1 or n == 1
        pos += rows
    # every token once, in order; a lone token past the split-KV length gets one filler row after it
    lone_padded = n == 1 and eval_shapes.kv_cells(n_past + 1) >= eval_shapes.SPLIT_KV_MIN_CELLS
    assert pos == n_past + n + (1 if lone_padded else 0)
    lone = [first for first, rows in chunks if rows == 1]
    # a lone row only where flash attention would not split its KV
    assert all(eval_shapes.kv_cells(p + 1) < eval_shapes.SPLIT_KV_MIN_CELLS for p in lone)


@pytest.mark.parametrize("n_past", [0, 5, 300])
def test_a_lone_row_gets_a_filler_at_any_position_where_a_matrix_takes_tinyblas(n_past):
    assert eval_shapes.invariant_chunks(n_past, 1, pad_lone=True, pad_always=True) == [(n_past, 2)]
    assert eval_shapes.invariant_chunks(n_past, 1, pad_lone=False, pad_always=True) == [(n_past, 1)]


def test_tinyblas_matrices_are_found_in_the_header(tiny_model_factory):
    """A model multiplying by a q8_0 matrix (tinyBLAS from 2 rows on, vec_dot for one) is found; its
    Q8_0 layers are named."""
    from llamaflash.files.gguf_header import read_gguf_header
    from llamaflash.runtime.llama_settings import tinyblas_matrix

    found = tinyblas_matrix(read_gguf_header(tiny_model_factory(weight_type="Q8_0")))
    assert found is not None and found != "token_embd.weight"


def test_replay_keeps_matching_segments_and_redoes_the_rest():
    rec = PromptRecord((Segment(0, 10, False), Segment(10, 7, True), Segment(13, 5, False)), logits=None)
    hist = KvHistory()
    for s in rec.segments:
        hist.add(s)
    # the cache holds the prompt as recorded, but without logits: the last segment is decoded again
    plan = eval_shapes.plan_replay(rec, hist, shared=18, n_prompt=18)
    assert plan.keep == 13 and plan.segments == (Segment(13, 5, False),)
    rec.logits = object()
    assert eval_shapes.plan_replay(rec, hist, 18, 18).segments == ()
    # another request kept only the first 12 positions: the cut verify batch is redone in its shape
    plan = eval_shapes.plan_replay(rec, hist, shared=12, n_prompt=18)
    assert plan.keep == 10 and plan.segments == rec.segments[1:]
    # a cache built in other shapes keeps nothing
    other = KvHistory()
    other.add(Segment(0, 18, False))
    assert eval_shapes.plan_replay(rec, other, 18, 18).keep == 0
    other.forget()
    assert eval_shapes.plan_replay(rec, other, 18, 18).keep == 0


def test_records_keep_logits_for_the_most_recent_prompts_only():
    records = PromptRecords(max_records=3, max_logits=2)
    for i in range(4):
        records.put([i, i + 1], (Segment(0, 2, False),), logits=[float(i)])
    assert len(records) == 3 and records.get([0, 1]) is None
    assert records.get([1, 2]).logits is None and records.get([3, 4]).logits == [3.0]


# -- settings --------------------------------------------------------------------------------------


def test_an_unknown_keyword_is_a_type_error_naming_the_closest(tmp_path):
    with pytest.raises(TypeError, match="ram_budget.*did you mean 'ram_budget_mb'"):
        llamaflash.Llama(str(tmp_path / "absent.gguf"), ram_budget=300)
    with pytest.raises(TypeError, match="'determinstic'.*'deterministic'"):
        llamaflash.Llama(str(tmp_path / "absent.gguf"), determinstic=True)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"flash_attn": False}, "flash attention"),
        ({"n_ubatch": 4}, "n_ubatch=4"),
        ({"flash_max_sparse_tokens": 2}, "flash_max_sparse_tokens=2"),
        ({"flash_batch_invariant": False}, "flash_batch_invariant"),
        ({}, None),
    ],
)
def test_deterministic_settings_that_contradict_it_are_refused(tmp_path, kw, match):
    if match is None:
        with pytest.raises(ValueError, match="deterministic='yes' must be True or False"):
            llamaflash.Llama(str(tmp_path / "absent.gguf"), deterministic="yes")
        return
    with pytest.raises(ValueError, match=match):
        llamaflash.Llama(str(tmp_path / "absent.gguf"), deterministic=True, **kw)


# -- repeat-stable ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kquant_model(tiny_model_factory, tmp_path_factory):
    """A Q4_K_M model without a sidecar (runs as stock): repacked Q4_K gemm and the tiled matmul."""
    d = tmp_path_factory.mktemp("kquant")
    path = d / "m.gguf"
    shutil.copy(tiny_model_factory(weight_type="Q4_K_M", n_embd=256, n_ff=512), path)
    return path


def test_repeated_request_in_memory_stock_lane(kquant_model):
    llm = llamaflash.Llama(str(kquant_model), **KW)
    assert llm.flash_mode == "stock"
    assert_repeat_stable(llm, long_prompt())
    numerics = llm.flash_stats()["numerics"]
    assert numerics["answers"] == "repeat-stable" and numerics["lossless"]
    assert "stock llama-cpp-python" in numerics["equals_stock"]
    llm.close()


def test_repeated_request_sparse_lane(converted):
    model, sidecar = converted
    llm = llamaflash.Llama(str(model), sidecar_path=str(sidecar), flash_mode="sparse", **KW)
    assert_repeat_stable(llm, long_prompt())
    assert llm.flash_stats()["numerics"]["lossless"] is False
    llm.close()


def test_repeated_request_under_a_budget_with_speculation(converted, forced_plan):
    model, sidecar = converted
    forced_plan(make_plan(sidecar, 3, prefetch_layers=1))
    llm = llamaflash.Llama(str(model), sidecar_path=str(sidecar), ram_budget_mb=64, flash_speculative=True, **KW)
    assert llm.flash_mode == "offload"
    first = assert_repeat_stable(llm, long_prompt())
    assert llm.flash_stats()["speculative"]["passes"] > 0
    # exact speculation past 256 tokens: the tokens and logprobs of decoding without drafts (a draft
    # model that proposes nothing: every pass one token, lone rows evaluated as with speculation)
    plain = llamaflash.Llama(str(model), sidecar_path=str(sidecar), ram_budget_mb=64, draft_model=NoDrafts(), **KW)
    assert answer(plain, long_prompt()) == first
    plain.close()
    llm.close()


def test_a_padded_lone_row_leaves_the_rows_before_it_as_they_were(kquant_model):
    """Past 256 positions a lone decode row is evaluated with a filler row after it: the KV entries of
    the prompt (a batch of more than 7 rows: the tiled matmul) keep their bits, so the next positions
    get the logits they get when the same tokens are verified together in one batch."""
    llm = llamaflash.Llama(str(kquant_model), flash_batch_invariant=True, draft_model=NoDrafts(), **KW)
    prompt = llm.tokenize(long_prompt().encode())
    assert len(prompt) > 300
    llm.eval(prompt)
    t1 = int(np.argmax(llm.scores[len(prompt) - 1]))
    llm.eval([t1])  # alone: the row and a filler
    t2 = int(np.argmax(llm.scores[len(prompt)]))
    llm.eval([t2])
    alone = np.array(llm.scores[len(prompt) : len(prompt) + 2])
    assert llm._kv_history.segments[-1] == Segment(len(prompt) + 1, 2, True)
    llm.reset()
    llm.eval(prompt)
    llm.eval([t1, t2])  # together, as a verify batch
    together = np.array(llm.scores[len(prompt) : len(prompt) + 2])
    assert np.array_equal(alone, together)
    llm.close()


def test_repeated_request_expert_lane(tiny_moe_factory, tmp_path):
    from llamaflash.converters.pipeline import convert

    path = tmp_path / "moe.gguf"
    shutil.copyfile(tiny_moe_factory("qwen3moe"), path)
    convert(path, force=True, progress=False, profile=False)
    llm = llamaflash.Llama(str(path), ram_budget_mb=4000, flash_expert_slots=3, **KW)
    assert llm.flash_mode == "experts"
    prompt = " ".join(f"w{i}" for i in range(100))  # ~360 tokens
    first = assert_repeat_stable(llm, prompt)
    assert llm.flash_stats()["numerics"]["equals_stock"] == flash_stats.BATCH_INVARIANT_STOCK
    batches = dict(n_batch=llm.n_batch, n_ubatch=llm.context_params.n_ubatch)  # the plan's prefill batch
    llm.close()
    # without speculation the expert lane equals stock with plain weights and flash attention (and the
    # same prompt batches) at any length
    with batch_invariant_weights():
        stock = llama_cpp.Llama(str(path), flash_attn=True, **KW, **batches)
    assert answer(stock, prompt) == first
    stock.close()


def test_stock_itself_answers_a_repeat_differently(kquant_model):
    """Why the default matters: llama-cpp-python re-evaluates the cached prompt's last token alone."""
    llm = llama_cpp.Llama(str(kquant_model), **KW)
    first = answer(llm, long_prompt())
    again = answer(llm, long_prompt())
    llm.close()
    if first == again:
        pytest.skip("this build computed the lone row with the batch's bits on this model")
    assert first[1] != again[1]


# -- deterministic ---------------------------------------------------------------------------------


def _conversation(llm, turns: int = 2):
    """A conversation continued in the KV cache: each prompt extends the last prompt and answer."""
    text = long_prompt(200)
    answers = []
    for i in range(turns):
        reply = answer(llm, text)
        answers.append(reply)
        text = text + reply[0] + f" and then question {i} was asked"
    return text, answers


@pytest.mark.parametrize("kv", ["q8_0", "f16"])
@pytest.mark.parametrize("lane", ["stock", "offload"])
def test_deterministic_replay_from_scratch_equals_the_continued_conversation(
    lane, kv, kquant_model, converted, forced_plan
):
    """The default q8_0 KV cache (one row's attention never split: no filler rows) and an f16 one
    (a lone row past 256 positions gets a filler row). The offload model's heads (24 values) are not
    whole q8_0 blocks: its cache stays f16 by default."""
    if lane == "stock":
        model, kw = kquant_model, {}
    else:
        model, sidecar = converted
        forced_plan(make_plan(sidecar, 3, prefetch_layers=1))
        kw = dict(sidecar_path=str(sidecar), ram_budget_mb=64)
    if kv == "f16":
        kw.update(type_k=eval_shapes.GGML_TYPE_F16, type_v=eval_shapes.GGML_TYPE_F16)
    llm = llamaflash.Llama(str(model), deterministic=True, **KW, **kw)
    assert llm.flash_stats()["numerics"]["answers"] == "deterministic"
    q8 = kv == "q8_0" and lane == "stock"
    assert llm.context_params.type_k == (eval_shapes.GGML_TYPE_Q8_0 if q8 else eval_shapes.GGML_TYPE_F16)
    last_prompt, _ = _conversation(llm)
    continued = answer(llm, last_prompt)
    assert llm.n_tokens > 300
    segs = llm._kv_history.segments
    fillers = [a for a, b in zip(segs, segs[1:]) if a.size == 2 and b.start == a.start + 1]
    assert bool(fillers) == (not q8)  # decode steps past 256 positions: filler rows with f16 only
    llm.close()
    for batch in ({}, {"n_batch": 16, "n_ubatch": 16}):
        fresh = llamaflash.Llama(str(model), deterministic=True, **{**KW, **kw, **batch})
        assert answer(fresh, last_prompt) == continued, f"replayed from scratch with {batch or 'defaults'}"
        fresh.close()


@pytest.mark.parametrize("where", ["budget", "in memory"])
def test_deterministic_expert_lane_computes_the_routers_row_by_row(where, tiny_moe_factory, tmp_path):
    """In a Q4_K_M mix an MoE's f32 routers are the only matrices tinyBLAS takes from 2 rows on. Under
    deterministic=True the expert lane (in memory too: every expert resident) computes them too, each
    row as ggml-cpu computes a row alone: no filler rows (decode steps of one row), and every
    position's logits equal stock (plain weights, flash attention, the same q8_0 KV cache) evaluating
    one token per call. Stock's own 7-row batches give other bits (the router's tinyBLAS), which is
    what the filler rows used to paper over."""
    from llamaflash.converters.pipeline import convert

    path = tmp_path / "moe.gguf"
    spec = dict(n_embd=256, head_dim=64, n_ff_exp=256, n_ff_shexp=256, quant="Q4_K_M", direct=True)
    shutil.copyfile(tiny_moe_factory("qwen3moe", **spec), path)
    convert(path, force=True, progress=False, profile=False)
    kw = dict(KW, n_ctx=512)
    budget = dict(ram_budget_mb=4000, flash_expert_slots=3) if where == "budget" else {}
    llm = llamaflash.Llama(str(path), deterministic=True, **budget, **kw)
    assert llm.flash_mode == "experts"
    assert llm._tinyblas_matrix is None  # the routers are computed row by row
    assert "one token per call" in llm.flash_stats()["numerics"]["equals_stock"]
    assert llm.context_params.type_k == eval_shapes.GGML_TYPE_Q8_0
    prompt = llm.tokenize(" ".join(f"w{i}" for i in range(40)).encode())
    llm.eval(prompt)
    for _ in range(8):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    decode_steps = llm._kv_history.segments[-8:]
    assert [s.size for s in decode_steps] == [1] * 8
    ours = np.array(llm.scores[: llm.n_tokens])
    ids = list(llm.input_ids[: llm.n_tokens])
    llm.close()

    def stock(**batches):
        with batch_invariant_weights():
            s = llama_cpp.Llama(str(path), flash_attn=True, type_k=8, type_v=8, **{**kw, **batches})
        return s

    one_at_a_time = stock()
    for t in ids:
        one_at_a_time.eval([t])
    ref = np.array(one_at_a_time.scores[: len(ids)])
    one_at_a_time.close()
    assert np.array_equal(ours, ref)
    batched = stock(n_batch=7, n_ubatch=7)
    batched.eval(ids)
    assert not np.array_equal(np.array(batched.scores[: len(ids)]), ref), "the reference lost its tinyBLAS router"
    batched.close()


_UNTILED_SCRIPT = r"""
import json, sys
import llama_cpp, numpy as np, llamaflash
from llamaflash.runtime.speculative import batch_invariant_weights
path = sys.argv[1]
kw = dict(n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False, logits_all=True, seed=0)
prompt = None
runs = {}
for n_batch in (64, 16):
    llm = llamaflash.Llama(path, deterministic=True, n_batch=n_batch, n_ubatch=n_batch, **kw)
    prompt = prompt or llm.tokenize(" ".join(f"w{i}" for i in range(60)).encode())
    llm.eval(prompt)
    runs[n_batch] = dict(
        rows=llm.flash_stats()["numerics"]["invariant_rows"],
        sizes=sorted({s.size for s in llm._kv_history.segments}),
        scores=np.array(llm.scores[: len(prompt)]),
    )
    llm.close()
with batch_invariant_weights():
    stock = llama_cpp.Llama(path, flash_attn=True, type_k=8, type_v=8, **kw)
for t in prompt:
    stock.eval([t])
ref = np.array(stock.scores[: len(prompt)])
print(json.dumps({
    "n_prompt": len(prompt),
    "rows": [runs[b]["rows"] for b in (64, 16)],
    "sizes": [runs[b]["sizes"] for b in (64, 16)],
    "equal_batches": bool(np.array_equal(runs[64]["scores"], runs[16]["scores"])),
    "equal_one_at_a_time": bool(np.array_equal(runs[64]["scores"], ref)),
}))
"""


def test_without_the_tiled_kernel_deterministic_batches_take_63_rows(tiny_moe_factory, tmp_path):
    """With GGML_CPU_TILED_MM=0 in the process's environment (what `llamaflash run/chat/serve
    --deterministic` set), the probe finds K-quant rows invariant and deterministic batches take up to
    63 rows (n_batch permitting); every position still equals stock evaluating one token per call, at
    n_batch 64 and 16 alike. In this test process (the tiled kernel on) batches stay at 7 rows."""
    import json
    import subprocess
    import sys

    from llamaflash import _native
    from llamaflash.converters.pipeline import convert

    path = tmp_path / "moe.gguf"
    spec = dict(n_embd=256, head_dim=64, n_ff_exp=256, n_ff_shexp=256, quant="Q4_K_M", direct=True)
    shutil.copyfile(tiny_moe_factory("qwen3moe", **spec), path)
    convert(path, force=True, progress=False, profile=False)
    assert _native.kquant_rows_invariant(eval_shapes.MAX_ROWS)
    if os.environ.get("GGML_CPU_TILED_MM") != "0":
        assert not _native.kquant_rows_invariant(eval_shapes.UNTILED_MAX_ROWS)
    env = dict(os.environ, GGML_CPU_TILED_MM="0")
    done = subprocess.run(
        [sys.executable, "-c", _UNTILED_SCRIPT, str(path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["rows"] == [eval_shapes.UNTILED_MAX_ROWS, eval_shapes.UNTILED_MAX_ROWS]
    assert max(r["sizes"][0]) == min(63, r["n_prompt"]) and max(r["sizes"][1]) == 16
    assert r["equal_batches"] and r["equal_one_at_a_time"]


def test_the_command_line_turns_the_tiled_kernel_off_for_deterministic_answers(monkeypatch):
    from llamaflash.cli import run_chat

    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    run_chat.untiled_for_determinism()
    assert os.environ["GGML_CPU_TILED_MM"] == "0"
    monkeypatch.setenv("GGML_CPU_TILED_MM", "1")  # a user's own setting is kept
    run_chat.untiled_for_determinism()
    assert os.environ["GGML_CPU_TILED_MM"] == "1"


def test_deterministic_moe_in_memory_without_a_sidecar_runs_as_stock(tiny_moe_factory, tmp_path):
    """No expert sidecar: the expert lane cannot serve it, so stock runs it (with filler rows), saying why."""
    path = tmp_path / "moe.gguf"
    spec = dict(n_embd=256, head_dim=64, n_ff_exp=256, n_ff_shexp=256, quant="Q4_K_M", direct=True)
    shutil.copyfile(tiny_moe_factory("qwen3moe", **spec), path)
    llm = llamaflash.Llama(str(path), deterministic=True, **dict(KW, n_ctx=512))
    assert llm.flash_mode == "stock"
    assert "expert sidecar" in llm.flash_stats()["decision"]["reason"]
    assert llm._tinyblas_matrix == "blk.0.ffn_gate_inp.weight"  # stock computes the routers: filler rows
    assert answer(llm, "w1 w2 w3") == answer(llm, "w1 w2 w3")
    llm.close()
