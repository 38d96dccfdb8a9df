"""Shared pytest fixtures.

Synthetic models (see ``synth.py``) are session-scoped and shared between tests: treat
them as read-only, and copy one into the test's own ``tmp_path`` before writing anything
beside it (a sidecar, say).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from synth import TinyModelSpec, write_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(**params) -> Path``: a synthetic llama GGUF for :class:`synth.TinyModelSpec`
    parameters (n_layer, n_embd, n_ff, n_head, n_head_kv, weight_type, seed), written once
    per distinct parameter set per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[TinyModelSpec, Path] = {}

    def make(**params) -> Path:
        spec = TinyModelSpec(**params)
        if spec not in cache:
            cache[spec] = write_tiny_llama(root / f"{spec.file_stem}.gguf", spec)
        return cache[spec]

    return make


@pytest.fixture(scope="session")
def tiny_llama_f32(tiny_model_factory) -> Path:
    """2 layers, n_embd 64, n_ff 128, F32 weights."""
    return tiny_model_factory(weight_type="F32")


@pytest.fixture(scope="session")
def tiny_llama_q8_0(tiny_model_factory) -> Path:
    """2 layers, n_embd 64, n_ff 128, Q8_0 FFN and attention weights."""
    return tiny_model_factory(weight_type="Q8_0")
