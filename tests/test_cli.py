"""The ``llamaflash`` command line: ``convert`` and ``inspect``, and how errors look."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from synth import FAST_CONVERT, synthetic_text, write_not_gguf

from llamaflash.cli.cli import EXIT_LLAMAFLASH_ERROR, main
from llamaflash.files.sidecar import read_sidecar, validate_pair


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> tuple[Path, Path]:
    """Synthetic calibration and validation text files."""
    d = tmp_path_factory.mktemp("texts")
    calib, valid = d / "calib.txt", d / "valid.txt"
    calib.write_text(FAST_CONVERT["calib_text"])
    valid.write_text(FAST_CONVERT["valid_text"])
    return calib, valid


def fast(texts) -> list[str]:
    """Options for a fast CLI conversion of a synthetic model."""
    calib, valid = texts
    return ["--calib", str(calib), "--valid", str(valid), "--calib-tokens", "2048", "--valid-tokens", "512"]


def copy_model(model: Path, directory: Path) -> Path:
    dst = directory / model.name
    shutil.copyfile(model, dst)
    return dst


def assert_clean_error(result, *phrases: str) -> None:
    assert result.exit_code == EXIT_LLAMAFLASH_ERROR == 2
    assert result.stderr.startswith("error: ")
    assert "Traceback" not in result.output
    for phrase in phrases:
        assert phrase in result.stderr


def test_convert_writes_sidecar_and_prints_its_path(tiny_llama_q8_0, tmp_path, texts):
    model = copy_model(tiny_llama_q8_0, tmp_path)
    result = run("convert", model, *fast(texts), "--sparsity", "0.5")
    assert result.exit_code == 0, result.output
    out = tmp_path / (model.name[: -len(".gguf")] + ".flash.gguf")
    assert result.stdout.strip() == str(out)
    assert "layer   1 written" in result.stderr
    assert "operating point: fixed sparsity 0.50" in result.stderr
    assert "measured with the sparse engine" in result.stderr
    info = validate_pair(model, out)
    assert (info.sparsity.method, info.sparsity.target) == ("fixed", 0.5)
    report = json.loads((tmp_path / (out.name + ".report.json")).read_text())
    assert report["operating_point"]["target_sparsity"] == 0.5
    assert report["quality"]["chosen"]["target_sparsity"] == 0.5
    assert report["quality"]["method"] == report["quality"]["chosen"]["method"] == "engine"
    assert [entry["layer"] for entry in report["layers"]] == [0, 1]


def test_convert_auto_with_budget_and_gate_selection(tiny_llama_q8_0, tmp_path, texts):
    out = tmp_path / "side.flash.gguf"
    result = run(
        "convert",
        tiny_llama_q8_0,
        "-o",
        out,
        *fast(texts),
        "--quality-budget",
        "5",
        "--selection",
        "gate",
        "--quiet",
        "--no-report",
    )
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    info = read_sidecar(out)
    assert info.sparsity.method == "auto" and abs(info.sparsity.quality_budget - 0.05) < 1e-6
    assert all(lay.threshold is not None for lay in info.layers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["side.flash.gguf"]


@pytest.mark.parametrize(
    "option, removed, remaining",
    [("--selection", "predictor", "gate"), ("--selection", "auto", "gate"), ("--quality-method", "emulated", "engine")],
)
def test_convert_refuses_removed_values_naming_the_remaining_one(tiny_llama_q8_0, tmp_path, option, removed, remaining):
    result = run("convert", tiny_llama_q8_0, "-o", tmp_path / "side.flash.gguf", option, removed)
    assert result.exit_code == 2
    assert f"'{removed}' is not '{remaining}'" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_existing_output_unless_forced(tiny_llama_q8_0, tmp_path, texts):
    out = tmp_path / "side.flash.gguf"
    assert run("convert", tiny_llama_q8_0, "-o", out, *fast(texts), "--quiet").exit_code == 0
    assert_clean_error(run("convert", tiny_llama_q8_0, "-o", out), str(out), "--force")
    result = run("convert", tiny_llama_q8_0, "-o", out, *fast(texts), "--force", "--quiet")
    assert result.exit_code == 0 and result.stderr == ""


def test_convert_rejects_bad_options_and_short_texts(tiny_llama_q8_0, tmp_path, texts):
    for bad in ("1.5", "lots"):
        result = run("convert", tiny_llama_q8_0, "-o", tmp_path / "x.flash.gguf", "--sparsity", bad)
        assert result.exit_code == 2 and "--sparsity" in result.output
    result = run("convert", tiny_llama_q8_0, "-o", tmp_path / "x.flash.gguf", "--no-quality")
    assert result.exit_code == 2 and "--no-quality needs a fixed --sparsity" in result.output
    short = tmp_path / "short.txt"
    short.write_text(synthetic_text(50))
    result = run("convert", tiny_llama_q8_0, "-o", tmp_path / "x.flash.gguf", "--calib", short, "-q")
    assert_clean_error(result, "too short", "needs at least 1024", "--calib")
    result = run("convert", tiny_llama_q8_0, "-o", tmp_path / "x.flash.gguf", "--calib", tmp_path / "nope.txt", "-q")
    assert_clean_error(result, "nope.txt", "no such calibration file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


def test_convert_reports_bad_models_without_traceback(tmp_path):
    assert_clean_error(run("convert", tmp_path / "absent.gguf"), "absent.gguf", "no such file")
    text = write_not_gguf(tmp_path / "text.gguf")
    assert_clean_error(run("convert", text), str(text), "not a GGUF")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.gguf"]


def test_inspect_describes_a_format_1_sidecar(tiny_llama_q8_0, tmp_path):
    out = tmp_path / "side.flash.gguf"
    assert run("convert", tiny_llama_q8_0, "-o", out, "--no-calibration", "--quiet").exit_code == 0
    result = run("inspect", out)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "format version:   1" in text
    assert "sparsity:         none" in text
    assert "base arch:        llama" in text
    assert "base name:        tiny-llama-synth-Q8_0" in text
    assert "ffn activation:   silu" in text
    layer_lines = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert layer_lines == [
        [str(i), "64", "128", "Q8_0", "Q8_0", "Q8_0", "Q8_0", "136", str(128 * 136), str(128 * 68)] for i in (0, 1)
    ]


def test_inspect_describes_sparsity_per_layer(tiny_llama_q8_0, tmp_path, texts):
    out = tmp_path / "side.flash.gguf"
    assert run("convert", tiny_llama_q8_0, "-o", out, *fast(texts), "--sparsity", "0.5", "-q").exit_code == 0
    result = run("inspect", out)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "format version:   3" in text and "checksums:        crc32c" in text
    assert "sparsity:         fixed, target 0.500, criterion act_gate" in text
    assert "quality method:   engine (measured with the sparse engine)" in text and "curve: sparsity 0.50" in text
    info = read_sidecar(out)
    header = next(line.split() for line in text.splitlines() if line.split()[:2] == ["layer", "threshold"])
    assert header == ["layer", "threshold", "sparsity", "ffn_err", "hot>=0.5"]
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"]) and len(line.split()) == 5]
    assert [r[0] for r in rows] == ["0", "1"]
    for row, lay in zip(rows, info.layers):
        assert float(row[1]) == pytest.approx(lay.threshold, rel=1e-3)
        assert float(row[2]) == pytest.approx(lay.sparsity, abs=1e-3)


def test_inspect_refuses_non_sidecars(tiny_llama_q8_0, tmp_path):
    assert_clean_error(run("inspect", tiny_llama_q8_0), "not a llamaflash sidecar")
    assert_clean_error(run("inspect", tmp_path / "absent.flash.gguf"), "no such sidecar")
    text = write_not_gguf(tmp_path / "t.flash.gguf")
    assert_clean_error(run("inspect", text), "not a GGUF")


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "llamaflash.cli.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "convert" in result.stdout and "inspect" in result.stdout
