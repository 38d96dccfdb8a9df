"""Mixture-of-Experts expert offload: exactness against stock llama.cpp, cache behaviour, faults.

Reference: stock llama-cpp-python with plain (not repacked) weights and flash attention, the numerics
the expert lane reproduces (csrc/experts/expert_lane.h). Claimed: bit-identical logits, prefill and decode,
whatever the cache holds (few slots force misses, prefill in several rounds, and prefetches).
Models: tiny synthetic MoE GGUFs of real llama.cpp architectures (llamaflash.bench.moe_synth),
generated fresh per session; their expert sidecars are converted fresh per test directory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import llama_cpp
import numpy as np
import pytest

from llamaflash import Llama
from llamaflash.converters.pipeline import convert
from llamaflash.errors import RamBudgetError, SidecarIntegrityError, SidecarMismatchError, SidecarNotFoundError
from llamaflash.files.expert_sidecar import read_expert_sidecar
from llamaflash.files.experts import check_layout, read_moe_model
from llamaflash.files.gguf_header import read_gguf_header
from llamaflash.planning.expert_plan import lru_miss_rate
from llamaflash.runtime.speculative import batch_invariant_weights

TOKENS = list(range(100, 140))  # 40 tokens: a prefill batch, then decoded one by one
#: A budget that holds llama.cpp's share of a tiny model; the experts are then served from flash
#: because flash_expert_slots is given.
BUDGET_MB = 4000


def stock(path):
    with batch_invariant_weights():
        return llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False, flash_attn=True)


def served(path, slots, **kw):
    return Llama(
        str(path),
        n_ctx=256,
        logits_all=True,
        verbose=False,
        ram_budget_mb=BUDGET_MB,
        flash_expert_slots=slots,
        flash_speculative=False,
        **kw,
    )


def prefill_logits(llm, tokens=TOKENS):
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)])


def decode_logits(llm, tokens=TOKENS):
    llm.reset()
    out = []
    for t in tokens:
        llm.eval([t])
        out.append(np.array(llm.scores[llm.n_tokens - 1]))
    return np.array(out)


def chunked_logits(llm, tokens, size):
    """Every position's logits, the tokens evaluated in batches of ``size``."""
    llm.reset()
    for i in range(0, len(tokens), size):
        llm.eval(tokens[i : i + size])
    return np.array(llm.scores[: len(tokens)])


@pytest.fixture()
def converted(tmp_path, tiny_moe_factory):
    """``make(arch, **spec) -> model path`` in tmp_path with its expert sidecar beside it."""

    def make(arch, **spec):
        src = tiny_moe_factory(arch, **spec)
        path = tmp_path / src.name
        shutil.copyfile(src, path)
        convert(path, force=True, progress=False, profile=False)
        return path

    return make


@pytest.mark.parametrize("arch", ["qwen3moe", "llama", "qwen2moe", "gpt-oss"])
def test_logits_bit_identical_to_stock_whatever_the_cache_holds(arch, converted):
    path = converted(arch)
    ref = stock(path)
    ref_prefill, ref_decode = prefill_logits(ref), decode_logits(ref)
    ref.close()
    moe = read_moe_model(read_gguf_header(path))
    for slots in (moe.n_used, moe.n_used + 1, moe.n_expert):
        llm = served(path, slots)
        assert llm.flash_mode == "experts"
        assert np.array_equal(prefill_logits(llm), ref_prefill), f"prefill, {slots} slots"
        assert np.array_equal(decode_logits(llm), ref_decode), f"decode, {slots} slots"
        s = llm.flash_stats()["experts"]
        assert s["tokens"] == 2 * len(TOKENS)
        if slots < moe.n_expert:
            assert s["misses"] > 0 and s["multi_round_splits"] > 0  # a 40-token prefill needs > slots experts
            assert 0 < s["read_ahead"] <= s["misses"]  # later rounds read while earlier ones computed
            assert s["overlapped_splits"] > 0  # decode: resident experts computed while misses were read
        llm.close()


