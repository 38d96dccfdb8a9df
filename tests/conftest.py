"""Shared pytest fixtures.

Synthetic models (see ``synth.py``) are session-scoped and shared between tests: treat
them as read-only, and copy one into the test's own ``tmp_path`` before writing anything
beside it (a sidecar, say).

Hermetic: everything the project generates (converted sidecars, saved disk profiles) is made by
these fixtures in ``--generated-dir`` (default: a fresh temporary directory per session; pass a
directory to reuse real-model conversions between runs); only verified registry downloads
(``llamaflash.files.assets``: models, texts) come from the shared cache ``~/.cache/llamaflash``.
"""

from __future__ import annotations

import os
import shutil
import sys
import types

# The converter's NumPy work on synthetic models is tiny matrices: one BLAS thread is several times
# faster than OpenBLAS's thread hand-offs (and does not fight a benchmark running beside the tests).
# Set before anything imports numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from collections.abc import Callable
from pathlib import Path

import pytest
from synth import FAST_CONVERT, TinyModelSpec, write_tiny_llama


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--generated-dir",
        default=None,
        type=Path,
        help="directory for files the tests generate and may reuse between runs (converted "
        "real-model sidecars, saved disk profiles); default: a fresh temporary directory",
    )


@pytest.fixture(scope="session")
def generated_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where tests keep what the project generates (see the module docstring)."""
    chosen = request.config.getoption("--generated-dir")
    if chosen is None:
        return tmp_path_factory.mktemp("generated")
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen.resolve()


@pytest.fixture(scope="session", autouse=True)
def no_saved_disk_profiles_from_the_machine(generated_dir: Path):
    """Disk profiles that ``llamaflash plan --probe-disk`` saved on this machine (under
    ``$XDG_CACHE_HOME/llamaflash``) would change the plans of offload tests: the tests see only the
    ones they save themselves, under ``generated_dir``."""
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(generated_dir / "xdg-cache")
    yield
    if saved is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = saved


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


@pytest.fixture(scope="session")
def smollm2_sidecar(generated_dir: Path) -> tuple[Path, Path]:
    """``(model, sidecar)``: the real SmolLM2-135M-Instruct Q4_1 from the package registry and its
    sidecar converted with the converter's defaults (calibrated, format 2) into ``generated_dir``.
    Converted on first use in a session (about 3 minutes on 2 cores); with a ``--generated-dir``
    given, reused for as long as it validates against the model."""
    from llamaflash.converters import convert
    from llamaflash.errors import LlamaflashError
    from llamaflash.files import assets
    from llamaflash.files.sidecar import validate_pair

    model = assets.fetch_model("smollm2-135m", progress=False)
    sidecar = generated_dir / "converted" / (model.name[: -len(".gguf")] + ".flash.gguf")
    try:
        info = validate_pair(model, sidecar)
        usable = info.sparsity is not None
    except LlamaflashError:
        usable = False
    if not usable:
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        convert(model, sidecar, force=True, progress=False)
    return model, sidecar


@pytest.fixture(scope="module")
def converted(tiny_model_factory, tmp_path_factory) -> tuple[Path, Path]:
    """``(model, sidecar)``: a Q8_0 model (n_embd 96, n_ff 192: 6 clusters of offload_helpers.C per
    layer) and its calibrated sidecar with a draft copy, in a directory of its own; read-only."""
    from llamaflash.converters import convert

    src = tiny_model_factory(weight_type="Q8_0", n_embd=96, n_ff=192)
    d = tmp_path_factory.mktemp("offload")
    model = d / "m.gguf"
    shutil.copy(src, model)
    sidecar = convert(model, progress=False, sparsity=0.5, measure_quality=False, **FAST_CONVERT)
    return model, sidecar


@pytest.fixture
def forced_plan(monkeypatch):
    """forced_plan(plan, calls=None): Llama(ram_budget_mb=...) uses ``plan`` (offload_helpers.make_plan)
    instead of the planner's; ``calls`` collects the keyword arguments the planner was called with."""
    import llamaflash.planning

    def use(plan, calls=None):
        from llamaflash.planning import planner as real

        fake = types.ModuleType("llamaflash.planning.planner")
        fake.__dict__.update(
            {k: v for k, v in vars(real).items() if not k.startswith("__")}
        )  # all but plan_offload real

        def plan_offload(*a, **k):
            if calls is not None:
                calls.append(k)
            return plan

        fake.plan_offload = plan_offload
        monkeypatch.setitem(sys.modules, "llamaflash.planning.planner", fake)
        monkeypatch.setattr(llamaflash.planning, "planner", fake, raising=False)

    return use


@pytest.fixture(scope="module")
def clean_pair(tiny_llama_q8_0, tmp_path_factory) -> tuple[Path, Path]:
    """A converted format-2 pair (base order, threshold table: the readers check their tensors too),
    read-only: copy before editing."""
    from llamaflash.converters import convert

    d = tmp_path_factory.mktemp("clean-pair")
    model = d / "model.gguf"
    shutil.copyfile(tiny_llama_q8_0, model)
    return model, convert(model, progress=False, **FAST_CONVERT)


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
