"""The ``llamaflash`` command line: ``convert`` and ``inspect``, and how errors look."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from llamaflash.cli import EXIT_LLAMAFLASH_ERROR, main
from llamaflash.sidecar import validate_pair
from synth import write_not_gguf


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


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


def test_convert_writes_sidecar_and_prints_its_path(tiny_llama_q8_0, tmp_path):
    model = copy_model(tiny_llama_q8_0, tmp_path)
    result = run("convert", model)
    assert result.exit_code == 0, result.output
    out = tmp_path / (model.name[: -len(".gguf")] + ".flash.gguf")
    assert result.stdout.strip() == str(out)
    assert "layer   1 written" in result.stderr
    validate_pair(model, out)


def test_convert_refuses_existing_output_unless_forced(tiny_llama_q8_0, tmp_path):
    out = tmp_path / "side.flash.gguf"
    assert run("convert", tiny_llama_q8_0, "-o", out, "--quiet").exit_code == 0
    assert_clean_error(run("convert", tiny_llama_q8_0, "-o", out), str(out), "--force")
    result = run("convert", tiny_llama_q8_0, "-o", out, "--force", "--quiet")
    assert result.exit_code == 0 and result.stderr == ""


def test_convert_reports_bad_models_without_traceback(tmp_path):
    assert_clean_error(run("convert", tmp_path / "absent.gguf"), "absent.gguf", "no such file")
    text = write_not_gguf(tmp_path / "text.gguf")
    assert_clean_error(run("convert", text), str(text), "not a GGUF")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.gguf"]


def test_inspect_describes_the_sidecar(tiny_llama_q8_0, tmp_path):
    out = tmp_path / "side.flash.gguf"
    run("convert", tiny_llama_q8_0, "-o", out, "--quiet")
    result = run("inspect", out)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "format version:   1" in text
    assert "base arch:        llama" in text
    assert "base name:        tiny-llama-synth-Q8_0" in text
    assert "ffn activation:   silu" in text
    layer_lines = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert layer_lines == [
        [str(i), "64", "128", "Q8_0", "Q8_0", "Q8_0", "Q8_0", "136", str(128 * 136), str(128 * 68)]
        for i in (0, 1)
    ]


def test_inspect_refuses_non_sidecars(tiny_llama_q8_0, tmp_path):
    assert_clean_error(run("inspect", tiny_llama_q8_0), "not a llamaflash sidecar")
    assert_clean_error(run("inspect", tmp_path / "absent.flash.gguf"), "no such sidecar")
    text = write_not_gguf(tmp_path / "t.flash.gguf")
    assert_clean_error(run("inspect", text), "not a GGUF")


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "llamaflash.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "convert" in result.stdout and "inspect" in result.stdout