def test_computing_resident_experts_during_reads_changes_no_bit(converted, monkeypatch):
    """The overlap (resident experts in a first pass while the misses are read, the misses in a
    second) against one pass after every read: the same logits, both equal to stock."""
    path = converted("qwen3moe")
    ref = stock(path)
    ref_decode = decode_logits(ref)
    ref.close()
    moe = read_moe_model(read_gguf_header(path))
    got = {}
    for overlap in ("1", "0"):
        monkeypatch.setenv("LLAMAFLASH_EXPERT_OVERLAP", overlap)
        llm = served(path, moe.n_used + 1)
        got[overlap] = decode_logits(llm)
        overlapped = llm.flash_stats()["experts"]["overlapped_splits"]
        assert overlapped > 0 if overlap == "1" else overlapped == 0
        llm.close()
    assert np.array_equal(got["1"], ref_decode) and np.array_equal(got["0"], ref_decode)


@pytest.mark.parametrize(
    "arch,spec",
    [
        ("qwen3moe", dict(n_embd=256, head_dim=64, n_ff_exp=256, n_ff_shexp=256, quant="Q4_K_M")),
        ("llama", dict(n_embd=256, head_dim=64, n_ff_exp=256, n_ff_shexp=256, quant="Q4_K_M")),
        # gpt-oss's release format: MXFP4 experts (vec_dot against q8_0 inputs), Q8_0 elsewhere
        ("gpt-oss", dict(quant="MXFP4", n_embd=64, n_ff_exp=64, n_head=4, n_head_kv=2, head_dim=16, direct=True)),
    ],
)
def test_quantized_experts_bit_identical_to_stock_batches(arch, spec, converted):
    """K-quant experts: stock's ggml-cpu computes an expert with 8 or more rows of a batch with a tiled
    kernel whose rounding differs from one vec_dot per output; the lane runs ggml's own MUL_MAT_ID per
    expert over its slot, so prefill batches match stock bit for bit too (40 tokens over 8 experts
    of which 2 used: about 10 rows per expert), and so do decode and small batches, whose experts
    (fewer than 8 rows each) the lane computes with ggml's vec_dots in one node per projection."""
    path = converted(arch, **spec)
    ref = stock(path)
    ref_prefill, ref_decode = prefill_logits(ref), decode_logits(ref, TOKENS[:12])
    ref_chunks = chunked_logits(ref, TOKENS[:20], 5)
    ref.close()
    moe = read_moe_model(read_gguf_header(path))
    for slots in (moe.n_used, moe.n_expert):
        llm = served(path, slots)
        assert np.array_equal(prefill_logits(llm), ref_prefill), f"prefill, {slots} slots"
        # decode and 5-token batches (experts of < 8 rows): one node per projection (expert_dots.h)
        assert np.array_equal(decode_logits(llm, TOKENS[:12]), ref_decode), f"decode, {slots} slots"
        assert np.array_equal(chunked_logits(llm, TOKENS[:20], 5), ref_chunks), f"5-token batches, {slots} slots"
        llm.close()


@pytest.mark.parametrize("name", ["LLAMAFLASH_EXPERT_PREFETCH", "LLAMAFLASH_EXPERT_OVERLAP"])
def test_engine_switches_take_only_0_or_1(name, monkeypatch):
    from llamaflash.runtime import expert_runtime

    switch = {
        expert_runtime.PREFETCH_ENV: expert_runtime.prefetch_enabled,
        expert_runtime.OVERLAP_ENV: expert_runtime.overlap_enabled,
    }[name]
    assert switch() is True
    monkeypatch.setenv(name, "0")
    assert switch() is False
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name}='yes': use 1"):
        switch()


