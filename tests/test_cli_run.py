"""``llamaflash run`` and ``chat`` (in subprocesses, chat driven through stdin and through a terminal for
Ctrl-C), ``--version``, ``python -m llamaflash``, ``models``, unknown model names, a port in use.
The real SmolLM2-135M and its calibrated sidecar (conftest.smollm2_sidecar)."""

from __future__ import annotations

import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

import llamaflash
from llamaflash.cli.cli import main
from llamaflash.cli.models_by_name import model_rows
from llamaflash.cli.run_chat import ChatSession
from llamaflash.files import assets

LLAMAFLASH = [sys.executable, "-m", "llamaflash"]


def llamaflash_cli(*args: str, stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LLAMAFLASH, *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OPENBLAS_NUM_THREADS="1"),
    )


def assert_no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stdout + result.stderr, result.stderr


@pytest.fixture(scope="module")
def lone_model(smollm2_sidecar, tmp_path_factory) -> Path:
    """SmolLM2 through a link in a directory without a sidecar."""
    model, _ = smollm2_sidecar
    link = tmp_path_factory.mktemp("no-sidecar") / model.name
    link.symlink_to(model)
    return link


# -- no model needed ---------------------------------------------------------------------------------


def test_version_and_python_m():
    result = llamaflash_cli("--version")
    assert result.returncode == 0
    assert result.stdout.startswith(f"llamaflash {llamaflash.__version__} ")
    help_result = llamaflash_cli("--help")
    assert help_result.returncode == 0
    for command in ("run", "chat", "serve", "models", "convert"):
        assert f"  {command} " in help_result.stdout


def test_models_lists_registry_with_cache_and_sidecar_state(tmp_path):
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    spec = assets.MODELS["gemma3-270m"]
    with open(models_dir / spec.filename, "wb") as f:  # sparse file of the published size
        f.truncate(spec.size)
    (models_dir / spec.filename.replace(".gguf", ".flash.gguf")).write_bytes(b"")
    rows = {row.name: row for row in model_rows(cache_dir=tmp_path)}
    assert sorted(rows) == assets.list_models()
    assert rows["gemma3-270m"].cached and rows["gemma3-270m"].sidecar is not None
    assert not rows["smollm2-135m"].cached and rows["smollm2-135m"].sidecar is None

    result = CliRunner().invoke(main, ["models"])
    assert result.exit_code == 0, result.output
    for name in assets.list_models():
        assert name in result.stdout
    assert "cached" in result.stdout and "sidecar" in result.stdout


