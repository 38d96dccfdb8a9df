"""`llamaflash.Llama` refuses bad files with a clear error raised before llama.cpp starts, and
touches nothing the user has."""

from __future__ import annotations

import hashlib
import shutil
import warnings

import llama_cpp
import pytest
from fuzz_cases import set_uint_metadata
from synth import truncate, write_not_gguf, write_unsupported_architecture

import llamaflash
from llamaflash.converters import convert
from llamaflash.files import sidecar_format as fmt
from llamaflash.runtime import model_plan


@pytest.fixture
def llama_must_not_start(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError("llama.cpp was started although the input is bad")

    monkeypatch.setattr(llama_cpp.Llama, "__init__", refuse)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def pair(tiny_llama_q8_0, tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copy(tiny_llama_q8_0, model)
    return model, convert(model, progress=False)


def test_missing_explicit_sidecar(pair, tmp_path, llama_must_not_start):
    model, _ = pair
    missing = tmp_path / "nowhere.flash.gguf"
    with pytest.raises(llamaflash.SidecarNotFoundError) as exc:
        llamaflash.Llama(model_path=str(model), sidecar_path=str(missing))
    assert str(missing) in str(exc.value) and "llamaflash convert" in str(exc.value)
    assert not missing.exists()


def test_sidecar_of_another_model(pair, tiny_model_factory, tmp_path, llama_must_not_start):
    model, sidecar = pair
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_model_factory(weight_type="Q8_0", seed=7), other)
    before = {p: _digest(p) for p in (model, sidecar, other)}
    with pytest.raises(llamaflash.SidecarMismatchError) as exc:
        llamaflash.Llama(model_path=str(other), sidecar_path=str(sidecar))
    assert str(other) in str(exc.value) and str(sidecar) in str(exc.value)
    assert {p: _digest(p) for p in before} == before  # nothing written or overwritten


def test_unknown_sidecar_version(pair, llama_must_not_start):
    model, sidecar = pair
    set_uint_metadata(sidecar, fmt.KEY_FORMAT_VERSION, 99)
    with pytest.raises(llamaflash.SidecarVersionError, match="99"):
        llamaflash.Llama(model_path=str(model))


def test_truncated_sidecar(pair, llama_must_not_start):
    model, sidecar = pair
    truncate(sidecar, sidecar.stat().st_size // 2)
    with pytest.raises(llamaflash.SidecarError) as exc:
        llamaflash.Llama(model_path=str(model))
    assert str(sidecar) in str(exc.value)


def test_model_that_is_not_a_gguf(tmp_path, llama_must_not_start):
    bad = write_not_gguf(tmp_path / "bad.gguf")
    with pytest.raises(llamaflash.BaseModelError) as exc:
        llamaflash.Llama(model_path=str(bad))
    assert str(bad) in str(exc.value)


def test_missing_model(tmp_path, llama_must_not_start):
    with pytest.raises(FileNotFoundError):
        llamaflash.Llama(model_path=str(tmp_path / "absent.gguf"))


def test_bad_arguments(pair, llama_must_not_start):
    model, _ = pair
    with pytest.raises(ValueError, match="flash_mode"):
        llamaflash.Llama(model_path=str(model), flash_mode="turbo")
    # flash offload: budgets it cannot honour are refused before llama.cpp starts
    with pytest.raises(ValueError, match="ram_budget_mb"):
        llamaflash.Llama(model_path=str(model), ram_budget_mb=0)
    # wrong types and ranges: a ValueError naming the argument and what it accepts, never a TypeError
    for bad, match in [
        (dict(ram_budget_mb="abc"), r"ram_budget_mb='abc' must be a positive, finite number"),
        (dict(ram_budget_mb=float("inf")), "ram_budget_mb=inf must be a positive, finite"),
        (dict(ram_budget_mb=True), "ram_budget_mb=True"),
        (dict(flash_sparsity="0.3"), r"flash_sparsity='0.3' must be a number in \[0, 1\)"),
        (dict(flash_sparsity=1.5), r"flash_sparsity=1.5 must be a number in \[0, 1\)"),
        (dict(flash_max_sparse_tokens=2.5), "flash_max_sparse_tokens=2.5 must be an integer"),
        (dict(flash_dense_up="yes"), "flash_dense_up='yes' must be True, False or None"),
        (dict(flash_stream_gate=1), "flash_stream_gate=1 must be True, False or None"),
        (dict(flash_io_engine="aio"), "flash_io_engine='aio' must be one of auto, io_uring, pool"),
        (dict(sidecar_path=3), "sidecar_path=3 must be a path"),
    ]:
        with pytest.raises(ValueError, match=match):
            llamaflash.Llama(model_path=str(model), **bad)
    with pytest.raises(ValueError, match="ram_budget_mb needs the sparse lane"):
        llamaflash.Llama(model_path=str(model), ram_budget_mb=700, flash_mode="dense")
    with pytest.raises(llamaflash.errors.RamBudgetError, match=r"below the minimum of \d+ MiB"):
        llamaflash.Llama(model_path=str(model), ram_budget_mb=1)
    # offload settings without a budget, and a disk profile that is not one
    with pytest.raises(ValueError, match="flash-offload settings: pass ram_budget_mb"):
        llamaflash.Llama(model_path=str(model), flash_stream_gate=True)
    with pytest.raises(ValueError, match="flash-offload settings: pass ram_budget_mb"):
        llamaflash.Llama(model_path=str(model), flash_disk_profile="default")
    with pytest.raises(ValueError, match="no-such-profile.json"):
        llamaflash.Llama(model_path=str(model), ram_budget_mb=2000, flash_disk_profile="no-such-profile.json")


def test_architecture_without_classic_ffn_passes_through(tmp_path):
    model = write_unsupported_architecture(tmp_path / "ssm.gguf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no sidecar" warning: nothing to accelerate
        request = model_plan.LoadRequest(model_path=str(model))
        assert model_plan.find_sidecar(model_plan.identify_model(request), request) is None
