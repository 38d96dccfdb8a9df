"""What importing llamaflash costs: `import llamaflash` and the command line's module load neither
llama-cpp-python nor the native extension; `llamaflash inspect` and `llamaflash plan --help` run
without them; the first access to `Llama` (or to an extension) loads llama_cpp before the extension."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("llama_cpp", "llamaflash._native", "llamaflash._native_testing", "llamaflash.runtime.llama")


def _fresh(code: str) -> dict:
    """Runs ``code`` in a fresh interpreter, then reports which of HEAVY it imported (and in what
    order) as JSON on the last stdout line."""
    report = f"import json as _j, sys as _s\nprint(_j.dumps({{'loaded': [m for m in _s.modules if m in {HEAVY!r}]}}))\n"
    proc = subprocess.run([sys.executable, "-c", code + "\n" + report], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {"stdout": proc.stdout, **json.loads(proc.stdout.strip().splitlines()[-1])}


def test_import_llamaflash_loads_neither_llama_cpp_nor_the_extension():
    out = _fresh(
        "import llamaflash\n"
        "assert llamaflash.__version__ and issubclass(llamaflash.SidecarError, llamaflash.LlamaflashError)"
    )
    assert out["loaded"] == []


def test_the_command_line_module_is_cheap_too():
    assert _fresh("import llamaflash.cli.cli")["loaded"] == []


def test_llama_is_loaded_on_first_access_with_llama_cpp_before_the_extension():
    out = _fresh(
        "from llamaflash import Llama, FLASH_MODES, LlamaflashWarning\n"
        "import llama_cpp\n"
        "assert issubclass(Llama, llama_cpp.Llama) and 'auto' in FLASH_MODES\n"
        "assert issubclass(LlamaflashWarning, UserWarning)"
    )
    assert out["loaded"].index("llama_cpp") < out["loaded"].index("llamaflash._native")


@pytest.mark.parametrize("extension", ["_native", "_native_testing"])
def test_an_extension_alone_is_loaded_after_llama_cpp(extension):
    out = _fresh(f"from llamaflash import {extension}")
    assert out["loaded"] == ["llama_cpp", f"llamaflash.{extension}"]  # sys.modules keeps import order


def test_unknown_attribute_is_an_attribute_error():
    import llamaflash

    with pytest.raises(AttributeError, match="no_such_name"):
        llamaflash.no_such_name  # noqa: B018


def _cli(*args: str) -> str:
    """`llamaflash ARGS` run in this fresh interpreter's process (standalone: exits with its status)."""
    return (
        "import sys\nfrom llamaflash.cli.cli import main\n"
        f"try:\n    main({list(args)!r})\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_llama_q8_0, fast_convert) -> tuple[Path, Path]:
    from llamaflash.converters import convert

    d = tmp_path_factory.mktemp("import-cost")
    model = Path(shutil.copy(tiny_llama_q8_0, d / "model.gguf"))
    sidecar = convert(model, progress=False, sparsity=0.5, measure_quality=False, **fast_convert)
    return model, sidecar


def test_inspect_runs_without_llama_cpp(converted):
    _, sidecar = converted
    out = _fresh(_cli("inspect", str(sidecar)))
    assert "format version:" in out["stdout"] and "sparsity:" in out["stdout"]
    assert out["loaded"] == []


def test_plan_help_needs_no_llama_cpp_and_plan_loads_the_extension_after_it(converted):
    model, sidecar = converted
    help_out = _fresh(_cli("plan", "--help"))
    assert "--ram-budget-mb" in help_out["stdout"] and help_out["loaded"] == []
    # the planner sizes cache slots with the extension's own formula
    out = _fresh(_cli("plan", str(model), "--sidecar", str(sidecar), "--ram-budget-mb", "400", "--json"))
    assert '"budget' in out["stdout"]
    assert out["loaded"].index("llama_cpp") < out["loaded"].index("llamaflash._native")