def test_expert_statistics_and_prefetch(converted):
    path = converted("qwen3moe")
    llm = served(path, 3)
    decode_logits(llm)
    s = llm.flash_stats()["experts"]
    assert s["experts_needed"] == s["hits"] + s["misses"]
    assert 0.0 <= s["hit_rate"] <= 1.0
    assert s["prefetched"] > 0  # the next layer's router applied to this layer's input
    assert s["prefetch_used"] + s["prefetch_wasted"] <= s["prefetched"]
    assert s["bytes_read_per_token"] > 0 and s["io_engine"] in ("io_uring", "pool")
    assert s["verified_bytes"] > 0  # every read slice checked against its CRC-32C
    llm.reset_flash_stats()
    assert llm.flash_stats()["experts"]["requests"] == 0
    llm.close()


@pytest.mark.parametrize("where", ["head", "tail"])  # a slice is checked in one piece per thread
def test_damaged_expert_is_refused_and_llama_stays_usable(converted, where):
    path = converted("qwen3moe")
    moe = read_moe_model(read_gguf_header(path))
    ref = prefill_logits(stock(path))
    down = next(t for t in moe.layers[1].tensors if t.kind == "down")
    data = bytearray(path.read_bytes())
    at = down.slice_offset(3) + (17 if where == "head" else down.expert_bytes - 9)
    original = bytes(data[at : at + 8])
    llm = served(path, moe.n_expert, n_threads=2)  # every expert read on first use, checked by 2 threads
    with open(path, "r+b") as f:  # damaged after load, in place (same size)
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in original))
    with pytest.raises(SidecarIntegrityError, match="expert 3"):
        prefill_logits(llm)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(original)
    assert np.array_equal(prefill_logits(llm), ref)  # the damaged slot was dropped and read again
    llm.close()


def test_damaged_experts_fail_a_decode_step_before_any_wrong_logit(converted):
    """Prefetched experts are computed before finish() checks them (in the first pass, while the
    misses are read): a damaged one must fail its step, never give logits that differ from stock's."""
    path = converted("qwen3moe")
    moe = read_moe_model(read_gguf_header(path))
    ref = stock(path)
    ref_decode = decode_logits(ref)
    ref.close()
    llm = served(path, moe.n_used + 1, n_threads=2)  # few slots: misses, prefetches, overlapped passes
    down = next(t for t in moe.layers[1].tensors if t.kind == "down")
    original = path.read_bytes()
    with open(path, "r+b") as f:  # every expert of layer 1 damaged after load (pinned ones were read)
        for e in range(moe.n_expert):
            at = down.slice_offset(e) + down.expert_bytes // 2
            f.seek(at)
            f.write(bytes(b ^ 0xA5 for b in original[at : at + 4]))
    llm.reset()
    decoded = 0
    with pytest.raises(SidecarIntegrityError, match="layer 1 expert"):
        for i, t in enumerate(TOKENS):  # a step that needs a damaged expert read fails
            llm.eval([t])
            assert np.array_equal(np.array(llm.scores[llm.n_tokens - 1]), ref_decode[i]), f"token {i}"
            decoded += 1
    assert decoded < len(TOKENS)
    with open(path, "r+b") as f:  # restored in place: prefetches of the failed step may still read it
        for e in range(moe.n_expert):
            at = down.slice_offset(e) + down.expert_bytes // 2
            f.seek(at)
            f.write(original[at : at + 4])
    assert np.array_equal(decode_logits(llm), ref_decode)  # usable again, every damaged slot read again
    llm.close()


def test_sidecar_of_another_model_is_refused_before_loading(converted, tmp_path):
    a = converted("qwen3moe")
    b = converted("qwen3moe", seed=7, n_layer=2)
    with pytest.raises(SidecarMismatchError, match="another model"):
        Llama(str(a), sidecar_path=str(b.with_name(b.stem + ".flash.gguf")), ram_budget_mb=BUDGET_MB, verbose=False)


