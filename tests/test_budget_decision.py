"""Stepping aside when the model fits (plugin/planning/budget_decision.py): a RAM budget that holds what stock
llama.cpp keeps resident runs stock llama.cpp untouched (the same tokens as llama_cpp.Llama), one
MiB less runs flash offload, and the boundary is the sum of measured/planned parts (the model file's
tensors, llama.cpp's share at the chosen n_ubatch, the runtime and the planner's margin), never a
fixed model size. Visible in flash_stats()["decision"] and in `llamaflash plan`."""

from __future__ import annotations

import llama_cpp
import pytest
from click.testing import CliRunner
from offload_helpers import make_plan  # converted and forced_plan are conftest fixtures

import llamaflash
from llamaflash.cli.cli import main
from llamaflash.files.gguf_model import read_base_model
from llamaflash.files.sidecar import validate_pair
from llamaflash.planning import budget_decision, planner

MiB = planner.MiB
KW = dict(n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False, seed=0)


@pytest.fixture(scope="module")
def pair(converted):  # noqa: F811
    model, sidecar = converted
    base = read_base_model(str(model))
    return model, sidecar, base.header, validate_pair(model, sidecar, model=base)


def test_the_need_is_the_sum_of_its_parts(pair):
    model, _, header, info = pair
    parts = budget_decision.stock_need(header, info, 256, 64)
    # every tensor of the file: this model's vocabulary is smaller than n_ctx, so token_embd counts whole
    assert parts["model_weights"] == sum(t.nbytes for t in header.tensors)
    assert parts["model_weights"] <= model.stat().st_size
    share = planner.llama_share(header, info, 256, 64)
    assert {k: parts[k] for k in ("llama_vocab", "kv_cache", "compute_buffers")} == {
        k: share[k] for k in ("llama_vocab", "kv_cache", "compute_buffers")
    }
    assert parts["runtime"] == planner.RUNTIME_RSS_BYTES
    rest = sum(v for k, v in parts.items() if k != "margin")
    assert parts["margin"] == planner.MARGIN_FIXED_BYTES + int(planner.MARGIN_FRACTION * rest)
    # a longer context needs more (its KV cache), a given n_ubatch is honoured
    assert sum(budget_decision.stock_need(header, info, 4096, 64).values()) > sum(parts.values())
    assert budget_decision.decide(header, info, 4096, 256, n_ubatch=32).n_ubatch == 32


def test_the_boundary(pair):
    """The least stock budget is the need at its own n_ubatch; one MiB less runs offload."""
    _, _, header, info = pair
    first = next(b for b in range(50, 2000) if budget_decision.decide(header, info, b, 256).stock)
    at = budget_decision.decide(header, info, first, 256)
    below = budget_decision.decide(header, info, first - 1, 256)
    assert first - 1 < at.stock_need_bytes / MiB <= first
    need = budget_decision.stock_need(header, info, 256, at.n_ubatch, use_mmap=at.use_mmap)
    assert sum(need.values()) == at.stock_need_bytes
    assert at.reason.startswith("running as stock") and f"{at.stock_need_bytes / MiB:.0f} MiB" in at.reason
    assert below.lane == budget_decision.OFFLOAD and below.reason.startswith("flash offload")


