"""The in-memory default (flash_mode=None): stock llama.cpp, untouched, unless a measurement stored
for this sidecar on this machine showed the sparse lane faster; then the sparse lane, fixed at load.

Reference: stock llama_cpp.Llama on the same synthetic model (logits bit-identical when the default
runs stock, since then nothing of llamaflash is in the graph), and the explicit flash_mode="sparse"
(bit-identical logits when the default decided sparse: the same lane, fixed for the whole run)."""

from __future__ import annotations

import json
import os
import shutil

import llama_cpp
import numpy as np
import pytest
from llama_helpers import run_model
from synth import FAST_CONVERT

import llamaflash
from llamaflash.converters import convert
from llamaflash.planning import lane_decision

KW = dict(n_ctx=128, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False, seed=0)


@pytest.fixture()
def converted(tiny_model_factory, tmp_path):
    """A private copy of a synthetic SwiGLU model with a calibrated sidecar (the tuning file is
    written beside the sidecar, so every test gets its own) and a bundle-only sidecar."""
    model = tmp_path / "m.gguf"
    shutil.copy(tiny_model_factory(weight_type="Q8_0", n_embd=96, n_ff=192), model)
    sidecar = convert(model, progress=False, sparsity=0.5, measure_quality=False, **FAST_CONVERT)
    v1 = convert(model, tmp_path / "m.v1.flash.gguf", progress=False, profile=False)
    return model, sidecar, v1


def _sparse_decision(machine=None):
    return lane_decision.Decision(
        lane_decision.SPARSE, True, "measured faster (test)", machine or lane_decision.machine_key(), 1.2, 1.0
    )


def test_unmeasured_default_is_stock_and_untouched(converted):
    model, sidecar, _ = converted
    stock = run_model(llama_cpp.Llama(model_path=str(model), **KW), n_gen=8)
    llm = llamaflash.Llama(model_path=str(model), **KW)
    assert llm.flash_mode == "stock" and llm._flash is None
    run = run_model(llm, n_gen=8)
    assert np.array_equal(run.prompt_logits, stock.prompt_logits) and run.generated == stock.generated
    decision = llm.flash_stats()["decision"]
    assert decision["lane"] == "stock" and not decision["measured"] and "llamaflash tune" in decision["reason"]
    assert llm.flash_stats()["sidecar"] == str(sidecar)


def test_stored_sparse_decision_runs_the_sparse_lane_deterministically(converted):
    model, sidecar, _ = converted
    lane_decision.store_decision(sidecar, _sparse_decision())
    forced = run_model(llamaflash.Llama(model_path=str(model), flash_mode="sparse", **KW), n_gen=8)
    runs = []
    for _ in range(2):
        llm = llamaflash.Llama(model_path=str(model), **KW)
        assert llm.flash_mode == "sparse" and "autotune" not in llm._flash.sparse_config
        runs.append(run_model(llm, n_gen=8))
        assert llm.flash_stats()["decision"]["lane"] == "sparse"
        assert llm.flash_stats()["sparse_lane_calls"] > 0
        llm.close()
    for run in runs:
        assert np.array_equal(run.prompt_logits, forced.prompt_logits) and run.generated == forced.generated


def test_decision_is_per_machine_and_per_sidecar_version(converted):
    model, sidecar, _ = converted
    lane_decision.store_decision(sidecar, _sparse_decision(machine="another-machine"))
    assert lane_decision.stored_decision(sidecar).lane == "stock"
    lane_decision.store_decision(sidecar, _sparse_decision())
    entries = json.loads(lane_decision.tuning_path(sidecar).read_text())
    assert set(entries) == {"another-machine", lane_decision.machine_key()}  # other machines' entries kept
    assert lane_decision.stored_decision(sidecar).lane == "sparse"
    st = os.stat(sidecar)
    os.utime(sidecar, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a re-converted sidecar
    stale = lane_decision.stored_decision(sidecar)
    assert stale.lane == "stock" and "earlier version" in stale.reason
    lane_decision.tuning_path(sidecar).write_text("{not json")
    assert lane_decision.stored_decision(sidecar).lane == "stock"


def test_bundle_only_sidecar_and_embeddings_run_stock(converted):
    model, sidecar, v1 = converted
    lane_decision.store_decision(sidecar, _sparse_decision())
    llm = llamaflash.Llama(model_path=str(model), sidecar_path=str(v1), **KW)
    assert llm.flash_mode == "stock" and "no sparsity thresholds" in llm.flash_stats()["decision"]["reason"]
    llm.close()
    llm = llamaflash.Llama(model_path=str(model), embedding=True, **KW)
    assert llm.flash_mode == "stock" and "exact" in llm.flash_stats()["decision"]["reason"]
    llm.close()


def test_decide_rule():
    stock = {"decode": [100, 102, 98], "prefill": [500, 510, 490]}
    faster = {"decode": [104, 106, 103], "prefill": [500, 505, 499]}
    assert lane_decision.decide(stock, faster, "m").lane == "sparse"
    slightly = {"decode": [101, 102, 101], "prefill": [500, 505, 499]}  # within the noise margin
    assert lane_decision.decide(stock, slightly, "m").lane == "stock"
    slow_prefill = {"decode": [120, 120, 120], "prefill": [480, 480, 480]}
    d = lane_decision.decide(stock, slow_prefill, "m")
    assert d.lane == "stock" and d.measured and d.decode_ratio == pytest.approx(120 / 100)


def test_measure_runs_both_engines_and_stores(converted):
    """One rep of each engine in fresh processes (the bench worker); the stored decision is whatever the
    rule says of the measured speeds."""
    model, sidecar, _ = converted
    lines = []
    decision = lane_decision.measure(model, sidecar, reps=1, max_tokens=8, echo=lines.append)
    assert len(lines) == 2 and decision.measured
    stock, sparse = decision.detail["stock"], decision.detail["sparse"]
    assert len(stock["decode"]) == len(sparse["decode"]) == 1 and min(stock["decode"] + sparse["decode"]) > 0
    assert decision.lane == lane_decision.decide(stock, sparse, decision.machine).lane
    assert lane_decision.stored_decision(sidecar).as_dict() == decision.as_dict()


def test_demo_in_memory_part_times_stock_and_the_default_with_the_same_harness(converted):
    """`llamaflash demo`'s in-memory comparison: stock and llamaflash's default, fresh worker processes
    (the benchmarks' harness, as `tune`), two alternated runs each, medians and stock's noise floor;
    with no stored measurement the default runs as stock and generates stock's tokens. The verdict
    states the noise floor and never claims more than was measured."""
    from llamaflash.cli import demo

    model, sidecar, _ = converted
    lines = []
    mem = demo._in_memory(model, sidecar, n_gen=4, n_threads=1, reps=2, echo=lines.append)
    stock, default = mem["stock"], mem["llamaflash"]
    assert stock["n_prompt"] == default["n_prompt"] == lane_decision.SPEED_PROMPT_TOKENS
    assert stock["decode_tps"] > 0 and default["decode_tps"] > 0 and len(stock["tokens"]) == 5
    assert default["flash_stats"]["mode"] == "stock" and default["tokens"] == stock["tokens"]
    assert lines[-1].startswith("      llamaflash default: running as stock: the sparse lane has not been measured")
    assert stock["runs"] == default["runs"] == 2 and stock["decode_noise"] is not None
    assert stock["ttft_s"] > 0 and default["ttft_s"] > 0
    text = demo.verdict(None, (), mem)
    assert len(text) == 1 and "(stock here)" in text[0] and "alternated runs" in text[0]
    assert "spread" in text[0] and "never slower" not in text[0]