def test_without_budget_or_sidecar(converted, tmp_path):
    path = converted("qwen3moe")
    llm = Llama(str(path), n_ctx=128, verbose=False)
    assert llm.flash_mode == "stock"
    assert "in memory runs as stock" in llm.flash_stats()["decision"]["reason"]
    llm.close()
    path.with_name(path.stem + ".flash.gguf").unlink()
    with pytest.raises(SidecarNotFoundError, match="llamaflash convert"):
        Llama(str(path), ram_budget_mb=BUDGET_MB, verbose=False)


def test_budget_below_minimum_names_it(converted):
    path = converted("qwen3moe")
    with pytest.raises(RamBudgetError, match="minimum"):
        Llama(str(path), ram_budget_mb=50, verbose=False)


def test_budget_that_fits_the_model_runs_stock(converted):
    path = converted("qwen3moe")
    llm = Llama(str(path), n_ctx=128, ram_budget_mb=BUDGET_MB, verbose=False)
    assert llm.flash_mode == "stock"
    assert "fits" in llm.flash_stats()["decision"]["reason"]
    llm.close()


def test_a_budget_with_room_for_the_margin_runs_stocks_default_layout(converted):
    """Where the budget holds stock's need and the planner's margin, the model runs as
    llama_cpp.Llama(model) does (repacked experts: its default numerics, bit for bit); speculation or
    deterministic answers keep the plain weights they need."""
    import llama_cpp

    path = converted("qwen3moe")
    ref = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False)
    llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, ram_budget_mb=BUDGET_MB)
    assert llm.flash_mode == "stock" and llm._load_plan.expert_plan.stock_repacked
    assert llm.flash_stats()["numerics"]["batch_invariant"] is False
    assert np.array_equal(prefill_logits(llm), prefill_logits(ref))
    llm.close()
    ref.close()
    spec = Llama(str(path), n_ctx=256, verbose=False, ram_budget_mb=BUDGET_MB, flash_speculative=True)
    assert spec.flash_mode == "stock" and spec.flash_stats()["numerics"]["batch_invariant"] is True
    spec.close()


def test_stock_just_fitting_keeps_plain_weights(tiny_moe_factory):
    """Without room for the margin beside stock's need, repacked experts (anonymous memory) could not
    give way to the page cache: the plan runs stock with plain, file-backed weights."""
    from llamaflash.planning.expert_plan import plan_experts, stock_need
    from llamaflash.planning.planner import MARGIN_FIXED_BYTES, MARGIN_FRACTION, default_disk

    path = tiny_moe_factory("qwen3moe")
    header = read_gguf_header(path)
    moe = read_moe_model(header)
    MiB = 1024 * 1024
    need = sum(stock_need(header, moe, 256, 512).values())
    tight = plan_experts(moe, header, need / MiB, n_ctx=256, disk=default_disk(), n_ubatch=512)
    assert tight.fits and not tight.stock_repacked
    roomy_bytes = (need + MARGIN_FIXED_BYTES) / (1 - MARGIN_FRACTION) + MiB
    roomy = plan_experts(moe, header, roomy_bytes / MiB, n_ctx=256, disk=default_disk(), n_ubatch=512)
    assert roomy.fits and roomy.stock_repacked
    assert "repacked" in roomy.explain() and "plain weights" in tight.explain()


def test_sidecar_records_a_checksum_per_expert_slice(converted):
    path = converted("llama")
    moe = read_moe_model(read_gguf_header(path))
    info = read_expert_sidecar(path.with_name(path.stem + ".flash.gguf"))
    assert [s.layer for s in info.layers] == [layer.layer for layer in moe.layers]
    import zlib  # noqa: F401  (CRC-32C is not zlib's CRC-32: compare with the native one on one slice)

    from llamaflash import _native

    t = moe.layers[0].tensors[0]
    with open(path, "rb") as f:
        f.seek(t.slice_offset(5))
        one = f.read(t.expert_bytes)
    assert int(info.layers[0].checksums[t.kind][5]) == _native.crc32c_rows(one, t.expert_bytes, "auto")[0]