@pytest.mark.parametrize(
    "command", [["run", "no-such-model", "hello"], ["chat", "no-such-model"], ["serve", "no-such-model"]]
)
def test_unknown_model_name_lists_known_names(command):
    result = llamaflash_cli(*command, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("error: 'no-such-model' is neither a model file nor a known model name")
    for name in assets.list_models():
        assert name in result.stderr
    assert_no_traceback(result)


def test_serve_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        start = time.monotonic()
        result = llamaflash_cli("serve", "smollm2-135m", "--host", "127.0.0.1", "--port", port, timeout=60)
    assert result.returncode == 2
    assert f"error: port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "loading" not in result.stderr  # found before any model loads
    assert time.monotonic() - start < 30
    assert_no_traceback(result)


# -- run ---------------------------------------------------------------------------------------------


def test_run_streams_reply_to_stdout(smollm2_sidecar):
    _, sidecar = smollm2_sidecar
    result = llamaflash_cli(
        "run",
        "smollm2-135m",
        "Name three colours.",
        "--sidecar",
        sidecar,
        "--flash-mode",
        "sparse",
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "--threads",
        "2",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "llamaflash:" not in result.stdout  # loading and notices go to stderr only
    assert "loaded in" in result.stderr and "llamaflash sparse lane" in result.stderr
    assert_no_traceback(result)


def test_run_raw_prompt_from_stdin_with_budget(smollm2_sidecar):
    model, sidecar = smollm2_sidecar
    # 280 MiB: above the planner's least budget; --flash-mode sparse because read into memory stock
    # SmolLM2 would fit there
    result = llamaflash_cli(
        "run",
        model,
        "--raw",
        "--sidecar",
        sidecar,
        "--flash-mode",
        "sparse",
        "--ram-budget-mb",
        "280",
        "--n-ctx",
        "512",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        stdin="The sky is",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "flash offload within 280 MiB" in result.stderr
    assert_no_traceback(result)


def test_run_with_a_budget_that_holds_the_model_runs_stock(smollm2_sidecar):
    model, sidecar = smollm2_sidecar
    result = llamaflash_cli(
        "run",
        model,
        "--raw",
        "--sidecar",
        sidecar,
        "--ram-budget-mb",
        "400",
        "--n-ctx",
        "512",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        stdin="The sky is",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "running as stock: the budget of 400 MiB holds" in result.stderr
    assert_no_traceback(result)


def test_model_without_sidecar_runs_as_stock_and_says_so_once(lone_model):
    result = llamaflash_cli("run", lone_model, "Hello", "--max-tokens", "4", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("no sidecar") == 1
    assert "running as stock" in result.stderr
    assert "Warning" not in result.stderr  # a plain line, not the warnings module's format
    assert_no_traceback(result)


# -- chat --------------------------------------------------------------------------------------------


def test_chat_through_stdin(smollm2_sidecar):
    _, sidecar = smollm2_sidecar
    messages = "My name is Ada.\nWhat is my name?\n/reset\nHello\n"
    result = llamaflash_cli(
        "chat", "smollm2-135m", "--sidecar", sidecar, "--max-tokens", "12", "--temperature", "0", stdin=messages
    )
    assert result.returncode == 0, result.stderr
    # a prompt before each of the 4 lines and one more, answered by end of input
    before, *answers = result.stdout.split(">>> ")
    assert before == "" and len(answers) == 5
    assert all(answers[i].strip() for i in (0, 1, 3)) and answers[2] == "" and answers[4] == "\n"
    assert "conversation forgotten" in result.stderr
    assert "Ctrl-C stops a reply" in result.stderr
    assert_no_traceback(result)


class Recording:
    """A real Llama whose create_chat_completion calls are recorded (the messages each turn sent)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.sent: list[list[dict]] = []

    def create_chat_completion(self, messages, **kwargs):
        self.sent.append([dict(m) for m in messages])
        return self.llm.create_chat_completion(messages=messages, **kwargs)


@pytest.fixture(scope="module")
def small_context_llm(lone_model):
    with warnings.catch_warnings():  # no sidecar here, on purpose
        warnings.simplefilter("ignore", llamaflash.LlamaflashWarning)
        llm = llamaflash.Llama(model_path=str(lone_model), n_ctx=256, n_threads=2, verbose=False)
    yield llm
    llm.close()


def test_chat_keeps_history_and_drops_the_oldest_when_full(small_context_llm, capsys):
    import io

    recording = Recording(small_context_llm)
    session = ChatSession(recording, "You are terse.", {"max_tokens": 8, "temperature": 0})
    out = io.StringIO()
    assert session.reply("My name is Ada.", out)
    assert session.reply("What is my name?", out)
    second = recording.sent[-1]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[1]["content"] == "My name is Ada."
    # long messages until the history no longer fits 256 tokens: the oldest exchanges go, the system stays
    for i in range(4):
        assert session.reply(f"Message {i}: " + "tell me more about the weather " * 8, out)
    assert "dropped the oldest exchange" in capsys.readouterr().err
    last = recording.sent[-1]
    assert last[0] == {"role": "system", "content": "You are terse."}
    assert all(m["content"] != "My name is Ada." for m in last)
    assert session.turns[-1]["role"] == "assistant"


def _read_until(fd: int, needle: bytes | None, timeout: float) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        data += chunk
        if needle is not None and needle in data:
            break
    return data


def test_chat_ctrl_c_stops_the_reply_then_quits_at_an_empty_prompt(smollm2_sidecar):
    """In a terminal: Ctrl-C during a long reply stops it and the prompt comes back; Ctrl-C over a
    half-typed line discards the line; Ctrl-C at an empty prompt quits with status 0, no traceback."""
    _, sidecar = smollm2_sidecar
    pid, fd = pty.fork()
    if pid == 0:  # the child: llamaflash chat on the terminal
        # a test run started in the background (`&`, nohup) hands SIGINT down ignored, and an ignored
        # signal stays ignored across exec: the terminal's Ctrl-C must reach the chat as a user's would
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        os.execv(
            sys.executable,
            [
                *LLAMAFLASH,
                "chat",
                "smollm2-135m",
                "--sidecar",
                str(sidecar),
                "--max-tokens",
                "0",
                "--n-ctx",
                "2048",
                "--temperature",
                "0",
            ],
        )
    try:
        transcript = _read_until(fd, b">>> ", 120)
        assert transcript.endswith(b">>> "), transcript
        os.write(fd, b"Write a long story about a dragon and a knight.\r")
        transcript += _read_until(fd, b"knight.\r\n", 10)  # the terminal's echo of the line
        # the reply streams (up to 2048 tokens: many seconds): interrupt once it has begun (a loaded
        # machine may take seconds to the first token)
        reply, deadline = b"", time.monotonic() + 30
        while len(reply.strip()) <= 5 and time.monotonic() < deadline:
            reply += _read_until(fd, None, 0.5)
        assert len(reply.strip()) > 5, transcript + reply
        os.write(fd, b"\x03")
        after = _read_until(fd, b">>> ", 30)
        assert b"reply stopped" in after, transcript + reply + after
        os.write(fd, b"half typed")
        time.sleep(0.3)
        os.write(fd, b"\x03")
        after += _read_until(fd, b"\n>>> ", 10)
        os.write(fd, b"\x03")
        after += _read_until(fd, None, 10)
        _, status = os.waitpid(pid, 0)
        pid = 0
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, transcript + reply + after
    assert b"Traceback" not in transcript + reply + after
