"""Same model, sidecar, settings and machine: the same tokens in every run, and exact embeddings.

Reference: a second fresh process with the same settings (determinism), and stock llama_cpp.Llama
(embeddings, and the default that runs stock). Real SmolLM2-135M with its calibrated sidecar
(conftest.smollm2_sidecar), 2 threads, 128 greedy tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from llama_helpers import run_in_subprocess

import llamaflash

pytestmark = pytest.mark.real_model

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
N_GEN = 128


def _generate_in_fresh_process(model: Path, sidecar: Path, settings: dict) -> list:
    out = run_in_subprocess(f"""
        import json
        import llamaflash
        llm = llamaflash.Llama(model_path={str(model)!r}, sidecar_path={str(sidecar)!r}, n_ctx=512, n_threads=2,
                               n_threads_batch=2, verbose=False, **{settings!r})
        r = llm.create_chat_completion([{{"role": "user", "content": {PROMPT!r}}}], max_tokens={N_GEN},
                                       temperature=0.0)
        print(json.dumps({{"text": r["choices"][0]["message"]["content"], "mode": llm.flash_mode}}))
    """)
    return [out["mode"], out["text"]]


@pytest.mark.parametrize("settings", [{}, {"flash_mode": "sparse"}], ids=["default", "sparse"])
def test_two_fresh_processes_generate_the_same_tokens(smollm2_sidecar, settings):
    model, sidecar = smollm2_sidecar
    first = _generate_in_fresh_process(model, sidecar, settings)
    second = _generate_in_fresh_process(model, sidecar, settings)
    assert first == second
    assert len(first[1]) > 100  # a long generation, not an early stop


def test_embeddings_are_exact(smollm2_sidecar, tmp_path):
    """embedding=True never runs the sparse lane, even where the sparse lane is the measured default."""
    from llamaflash.planning import lane_decision

    model, cached = smollm2_sidecar
    sidecar = tmp_path / cached.name
    shutil.copy(cached, sidecar)
    lane_decision.store_decision(
        sidecar,
        lane_decision.Decision(
            lane_decision.SPARSE, True, "measured faster (test)", lane_decision.machine_key(), 1.2, 1.0
        ),
    )
    kw = dict(embedding=True, n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False)
    texts = ["The lighthouse keeper climbed the stairs.", "def add(a, b): return a + b"]
    stock = llama_cpp.Llama(model_path=str(model), **kw)
    ref = [np.array(stock.embed(t)) for t in texts]
    stock.close()
    llm = llamaflash.Llama(model_path=str(model), sidecar_path=str(sidecar), **kw)
    assert llm.flash_mode == "stock"
    got = [np.array(llm.embed(t)) for t in texts]
    for a, b in zip(ref, got):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("settings", [{"flash_mode": "dense"}, {"flash_mode": "sparse"}], ids=["dense", "sparse"])
def test_verbose_false_is_silent(tiny_model_factory, tmp_path, settings):
    """verbose=False means no line on stdout or stderr, as in stock, also while llamaflash repacks its
    weights through ggml (pure Q4_K: ggml-cpu repacks it and logs every tensor at info level)."""
    from synth import FAST_CONVERT

    from llamaflash.converters import convert

    model = tmp_path / "m.gguf"
    shutil.copy(tiny_model_factory(weight_type="Q4_K", n_embd=256, n_ff=512), model)
    sidecar = convert(model, progress=False, sparsity=0.5, measure_quality=False, **FAST_CONVERT)
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import llamaflash
        llm = llamaflash.Llama(model_path={str(model)!r}, sidecar_path={str(sidecar)!r}, n_ctx=128, verbose=False,
                               **{settings!r})
        llm.create_completion("hello", max_tokens=4)
        llm.close()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