def test_the_two_ways_stock_holds_its_weights(pair):
    """Read into memory (use_mmap=False): every tensor of the file and a margin without page-cache
    headroom; mapped: the planner's llama.cpp share and the full margin. In memory is taken where it
    fits, unless the caller fixed use_mmap."""
    _, _, header, info = pair
    in_memory = budget_decision.stock_need(header, info, 256, 64, use_mmap=False)
    assert in_memory["model_weights"] == sum(t.nbytes for t in header.tensors)
    rest = sum(v for k, v in in_memory.items() if k != "margin")
    assert in_memory["margin"] == planner.IN_MEMORY_MARGIN_FIXED_BYTES + int(planner.MARGIN_FRACTION * rest)
    mapped_need = sum(budget_decision.stock_need(header, info, 256, 64).values())
    in_memory_need = sum(in_memory.values())
    assert in_memory_need < mapped_need  # this model's token_embd is small: the margin decides
    between = (in_memory_need + mapped_need) / 2 / MiB
    d = budget_decision.decide(header, info, between, 256, n_ubatch=64)
    assert d.stock and not d.use_mmap and d.stock_need_bytes == in_memory_need
    assert "read into memory" in d.reason and "use_mmap=False" in d.reason
    # the caller's use_mmap is honoured: mapped does not fit there, in memory is the only way with False
    assert not budget_decision.decide(header, info, between, 256, n_ubatch=64, use_mmap=True).stock
    assert budget_decision.decide(header, info, between, 256, n_ubatch=64, use_mmap=False).stock
    big = budget_decision.decide(header, info, 4096, 256, n_ubatch=64, use_mmap=True)
    assert big.stock and big.use_mmap and "mapped from the file" in big.reason
    # either way a decoded token reads the same weights: the mapped accounting's model_weights
    mapped_weights = budget_decision.stock_need(header, info, 256, 64)["model_weights"]
    assert d.weights_read_bytes == big.weights_read_bytes == mapped_weights
    assert budget_decision.stock_decode_tok_s(d) == budget_decision.stock_decode_tok_s(big)


def test_more_memory_never_turns_stock_into_offload(pair):
    _, _, header, info = pair
    lanes = [budget_decision.decide(header, info, b, 1024).lane for b in range(50, 600, 2)]
    first_stock = lanes.index("stock")
    assert set(lanes[first_stock:]) == {"stock"} and set(lanes[:first_stock]) == {"offload"}


def test_a_budget_that_holds_the_model_runs_stock(pair):
    model, sidecar, header, info = pair
    d = budget_decision.decide(header, info, 4096, KW["n_ctx"])
    assert d.stock
    llm = llamaflash.Llama(model_path=str(model), ram_budget_mb=4096, **KW)
    assert llm.flash_mode == "stock" and llm.flash_plan is None and llm.draft_model is None
    decision = llm.flash_stats()["decision"]
    assert decision["lane"] == "stock" and decision["reason"] == d.reason
    assert decision["detail"]["stock_need_bytes"] == d.stock_need_bytes
    assert not d.use_mmap and llm.model_params.load_mode == llama_cpp.LLAMA_LOAD_MODE_NONE  # read into memory
    ref = llama_cpp.Llama(model_path=str(model), n_ubatch=d.n_ubatch, **KW)
    prompt = llm.tokenize(b"Once upon a time")
    take = lambda m: [t for _, t in zip(range(16), m.generate(prompt, temp=0, top_k=1))]  # noqa: E731
    assert take(llm) == take(ref)  # stock llama.cpp, untouched: the same tokens
    llm.close()
    ref.close()


def test_offload_below_the_need_and_when_forced(pair, forced_plan):  # noqa: F811
    model, sidecar, _, _ = pair
    forced_plan(make_plan(sidecar, 3, prefetch_layers=1))
    small = llamaflash.Llama(model_path=str(model), ram_budget_mb=64, flash_speculative=False, **KW)
    assert small.flash_mode == "offload"
    assert small.flash_stats()["decision"]["lane"] == "offload"
    assert small.flash_stats()["decision"]["reason"].startswith("flash offload: the budget of 64 MiB is below")
    small.close()
    forced = llamaflash.Llama(
        model_path=str(model), ram_budget_mb=4096, flash_mode="sparse", flash_speculative=False, **KW
    )
    assert forced.flash_mode == "offload"
    forced.close()


def test_plan_command_shows_the_decision(pair):
    model, sidecar, _, _ = pair
    out = CliRunner().invoke(main, ["plan", str(model), "--sidecar", str(sidecar), "--ram-budget-mb", "4096"])
    assert out.exit_code == 0, out.output
    assert out.output.startswith("decision: running as stock")
    assert "what flash_mode='sparse' would run" in out.output
