"""``convert``: where the sidecar goes, when it refuses, and that it is all-or-nothing."""

from __future__ import annotations

import errno
import hashlib
import shutil
from pathlib import Path

import gguf
import pytest
from synth import synthetic_text, truncate, write_not_gguf, write_unsupported_architecture

from llamaflash.converters import convert
from llamaflash.converters.report import report_path
from llamaflash.errors import (
    BaseModelError,
    BaseModelNotFoundError,
    CalibrationError,
    ConversionError,
    OutputExistsError,
)
from llamaflash.files.sidecar import default_sidecar_path, read_sidecar, validate_pair


def copy_model(model: Path, directory: Path) -> Path:
    dst = directory / model.name
    shutil.copyfile(model, dst)
    return dst


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


class _WriteFails:
    """Makes GGUFWriter.write_tensor_data raise ``exc`` on its ``fail_at``-th call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, exc: BaseException, fail_at: int = 2) -> None:
        self.exc, self.fail_at, self.calls = exc, fail_at, 0
        original = gguf.GGUFWriter.write_tensor_data

        def write_tensor_data(writer, tensor, *args, **kwargs):
            self.calls += 1
            if self.calls == self.fail_at:
                raise self.exc
            return original(writer, tensor, *args, **kwargs)

        monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", write_tensor_data)


def test_default_output_is_beside_the_model_with_flash_suffix(tiny_llama_q8_0, tmp_path, fast_convert):
    model = copy_model(tiny_llama_q8_0, tmp_path)
    out = convert(model, progress=False, **fast_convert)
    assert out == tmp_path / (model.name[: -len(".gguf")] + ".flash.gguf")
    assert out == default_sidecar_path(model)
    assert listing(tmp_path) == sorted([model.name, out.name, report_path(out).name])
    assert report_path(out).name == out.name + ".report.json"
    validate_pair(model, out)


def test_default_sidecar_path_drops_only_a_gguf_suffix():
    assert default_sidecar_path("/m/qwen.Q4_K_M.gguf") == Path("/m/qwen.Q4_K_M.flash.gguf")
    assert default_sidecar_path("/m/model.GGUF") == Path("/m/model.flash.gguf")
    assert default_sidecar_path("/m/model.bin") == Path("/m/model.bin.flash.gguf")


def test_explicit_output_path(tiny_llama_q8_0, tmp_path, fast_convert):
    out = convert(tiny_llama_q8_0, tmp_path / "elsewhere.gguf", progress=False, **fast_convert)
    assert out == tmp_path / "elsewhere.gguf"
    validate_pair(tiny_llama_q8_0, out)


def test_conversion_is_deterministic_and_leaves_the_model_untouched(tiny_llama_q8_0, tmp_path, fast_convert):
    model = copy_model(tiny_llama_q8_0, tmp_path)
    before, mtime = sha256(model), model.stat().st_mtime_ns
    first = sha256(convert(model, progress=False, **fast_convert))
    second = sha256(convert(model, force=True, progress=False, **fast_convert))
    assert first == second
    assert sha256(model) == before and model.stat().st_mtime_ns == mtime


def test_existing_output_is_refused_without_force_and_replaced_with_it(
    tiny_model_factory, tmp_path, fast_convert, monkeypatch
):
    model = copy_model(tiny_model_factory(weight_type="Q8_0"), tmp_path)
    out = default_sidecar_path(model)
    out.write_bytes(b"precious")
    import llamaflash.converters.calibrate as calibrate_module

    def no_work(*args, **kwargs):
        raise AssertionError("calibration started although the output exists")

    with monkeypatch.context() as m:  # refused before any profiling
        m.setattr(calibrate_module, "calibrate", no_work)
        with pytest.raises(OutputExistsError) as exc:
            convert(model, progress=False, **fast_convert)
    assert str(out) in str(exc.value) and "--force" in str(exc.value)
    assert out.read_bytes() == b"precious"
    assert listing(tmp_path) == sorted([model.name, out.name])

    convert(model, force=True, progress=False, **fast_convert)
    validate_pair(model, out)


def test_output_may_not_be_the_model_itself(tiny_llama_q8_0, tmp_path):
    model = copy_model(tiny_llama_q8_0, tmp_path)
    before = sha256(model)
    with pytest.raises(ConversionError, match="overwrite the base model"):
        convert(model, model, force=True, progress=False)
    assert sha256(model) == before


def test_missing_output_directory_is_a_clear_error(tiny_llama_q8_0, tmp_path, fast_convert):
    out = tmp_path / "no" / "such" / "dir" / "m.flash.gguf"
    with pytest.raises(ConversionError, match="does not exist") as exc:
        convert(tiny_llama_q8_0, out, progress=False, **fast_convert)
    assert str(out) in str(exc.value)


@pytest.mark.parametrize(
    "make_bad, error, phrase",
    [
        (lambda d, good: d / "absent.gguf", BaseModelNotFoundError, "no such file"),
        (lambda d, good: write_not_gguf(d / "text.gguf"), BaseModelError, "not a GGUF"),
        (lambda d, good: truncate(copy_model(good, d), good.stat().st_size // 2), BaseModelError, "truncated"),
        (lambda d, good: write_unsupported_architecture(d / "ssm.gguf"), BaseModelError, "not supported"),
    ],
    ids=["missing", "not-gguf", "truncated", "unsupported-arch"],
)
def test_bad_input_is_refused_before_anything_is_written(tiny_llama_q8_0, tmp_path, make_bad, error, phrase):
    bad = make_bad(tmp_path, tiny_llama_q8_0)
    before = listing(tmp_path)
    with pytest.raises(error, match=phrase) as exc:
        convert(bad, progress=False)
    assert str(bad) in str(exc.value)
    assert listing(tmp_path) == before


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("boom")], ids=["ctrl-c", "error"])
def test_interrupted_conversion_leaves_no_file(tiny_llama_q8_0, tmp_path, monkeypatch, exc, fast_convert):
    model = copy_model(tiny_llama_q8_0, tmp_path)
    failing = _WriteFails(monkeypatch, exc, fail_at=3)
    with pytest.raises(type(exc)):
        convert(model, progress=False, **fast_convert)
    assert failing.calls == 3
    assert listing(tmp_path) == [model.name]


def test_disk_full_keeps_the_previous_sidecar_and_reports_it(tiny_llama_q8_0, tmp_path, monkeypatch, fast_convert):
    model = copy_model(tiny_llama_q8_0, tmp_path)
    out = convert(model, progress=False, **fast_convert)
    previous, previous_report = sha256(out), sha256(report_path(out))
    _WriteFails(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(ConversionError, match="No space left") as exc:
        convert(model, force=True, progress=False, **fast_convert)
    assert str(out) in str(exc.value)
    assert sha256(out) == previous and sha256(report_path(out)) == previous_report
    assert listing(tmp_path) == sorted([model.name, out.name, report_path(out).name])


def test_progress_prints_one_line_per_layer_to_stderr(tiny_llama_q8_0, tmp_path, capsys, fast_convert):
    convert(tiny_llama_q8_0, tmp_path / "a.flash.gguf", progress=True, **fast_convert)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "layer   0 written (1/2)" in captured.err and "layer   1 written (2/2)" in captured.err
    for phrase in (
        "profile",
        "analyse",
        "quality (engine)",
        "operating point: auto",
        "measured with the sparse engine",
    ):
        assert phrase in captured.err, phrase
    convert(tiny_llama_q8_0, tmp_path / "b.flash.gguf", progress=False, **fast_convert)
    assert capsys.readouterr().err == ""


def test_calibration_text_too_short_says_how_much_is_needed(tiny_llama_q8_0, tmp_path, fast_convert):
    settings = dict(fast_convert, calib_text=synthetic_text(100, seed=3))
    with pytest.raises(CalibrationError) as exc:
        convert(tiny_llama_q8_0, tmp_path / "s.flash.gguf", progress=False, **settings)
    message = str(exc.value)
    assert "too short" in message and "needs at least 1024" in message and "characters" in message
    assert "--calib" in message
    assert listing(tmp_path) == []


def test_validation_text_too_short_is_refused(tiny_llama_q8_0, tmp_path, fast_convert):
    settings = dict(fast_convert, valid_text="the cat sat")
    with pytest.raises(CalibrationError, match="validation text .* too short"):
        convert(tiny_llama_q8_0, tmp_path / "s.flash.gguf", progress=False, **settings)
    assert listing(tmp_path) == []


def test_bundles_only_conversion_writes_format_1(tiny_llama_q8_0, tmp_path):
    out = convert(tiny_llama_q8_0, tmp_path / "v1.flash.gguf", progress=False, profile=False)
    info = validate_pair(tiny_llama_q8_0, out)
    assert info.format_version == 1 and info.sparsity is None
    assert all(lay.threshold is None and lay.freq_offset is None for lay in info.layers)
    assert listing(tmp_path) == ["v1.flash.gguf"]


def test_fixed_sparsity_without_quality_needs_no_validation_text(tiny_llama_q8_0, tmp_path, fast_convert):
    settings = dict(
        fast_convert, valid_text=None, valid_path=tmp_path / "absent.txt", sparsity=0.5, measure_quality=False
    )
    out = convert(tiny_llama_q8_0, tmp_path / "f.flash.gguf", progress=False, **settings)
    info = read_sidecar(out)
    assert (info.sparsity.method, info.sparsity.target) == ("fixed", 0.5)
    assert info.sparsity.quality == {}
