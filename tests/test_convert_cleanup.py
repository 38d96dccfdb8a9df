"""Nothing left behind by ``convert``: a conversion stopped by a signal removes its temporary files,
and the temporaries of a conversion that died without cleaning up (SIGKILL) are removed by the next
conversion into the same directory, which says so.

Each conversion runs in a real subprocess on a synthetic model. To stop it at a known point while a
temporary exists, the child script wraps one internal step (the GGUF write of the final sidecar or of
the measurement sidecar, or the start of the sparse-engine measurement) so that, once the step has
produced its temporary, it writes a marker file and sleeps; the parent waits for the marker, checks
that the temporary is there, and sends the signal.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llamaflash.converters import convert
from llamaflash.converters.writer import held

TESTS = Path(__file__).resolve().parent

CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from synth import FAST_CONVERT
    import llamaflash.converters.calibrate as calibrate
    import llamaflash.converters.writer as writer
    from llamaflash.converters import convert

    model, phase, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3])

    def pause(what):
        marker.write_text(what)
        time.sleep(120)

    write = writer._write_gguf
    def paused_write(plan, path, progress):
        write(plan, path, progress)
        if (phase == "quality-write") == (".quality-" in path.name):
            pause(str(path))
    writer._write_gguf = paused_write

    engine = calibrate.EngineRunner
    def paused_engine(model_path, sidecar_path, *args):
        if phase == "quality":
            pause(str(sidecar_path))
        return engine(model_path, sidecar_path, *args)
    calibrate.EngineRunner = paused_engine

    settings = dict(profile=False) if phase == "write" else dict(FAST_CONVERT)
    convert(model, progress=False, **settings)
""").format(tests=str(TESTS))


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def _default_signal_dispositions() -> None:
    """In the child before exec: a test run started in the background (`&`, nohup) hands SIGINT and
    SIGHUP down ignored, and convert rightly leaves an ignored signal ignored; the conversion under
    test must see the signals as a foreground command would."""
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def start_paused(model: Path, phase: str) -> tuple[subprocess.Popen, Path]:
    """A child converting ``model`` that pauses in ``phase``; returns it and the temporary it paused
    with (which exists)."""
    marker = model.parent.parent / f"marker-{phase}"
    marker.unlink(missing_ok=True)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(model), phase, str(marker)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_default_signal_dispositions,
    )
    t0 = time.monotonic()
    while not marker.exists():
        if child.poll() is not None:
            pytest.fail(f"the conversion ended before pausing: {child.stdout.read()}")
        if time.monotonic() - t0 > 120:
            child.kill()
            pytest.fail("the conversion did not reach its pause within 120 s")
        time.sleep(0.05)
    time.sleep(0.05)  # the marker's text is written
    temporary = Path(marker.read_text())
    assert temporary.exists() and temporary.parent == model.parent
    assert temporary.name.startswith(".") and str(child.pid) in temporary.name
    return child, temporary


@pytest.fixture
def model(tiny_llama_q8_0, tmp_path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    dst = d / "model.gguf"
    shutil.copyfile(tiny_llama_q8_0, dst)
    return dst


@pytest.mark.parametrize(
    "phase, signum",
    [
        ("write", signal.SIGTERM),  # .model.flash.gguf.tmp-PID being written
        ("quality-write", signal.SIGTERM),  # ..model.flash.gguf.quality-PID.tmp-PID being written
        ("quality", signal.SIGTERM),  # .model.flash.gguf.quality-PID in use by the measurement
        ("quality", signal.SIGINT),
        ("write", signal.SIGHUP),
    ],
)
def test_a_signal_removes_every_temporary(model, phase, signum):
    child, temporary = start_paused(model, phase)
    child.send_signal(signum)
    output, _ = child.communicate(timeout=60)
    # SIGTERM/SIGHUP: the default action once the files are gone; SIGINT: KeyboardInterrupt unwinds,
    # and Python ends a process stopped by an uncaught KeyboardInterrupt with SIGINT
    assert child.returncode == -signum, output
    assert not temporary.exists()
    assert hidden(model.parent) == [], hidden(model.parent)
    assert sorted(p.name for p in model.parent.iterdir()) == ["model.gguf"]


def test_the_next_convert_removes_what_a_killed_one_left_and_says_so(model, capfd):
    child, temporary = start_paused(model, "write")
    child.kill()  # SIGKILL: no handler runs
    child.communicate(timeout=60)
    assert temporary.exists()
    dead_pid = child.pid  # reaped above: no such process any more

    # a temporary of another, running conversion (its PID alive) and one whose PID is gone but whose
    # lock is held (in use, e.g. by a process in another PID namespace) stay; unrelated hidden files
    # stay whatever their names
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = model.parent / f".other.flash.gguf.tmp-{sleeper.pid}"
        locked = model.parent / f".locked.flash.gguf.quality-{dead_pid}"
        unrelated = model.parent / f".notes.txt.tmp-{dead_pid}"
        for path in (running, locked, unrelated):
            path.write_bytes(b"x")
        with held(locked):
            out = convert(model, progress=True, profile=False)
        err = capfd.readouterr().err
    finally:
        sleeper.kill()
        sleeper.wait()

    assert out.exists() and not temporary.exists()
    assert running.exists() and locked.exists() and unrelated.exists()
    removed_line = next(line for line in err.splitlines() if "removed" in line)
    assert temporary.name in removed_line and f"process {dead_pid}" in removed_line and "did not finish" in removed_line
    kept_line = next(line for line in err.splitlines() if "left in place" in line)
    assert running.name in kept_line and locked.name in kept_line
    assert unrelated.name not in err
