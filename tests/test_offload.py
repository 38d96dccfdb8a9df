"""Flash offload (csrc/offload/neuron_cache.*, the offload nodes of the sparse lane, plugin/runtime/offload.py): the
up and down_t rows come from flash through the neuron cache, and the results are bit-identical to
the in-memory sparse lane's (same neurons, same bytes, both reduced in cluster order: sparse_ffn.h),
whatever the cache holds: everything pinned, nothing pinned (every cluster read every
token), read-ahead on or off. Cache statistics add up; I/O errors become FlashIoError, never a
hang or wrong tokens.

The cache configuration is forced here through a hand-made plan (the planner's sizing is tested in
test_planner.py); `make_plan` mirrors the fields of planner.OffloadPlan the engine reads."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from llama_helpers import run_model
from offload_helpers import KW, make_plan

import llamaflash
from llamaflash.errors import FlashIoError
from llamaflash.files.sidecar import read_sidecar

N_GEN = 10


def _steps(llm, n_gen=N_GEN):
    run = run_model(llm, n_gen=n_gen)
    n_prompt = len(run.prompt_logits)
    return run, np.array(llm.scores[n_prompt : llm.n_tokens], dtype=np.float32)


@pytest.fixture(scope="module")
def in_memory(converted):
    model, _ = converted
    llm = llamaflash.Llama(model_path=str(model), flash_mode="sparse", flash_dense_up=False, **KW)
    run, steps = _steps(llm)
    llm.close()
    return run, steps


@pytest.mark.parametrize("hot_per_layer,prefetch", [(6, 1), (0, 0), (0, 1), (3, 1), (2, 2)])
def test_offload_matches_the_in_memory_sparse_lane(converted, in_memory, forced_plan, hot_per_layer, prefetch):
    model, sidecar = converted
    forced_plan(make_plan(sidecar, hot_per_layer, prefetch))
    llm = llamaflash.Llama(model_path=str(model), ram_budget_mb=64, **KW)
    assert llm.flash_mode == "offload"
    run, steps = _steps(llm)
    ref_run, ref_steps = in_memory
    # prefill: the dense lane over the streamed base-file views, bit-identical
    assert np.array_equal(run.prompt_logits, ref_run.prompt_logits)
    assert run.generated == ref_run.generated
    assert np.array_equal(ref_steps, steps)
    off = run.stats["offload"]
    assert off["plans"] == 2 * N_GEN
    assert off["clusters_needed"] == off["hits_hot"] + off["hits_cold"] + off["hits_prefetch"] + off["misses"]
    assert run.stats["sparse_lane_calls"] == 2 * N_GEN and run.stats["sparse_fallbacks"] == 0
    if hot_per_layer == 6:  # everything pinned: no flash traffic at decode
        assert off["bytes_read"] == 0 and off["hit_rate"] == 1.0
    else:
        assert off["bytes_read"] > 0
    if prefetch == 0:
        assert off["prefetched"] == 0 and off["hits_prefetch"] == 0
    llm.close()


@pytest.mark.parametrize("hot_per_layer", [0, 6])
def test_streamed_gate_matches_the_in_memory_sparse_lane(converted, in_memory, forced_plan, hot_per_layer):
    """The gate read from the base file every token (one layer ahead, dropped after its split) gives
    the results of the resident gate: same bytes, same kernels."""
    model, sidecar = converted
    forced_plan(make_plan(sidecar, hot_per_layer, 1, stream_gate=True))
    llm = llamaflash.Llama(model_path=str(model), ram_budget_mb=64, **KW)
    assert llm._flash.stream_gate
    run, steps = _steps(llm)
    assert run.stats["resident_ffn_bytes"] == 0  # the gate is a view of the base file, not a copy
    ref_run, ref_steps = in_memory
    assert np.array_equal(run.prompt_logits, ref_run.prompt_logits)
    assert run.generated == ref_run.generated
    assert np.array_equal(ref_steps, steps)
    off = run.stats["offload"]
    info = read_sidecar(sidecar)
    assert off["gate_streamed"] and off["gate_bytes_per_token"] == sum(
        lay.n_ff * lay.gate_row_bytes for lay in info.layers
    )
    assert run.stats["sparse_lane_calls"] == 2 * N_GEN and run.stats["sparse_fallbacks"] == 0
    llm.close()


def test_the_planner_gets_the_disk_profile(converted, forced_plan, monkeypatch, tmp_path):
    """Llama(ram_budget_mb=...) plans with flash_disk_profile, by default the profile saved for the
    sidecar's disk (none here: the planner's built-in default)."""
    model, sidecar = converted
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no saved profiles
    calls = []
    forced_plan(make_plan(sidecar, 0, 1), calls)
    llamaflash.Llama(model_path=str(model), ram_budget_mb=64, **KW).close()
    profile = {"points": [{"request_kib": 4, "depth": 1, "iops": 1000.0, "mb_s": 4.1}], "source": "given"}
    llamaflash.Llama(model_path=str(model), ram_budget_mb=64, flash_disk_profile=profile, **KW).close()
    assert calls[0]["disk"] is None and calls[1]["disk"] is profile


def test_cold_slots_are_reused_across_tokens(converted, forced_plan):
    """With room for every cluster in the cold region and no pinning, the first token reads what it
    needs and later tokens find it there (LRU never has to replace anything)."""
    model, sidecar = converted
    forced_plan(make_plan(sidecar, 0, prefetch_layers=0, extra_cold=6))
    llm = llamaflash.Llama(model_path=str(model), ram_budget_mb=64, **KW)
    run = run_model(llm, n_gen=N_GEN)
    off = run.stats["offload"]
    assert off["misses"] <= 12  # 2 layers x 6 clusters, each read once
    assert off["hits_cold"] == off["clusters_needed"] - off["misses"]
    llm.close()


def test_io_error_raises_flash_io_error(converted, forced_plan, tmp_path):
    """The sidecar truncated under a running model: the next decode step's reads come back short;
    eval raises FlashIoError naming the file (no hang, no token produced from bad bytes)."""
    model, sidecar = converted
    local = tmp_path / "m.flash.gguf"
    shutil.copy(sidecar, local)
    forced_plan(make_plan(local, 0, prefetch_layers=0))
    llm = llamaflash.Llama(model_path=str(model), sidecar_path=str(local), ram_budget_mb=64, **KW)
    tokens = llm.tokenize(b"hello there")
    llm.eval(tokens)
    os.truncate(local, 4096)
    with pytest.raises(FlashIoError, match="m.flash.gguf"):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    llm.close()


def test_offload_refuses_what_it_cannot_do(converted, tmp_path):
    model, _ = converted
    with pytest.raises(ValueError, match="sparse lane"):
        llamaflash.Llama(model_path=str(model), ram_budget_mb=64, flash_mode="dense", **KW)
    with pytest.raises(ValueError, match="positive"):
        llamaflash.Llama(model_path=str(model), ram_budget_mb=0, **KW)
    bare = tmp_path / "bare.gguf"
    shutil.copy(model, bare)
    with pytest.raises(llamaflash.errors.SidecarNotFoundError, match="llamaflash convert"):
        llamaflash.Llama(model_path=str(bare), ram_budget_mb=64, **KW)


def test_a_prompt_empties_the_cold_region_and_frees_its_compute_pages(converted, forced_plan):
    """A prompt batch computes no cluster: the engine empties the cold region before it and frees its
    pages (NeuronCache::release_cold), and Llama.eval frees the compute pages the prompt wrote once it
    is evaluated (csrc/backend/prompt_buffers.h), so that the planner may let the two share memory. A
    conversation continued past a decode (a second prompt batch, then decode again) gives the logits
    of the in-memory sparse lane, bit for bit."""
    model, sidecar = converted
    forced_plan(make_plan(sidecar, 0, prefetch_layers=1, extra_cold=6))
    llm = llamaflash.Llama(model_path=str(model), ram_budget_mb=64, flash_speculative=False, **KW)
    ref = llamaflash.Llama(model_path=str(model), flash_mode="sparse", flash_dense_up=False, **KW)
    more = llm.tokenize(b" and every morning she walked down to the river to count the boats", add_bos=False)
    assert len(more) > llm._flash.sparse_config["max_tokens"]  # a prompt batch: the dense lane
    for m in (llm, ref):
        run_model(m, n_gen=N_GEN)
        m.eval(more)
        for _ in range(3):
            m.eval([int(np.argmax(m.scores[m.n_tokens - 1]))])
    assert llm.n_tokens == ref.n_tokens
    assert np.array_equal(np.asarray(llm.scores[: llm.n_tokens]), np.asarray(ref.scores[: ref.n_tokens]))
    off = llm.flash_stats()["offload"]
    assert off["cold_releases"] == 1  # the first prompt found the cold region empty; the second emptied it
    assert off["misses"] > 0 and off["prompt_pages_freed_bytes"] > 0
    freed = off["prompt_pages_freed_bytes"]
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])  # a decode step: nothing more to free
    assert llm.flash_stats()["offload"]["prompt_pages_freed_bytes"] == freed
    llm.close()
    ref.close()


@pytest.mark.parametrize("stream_gate", [False, True])
def test_whole_layers_take_the_memory_the_plan_gives_the_cache(converted, stream_gate):
    """deterministic=True under a budget (runtime/offload.stream_layers): two cold layer slots (the
    layer computing, the one read ahead) and as many pinned layers as the rest of the plan's cache
    memory holds, the largest first; two slots even where that memory holds fewer."""
    import types

    from llamaflash import _native
    from llamaflash.runtime.offload import STREAM_PREFETCH_LAYERS, stream_layers

    _, sidecar = converted
    info = read_sidecar(sidecar)
    parts = [
        max(lay.n_ff * lay.gate_row_bytes for lay in info.layers) if stream_gate else 0,
        max(lay.n_ff * lay.up_row_bytes for lay in info.layers),
        max(lay.n_embd * lay.base_down_row_bytes for lay in info.layers),
    ]
    slot = _native.layer_stream_slot_bytes(*parts)
    assert slot >= sum(parts) and slot % 4096 == 0
    for n_slots in (1, 2, 3, 100):
        plan = types.SimpleNamespace(stream_gate=stream_gate, hot_slots=n_slots, cold_slots=0, slot_bytes=slot)
        hot, cold = stream_layers(plan, info)
        assert cold == 1 + STREAM_PREFETCH_LAYERS == 2
        assert hot == sorted(set(hot)) and len(hot) == min(len(info.layers), max(0, n_slots - 2))
        assert all(0 <= p < len(info.layers) for p in hot)