def test_unsupported_moe_architecture_is_named(tiny_moe_factory):
    import dataclasses

    moe = read_moe_model(read_gguf_header(tiny_moe_factory("qwen3moe")))
    why = check_layout(dataclasses.replace(moe, architecture="deepseek2"))
    assert why is not None and "deepseek2" in why


def test_lru_miss_rate_model():
    uniform = np.ones(64)
    assert lru_miss_rate(uniform, 8, 64, 0) == 0.0
    m = lru_miss_rate(uniform, 8, 16, 0)
    assert 0.7 < m < 0.8  # ~1 - 16/64 for independent uniform routing
    skewed = np.array([50.0] * 8 + [1.0] * 56)
    assert lru_miss_rate(skewed, 8, 16, 8) < m  # popular experts pinned


def test_speculative_verify_batches_give_the_same_tokens(converted):
    """Verify batches read the union of their tokens' experts once; each row has the bits of decoding
    it alone, so speculation changes no token. The draft proposes the true greedy continuation with
    every third token wrong, so verify batches both accept and reject."""
    import llama_cpp.llama_speculative as spec_mod

    path = converted("qwen3moe")
    prompt = "The quick brown fox"
    ref = Llama(
        str(path), n_ctx=256, verbose=False, ram_budget_mb=BUDGET_MB, flash_expert_slots=3, flash_speculative=False
    )
    p_tokens = ref.tokenize(prompt.encode())
    greedy = []
    for t in ref.generate(p_tokens, temp=0.0):
        greedy.append(t)
        if len(greedy) == 24:
            break
    ref.close()
    full = list(p_tokens) + greedy

    class Draft(spec_mod.LlamaDraftModel):
        def __call__(self, input_ids, **kwargs):
            n = len(input_ids)
            out = list(full[n : n + 4])
            if len(out) == 4:
                out[2] = (out[2] + 1) % 1000  # a wrong third draft: rejected there
            return np.array(out, dtype=np.intc)

    llm = Llama(str(path), n_ctx=256, verbose=False, ram_budget_mb=BUDGET_MB, flash_expert_slots=3, draft_model=Draft())
    got = []
    for t in llm.generate(p_tokens, temp=0.0):
        got.append(t)
        if len(got) == 24:
            break
    s = llm.flash_stats()["speculative"]
    assert got == greedy
    assert s["accepted"] > 0 and s["verify_tokens_mean"] > 1.0  # batches of several tokens were verified
    llm.close()


def test_draft_mode_routes_among_resident_experts_and_reads_nothing(converted):
    """Draft mode (the self-draft's cache-conditional routing): no flash read, no request, no prefetch;
    routed experts that are not resident are replaced by resident ones (counted). With every expert
    resident the draft is the exact computation: its logits equal the exact ones bit for bit."""
    path = converted("qwen3moe")
    llm = served(path, 3)
    llm.reset()
    llm.eval(TOKENS[:8])
    before = llm._experts.stats()
    llm._experts.draft = True
    try:
        llm.eval(TOKENS[8:12])
    finally:
        llm._experts.draft = False
    after = llm._experts.stats()
    for key in ("bytes_read", "requests", "misses", "prefetched", "splits", "tokens"):
        assert after[key] == before[key], key
    assert after["draft_splits"] - before["draft_splits"] > 0
    assert after["draft_substituted"] > 0  # 3 slots of the tiny model's experts: most tokens route elsewhere
    assert after["draft_pairs"] >= after["draft_substituted"] + after["draft_dropped"]
    llm.close()

    moe = read_moe_model(read_gguf_header(path))
    every = served(path, moe.n_expert)
    every.reset()
    every.eval(list(range(100, 228)))  # a 128-token prefill routes to every expert: all read once
    assert all(len(every._experts.resident_experts(p)) == moe.n_expert for p in range(len(moe.layers)))
    exact = decode_logits(every, TOKENS[:6])
    every._experts.draft = True
    try:
        drafted = decode_logits(every, TOKENS[:6])
    finally:
        every._experts.draft = False
    assert every._experts.stats()["draft_substituted"] == 0
    assert np.array_equal(exact, drafted)
    every.close()


