"""Speculative decoding (plugin/runtime/speculative.py) under a RAM budget: drafted tokens verified in one
batch on the offload lane give exactly the tokens of non-speculative decoding (greedy), through
generate, completion, streaming, stop sequences and logprobs; verify batches never leave the offload
lane; a flash read error during a verify pass raises FlashIoError and reset() recovers.

Exactness rests on two properties tested here end to end: the offload lane computes each token of a
batch as alone (cluster-order reduction, sparse_ffn.h) and the batch-invariant numerics under a budget
(flash attention, plain weights) do the same for llama.cpp's part, for batches up to
BATCH_INVARIANT_MAX tokens."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
from offload_helpers import PROMPT, SELF_DRAFT, greedy, make_plan

import llamaflash
from llamaflash.errors import FlashIoError
from llamaflash.runtime import speculative

KW = dict(n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False, seed=0)
LOOKUP = {"adaptive": False, "max_draft": 6, "self_draft": False, "max_ngram": 1}


@pytest.fixture
def offload(converted, forced_plan):  # noqa: F811
    """offload(speculative, **kw) -> a Llama under a forced plan: 3 of 6 clusters pinned per layer,
    the rest read from flash (so a self-draft sees half of each layer)."""
    model, sidecar = converted
    forced_plan(make_plan(sidecar, 3, prefetch_layers=1))
    made = []

    def make(spec, sidecar_path=None, **kw):
        llm = llamaflash.Llama(
            model_path=str(model), sidecar_path=sidecar_path, ram_budget_mb=64, flash_speculative=spec, **{**KW, **kw}
        )
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


@pytest.fixture
def reference(offload):
    llm = offload(False)
    return greedy(llm)


@pytest.mark.parametrize("spec", [SELF_DRAFT, LOOKUP, True], ids=["self-draft", "prompt-lookup", "default"])
def test_greedy_speculation_gives_the_non_speculative_tokens(offload, reference, spec):
    llm = offload(spec)
    assert greedy(llm) == reference
    s = llm.flash_stats()["speculative"]
    assert s["enabled"] and s["passes"] > 0
    if spec is SELF_DRAFT:
        # half the clusters resident: some drafts right, some wrong (both paths of the loop ran)
        assert 0 < s["accepted"] < s["drafted"]
        assert s["draft_tokens_evaluated"] >= s["drafted"]
        assert 0 < s["draft_resident_fraction"] < 1
        assert s["tokens_per_pass"] > 1
    if spec is LOOKUP:
        assert s["by_source"]["prompt_lookup"]["drafted"] > 0


def test_a_users_draft_model_is_honoured(offload, reference):
    llm = offload(None, draft_model=LlamaPromptLookupDecoding(max_ngram_size=1, num_pred_tokens=3))
    assert llm._logits_all is False  # llama-cpp-python's own draft path would force n_ctx x n_vocab logits
    assert greedy(llm) == reference
    s = llm.flash_stats()["speculative"]
    assert s["by_source"]["user"]["drafted"] > 0 and set(s["by_source"]) <= {"user", "none"}


def test_verify_batches_stay_on_the_offload_lane(offload):
    llm = offload(SELF_DRAFT)
    prompt = llm.tokenize(PROMPT.encode())
    llm.eval(prompt[:-1])
    llm.reset_flash_stats()
    out = []
    for tok in llm.generate(prompt[-1:], temp=0, top_k=1, reset=False):  # decode only from here
        out.append(tok)
        if len(out) >= 16:
            break
    stats = llm.flash_stats()
    s = stats["speculative"]
    assert s["verify_tokens_mean"] > 1  # batches of 1 + k were verified ...
    assert stats["dense_lane_calls"] == 0 and stats["sparse_fallbacks"] == 0  # ... all on the offload lane
    assert s["verify_tokens_mean"] <= speculative.BATCH_INVARIANT_MAX


def test_completion_streaming_stop_and_logprobs(offload):
    plain = offload(False, logits_all=True)
    spec = offload(SELF_DRAFT, logits_all=True)
    ref = plain.create_completion(PROMPT, max_tokens=24, temperature=0, logprobs=2)
    got = spec.create_completion(PROMPT, max_tokens=24, temperature=0, logprobs=2)
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert got["choices"][0]["logprobs"]["tokens"] == ref["choices"][0]["logprobs"]["tokens"]
    np.testing.assert_array_equal(
        got["choices"][0]["logprobs"]["token_logprobs"], ref["choices"][0]["logprobs"]["token_logprobs"]
    )
    text = ref["choices"][0]["text"]
    stop = text[len(text) // 2 :][:3]  # a stop sequence inside the reference text
    if stop.strip():
        want = plain.create_completion(PROMPT, max_tokens=24, temperature=0, stop=[stop])["choices"][0]
        got = spec.create_completion(PROMPT, max_tokens=24, temperature=0, stop=[stop])["choices"][0]
        assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"] == "stop"

        def stream(llm):
            return [
                c["choices"][0]["text"]
                for c in llm.create_completion(PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True)
            ]

        assert stream(spec) == stream(plain)  # the same pieces, as they are accepted


def test_sampling_with_speculation_is_reproducible(offload):
    """Under sampling every token is drawn from the target's distribution at its position (the
    draft only sets how many positions a pass computes): the same seed gives the same text."""
    a = offload(False).create_completion(PROMPT, max_tokens=24, temperature=0.8, seed=7)["choices"][0]["text"]
    b = offload(SELF_DRAFT).create_completion(PROMPT, max_tokens=24, temperature=0.8, seed=7)["choices"][0]["text"]
    assert a == b


def test_flash_read_error_during_verify_then_reset(converted, offload, reference, forced_plan, tmp_path):  # noqa: F811
    _, sidecar = converted
    local = tmp_path / "m.flash.gguf"
    shutil.copy(sidecar, local)
    good = local.read_bytes()
    # nothing pinned, no read-ahead: every verify pass reads (the reference was made with another
    # cache shape: the tokens do not depend on it)
    forced_plan(make_plan(local, 0, prefetch_layers=0))
    llm = offload(SELF_DRAFT, sidecar_path=str(local))
    llm.eval(llm.tokenize(PROMPT.encode()))
    os.truncate(local, 4096)
    with pytest.raises(FlashIoError, match="m.flash.gguf"):
        greedy(llm)
    with open(local, "r+b") as f:  # the same file back (same inode), as after a transient error
        f.write(good)
    llm.reset()
    assert greedy(llm) == reference


def test_speculation_off_in_memory_by_default(converted):  # noqa: F811
    model, _ = converted
    llm = llamaflash.Llama(model_path=str(model), flash_mode="sparse", **KW)
    assert llm.flash_stats()["speculative"]["enabled"] is False
    assert llm.draft_model is None
    llm.close()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max_draft"):
        speculative.SpeculativeSettings.from_argument({"max_draft": speculative.BATCH_INVARIANT_MAX})
    with pytest.raises(ValueError, match="unknown"):
        speculative.SpeculativeSettings.from_argument({"k": 3})
    with pytest.raises(TypeError, match="flash_speculative"):
        speculative.SpeculativeSettings.from_argument("yes")
    assert speculative.SpeculativeSettings.from_argument(False) is None


def test_prompt_lookup_takes_the_most_recent_longest_match():
    ctx = np.array([5, 1, 2, 9, 9, 1, 2, 7, 7, 3, 1, 2], dtype=np.intc)
    # "1 2" occurred at 1 and 5; the most recent continues 7 7 3
    assert speculative.prompt_lookup(ctx, 2, 3).tolist() == [7, 7, 3]
    assert speculative.prompt_lookup(np.array([1, 2, 3], dtype=np.intc), 3, 4).size == 0


def test_default_speculation_says_why_each_source_drafts_or_not(offload, reference):
    """The adaptive controller (tests/test_draft_control.py has its decisions on simulated costs):
    the default gives the non-speculative tokens and names a state and a reason per source."""
    llm = offload(True)
    assert greedy(llm) == reference
    s = llm.flash_stats()["speculative"]
    assert set(s["why"]) == {"user", "prompt_lookup:3", "prompt_lookup:2", "prompt_lookup:1", "self_draft"}
    # "off for one pass:": the pass that re-measures the rate without drafts (one in 32)
    assert all(why.startswith(("on:", "off:", "off for one pass:")) for why in s["why"].values()), s["why"]
    assert s["why"]["user"] == "off: no draft_model given"
    sources = s["control"]["sources"]
    assert sources["self_draft"]["state"] in ("on", "off")  # attached: the gate is resident in this plan
    assert s["control"]["passes"] >= s["passes"]


def test_real_model_greedy_speculation_is_exact(smollm2_sidecar):
    """SmolLM2-135M with its calibrated sidecar, 48 MiB above the planner's minimum (about half the
    clusters pinned, the rest read from flash): self-drafted, prompt-lookup and default speculation
    give the non-speculative greedy tokens."""
    from llamaflash.planning.planner import MiB, plan_offload

    model, sidecar = smollm2_sidecar
    low = plan_offload(str(model), str(sidecar), 10_000, n_ctx=256).least_budget_bytes
    prompt = (
        "Rewrite with a list comprehension:\n\ndef squares(xs):\n    out = []\n    for x in xs:\n"
        "        out.append(x * x)\n    return out\n\nAnswer:\n"
    )
    runs = {}
    for name, spec in (("off", False), ("self", SELF_DRAFT), ("lookup", LOOKUP), ("default", True)):
        # flash_mode="sparse": offload (this budget would hold all of SmolLM2 for stock)
        llm = llamaflash.Llama(
            model_path=str(model),
            sidecar_path=str(sidecar),
            ram_budget_mb=low / MiB + 48,
            flash_speculative=spec,
            flash_mode="sparse",
            # the gate resident (a self-draft needs it): left to the planner, a streamed gate with every
            # cluster resident predicts the faster decode at this budget
            flash_stream_gate=False,
            **KW,
        )
        runs[name] = (greedy(llm, prompt, 48), llm.flash_stats())
        llm.close()
    for name in ("self", "lookup", "default"):
        assert runs[name][0] == runs["off"][0], name
    s = runs["self"][1]["speculative"]
    assert s["accepted"] > 0 and s["drafted"] > s["accepted"]
    assert runs["self"][1]["offload"]["bytes_read"] > 0


def test_self_draft_is_off_where_every_cluster_is_resident(converted, forced_plan):  # noqa: F811
    """With every cluster pinned a self-draft computes what a plain pass computes (nothing to skip), so
    a draft token would cost a whole pass: the source is off from the start, and says why."""
    model, sidecar = converted
    forced_plan(make_plan(sidecar, 1 << 20))  # every cluster of every layer pinned
    llm = llamaflash.Llama(model_path=str(model), ram_budget_mb=64, flash_speculative=True, **KW)
    try:
        s = llm.flash_stats()["speculative"]
        assert s["why"]["self_draft"] == (
            "off: self-draft off: every cluster is resident under this budget (a draft would cost a full pass)"
        )
        assert s["why"]["prompt_lookup:1"].startswith(("on:", "off:"))  # prompt lookup still decides itself
    finally:
        llm.close()


def test_default_speculation_is_off_where_every_cluster_is_resident(converted, forced_plan):  # noqa: F811
    """On by default under a budget, speculation is off where the plan reads nothing per token (the pass
    is compute-bound, as in memory): the default is then the non-speculative configuration, and says why."""
    model, sidecar = converted
    forced_plan(make_plan(sidecar, 1 << 20))
    llm = llamaflash.Llama(model_path=str(model), ram_budget_mb=64, **KW)
    try:
        s = llm.flash_stats()["speculative"]
        assert s["enabled"] is False and s["reason"].startswith("off by default: every cluster is resident")
        assert llm.draft_model is None
    finally:
        llm.close()