def test_self_draft_gives_the_greedy_tokens(converted):
    """Speculation with the self-draft (cache-conditional routing) under a budget: greedy output equals
    non-speculative decoding token for token; the self-draft ran."""
    path = converted("qwen3moe")
    prompt = b"Once upon a time"

    def greedy(**kw):
        llm = Llama(str(path), n_ctx=256, verbose=False, ram_budget_mb=BUDGET_MB, flash_expert_slots=3, **kw)
        out = []
        for t in llm.generate(llm.tokenize(prompt), temp=0.0):
            out.append(t)
            if len(out) == 32:
                break
        stats = llm.flash_stats()
        llm.close()
        return out, stats

    ref, _ = greedy(flash_speculative=False)
    got, stats = greedy(flash_speculative={"prompt_lookup": False})
    assert got == ref
    assert stats["experts"]["draft_splits"] > 0
    assert stats["speculative"]["drafted"] > 0


def test_plan_command_for_moe(converted):
    from click.testing import CliRunner

    from llamaflash.cli.cli import main

    path = converted("qwen3moe")
    r = CliRunner().invoke(main, ["plan", str(path), "--ram-budget-mb", "4000"])
    assert r.exit_code == 0, r.output
    assert "fits" in r.output and "minimum budget" in r.output


def test_steps_aside_once_stock_fits_with_its_own_batch(tiny_moe_factory):
    """Stock's need is the file, its vocabulary, KV cache, compute buffers and the runtime (no expert
    slots, no margin). The plan runs stock from the least budget that holds it at the smallest prefill
    batch, with the largest batch that fits; below it, experts are served (or the budget is refused)."""
    from llamaflash.planning.expert_plan import plan_experts, stock_need
    from llamaflash.planning.planner import UBATCH_CHOICES, default_disk

    path = tiny_moe_factory("qwen3moe")
    header = read_gguf_header(path)
    moe = read_moe_model(header)
    MiB = 1024 * 1024
    need = {u: sum(stock_need(header, moe, 256, u).values()) for u in (512, *UBATCH_CHOICES)}
    assert need[512] > need[UBATCH_CHOICES[-1]] and stock_need(header, moe, 256, 32)["model_file"] == moe.file_size
    least = need[UBATCH_CHOICES[-1]]
    plan = plan_experts(moe, header, least / MiB, n_ctx=256, disk=default_disk())
    assert plan.fits and plan.n_ubatch == UBATCH_CHOICES[-1] and "fit" in plan.notes[0]
    big = plan_experts(moe, header, need[512] / MiB, n_ctx=256, disk=default_disk())
    assert big.fits and big.n_ubatch == 512
    try:
        below = plan_experts(moe, header, (least - MiB) / MiB, n_ctx=256, disk=default_disk())
        assert not below.fits
    except RamBudgetError:
        pass
    # a user's n_ubatch is the only batch considered
    try:
        assert not plan_experts(moe, header, need[256] / MiB, n_ctx=256, disk=default_disk(), n_ubatch=512).fits
    except RamBudgetError:
        pass


def test_just_below_stock_need_runs_stock_while_its_rereads_cost_less(tiny_moe_factory, monkeypatch):
    """A budget a little short of stock's need: stock re-reads ~AMPLIFICATION x shortfall share of a
    token's expert bytes by page faults; when that (x FAULT_SLOWDOWN) is below the expert cache's
    predicted reads the model runs as stock, and beyond SHORTFALL_MAX of the routed experts never."""
    from llamaflash.planning import expert_plan
    from llamaflash.planning.planner import default_disk

    path = tiny_moe_factory("qwen3moe")
    header = read_gguf_header(path)
    moe = read_moe_model(header)
    MiB = 1024 * 1024
    routed = sum(layer.n_expert * layer.expert_bytes for layer in moe.layers)
    per_token = moe.n_used * sum(layer.expert_bytes for layer in moe.layers)
    share = 0.02
    assert expert_plan.stock_reread_per_token(moe, int(share * routed)) == pytest.approx(
        expert_plan.STOCK_REREAD_AMPLIFICATION * share * per_token, rel=1e-3
    )  # int() of the shortfall
    assert expert_plan.stock_reread_per_token(moe, int(0.2 * routed)) is None
    least = expert_plan.plan_experts(moe, header, 1000, n_ctx=256, disk=default_disk(), n_slots=moe.n_used)
    budget = least.min_budget_bytes  # n_used slots per layer: most of a token's experts are read
    served = expert_plan.plan_experts(moe, header, budget / MiB, n_ctx=256, disk=default_disk(), n_slots=moe.n_used)
    assert not served.fits and served.read_bytes_per_token > 0

    def short_of(shortfall):  # stock's need, `shortfall` bytes above the budget
        return lambda *a, **k: {"model_file": budget + shortfall}

    monkeypatch.setattr(expert_plan, "stock_need", short_of(int(share * routed)))
    near = expert_plan.plan_experts(moe, header, budget / MiB, n_ctx=256, disk=default_disk())
    assert near.fits and "short of the file" in near.notes[0]
    # stock there runs as llama-cpp-python would: its default prefill batch, or the user's
    assert near.n_ubatch == expert_plan.STOCK_DEFAULT_UBATCH
    mine = expert_plan.plan_experts(moe, header, budget / MiB, n_ctx=256, n_ubatch=32, disk=default_disk())
    assert mine.fits and mine.n_ubatch == 32
    monkeypatch.setattr(expert_plan, "stock_need", short_of(int(0.2 * routed)))
    far = expert_plan.plan_experts(moe, header, budget / MiB, n_ctx=256, disk=default_disk())
    assert not far.fits


#: Modules that loading a model must not import: gguf-py (yaml, numpy.ma, ...) and stdlib modules
#: only tuning and the command line need. They are anonymous memory the process keeps, and where a
#: budget lies at the edge of stock's resident need that memory costs page-cache re-reads.
LOAD_PATH_FORBIDDEN = ("gguf", "yaml", "numpy.ma", "importlib.metadata", "statistics")


def test_loading_under_a_budget_imports_neither_gguf_py_nor_tuning_modules(converted):
    path = converted("qwen3moe")
    code = (
        "import sys, json\n"
        "import llama_cpp\n"
        "from llamaflash import Llama\n"
        f"llm = Llama({str(path)!r}, n_ctx=128, ram_budget_mb={BUDGET_MB}, verbose=False)\n"
        "assert llm.flash_mode == 'stock', llm.flash_mode\n"
        "llm.close()\n"
        f"print(json.dumps([m for m in {LOAD_PATH_FORBIDDEN!r} if m in sys.modules]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_plan_explains_pinned_experts_per_layer(tiny_moe_factory):
    """The plan's text counts pinned experts per layer (the same in every layer), not over all layers."""
    from llamaflash.planning.expert_plan import plan_experts
    from llamaflash.planning.planner import default_disk

    path = tiny_moe_factory("qwen3moe")
    header = read_gguf_header(path)
    moe = read_moe_model(header)
    counts = {layer.layer: np.arange(moe.n_expert, 0, -1).astype(np.float32) for layer in moe.layers}
    plan = plan_experts(moe, header, 4000, n_ctx=256, disk=default_disk(), counts=counts, n_slots=6)
    assert not plan.fits and plan.n_slots == 6
    n_pin = plan.pinned_per_layer
    assert n_pin > 0 and all(len(p) == n_pin for p in plan.pinned.values()) and len(moe.layers) > 1
    assert f"({n_pin} pinned per layer)" in plan.explain()
