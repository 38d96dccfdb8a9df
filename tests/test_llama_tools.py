"""The backend library inside stock llama-cli, llama-server and llama-bench, built from the pinned
llama-cpp-python sdist against the wheel's libraries (scripts/build_llama_tools.sh; built on first use,
then reused while the wheel is the same).

Reference: the same tool, same flags, without GGML_BACKEND_PATH. Tolerance: none — greedy text must be
identical. Refusals: stock text, exactly one `llamaflash:` line on stderr, exit 0.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from test_backend_library import exports, llamaflash_env

from llamaflash.files import plan_file
from llamaflash.files import plan_keys as K

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox"


@pytest.fixture(scope="session")
def tools() -> Path:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_tools.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip().splitlines()[-1])


def run_env(library: bool, env: dict | None) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("GGML_BACKEND_PATH", K.ENV_PLAN)}
    if library:
        e["GGML_BACKEND_PATH"] = str(plan_file.library_path())
    e.update(env or {})
    return e


def cli(tools: Path, model: Path, flags: str, library: bool = True, env: dict | None = None) -> tuple[str, list]:
    """(the completion llama-cli printed, its `llamaflash:` stderr lines); single turn, greedy."""
    args = [str(tools / "llama-cli"), "-m", str(model), "-p", PROMPT, "-n", "24", "--temp", "0", "-st"]
    args += ["--simple-io", "-t", "2", "--seed", "0", *flags.split()]
    r = subprocess.run(args, capture_output=True, text=True, env=run_env(library, env), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout.split("> " + PROMPT, 1)[1].split("[ Prompt:", 1)[0]
    return text, [line for line in r.stderr.splitlines() if line.startswith("llamaflash:")]


@pytest.fixture(scope="module")
def pair(converted, tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tools")
    for p in converted:
        shutil.copyfile(p, d / p.name)
    return d / converted[0].name, d / converted[1].name


@pytest.fixture(scope="module")
def dense(pair) -> dict:
    r = llamaflash_env(pair[0], "--flash-mode", "dense", "-o", pair[0].with_name("dense.plan.gguf"))
    assert r.returncode == 0, r.stderr
    return exports(r.stdout)


def test_llama_cli_dense_mode_is_identical_to_stock(tools, pair, dense):
    flags = dense["LLAMAFLASH_TOOL_ARGS"]
    stock, _ = cli(tools, pair[0], flags, library=False)
    text, lines = cli(tools, pair[0], flags, env={K.ENV_PLAN: dense[K.ENV_PLAN]})
    assert text == stock and text.strip()
    assert lines[0].startswith("llamaflash: active:") and "FFN evaluations" in lines[-1], lines
    assert "served 0 " not in lines[-1]


@pytest.mark.real_model
def test_llama_cli_smollm2_dense_mode_is_identical_to_stock(tools, smollm2_sidecar, tmp_path):
    model, sidecar = smollm2_sidecar
    r = llamaflash_env(model, "--sidecar", sidecar, "--flash-mode", "dense", "-o", tmp_path / "s.plan.gguf")
    assert r.returncode == 0, r.stderr
    ex = exports(r.stdout)
    stock, _ = cli(tools, model, ex["LLAMAFLASH_TOOL_ARGS"], library=False)
    text, lines = cli(tools, model, ex["LLAMAFLASH_TOOL_ARGS"], env={K.ENV_PLAN: ex[K.ENV_PLAN]})
    assert text == stock and len(text.split()) > 5
    assert "FFN evaluations" in lines[-1] and "served 0 " not in lines[-1], lines


@pytest.mark.parametrize(
    "env, why",
    [
        ({}, "LLAMAFLASH_PLAN is not set"),
        ({K.ENV_EXPECT_GGML_COMMIT: "0000000"}, "built for ggml"),
    ],
)
def test_llama_cli_refusals_run_stock(tools, pair, dense, env, why):
    flags = dense["LLAMAFLASH_TOOL_ARGS"]
    stock, _ = cli(tools, pair[0], flags, library=False)
    full = {K.ENV_PLAN: dense[K.ENV_PLAN], **env} if K.ENV_EXPECT_GGML_COMMIT in env else env
    text, lines = cli(tools, pair[0], flags, env=full)
    assert text == stock
    assert len(lines) == 1 and why in lines[0] and lines[0].endswith("This run is stock llama.cpp."), lines


def test_llama_cli_wrong_sidecar_runs_stock(tools, pair, tmp_path):
    model, sidecar = (shutil.copyfile(p, tmp_path / p.name) for p in pair)
    r = llamaflash_env(model, "--flash-mode", "dense", "-o", tmp_path / "p.plan.gguf")
    ex = exports(r.stdout)
    sidecar.write_bytes(sidecar.read_bytes()[:-64] + bytes(64))  # same size, other bytes, new mtime
    stock, _ = cli(tools, model, ex["LLAMAFLASH_TOOL_ARGS"], library=False)
    text, lines = cli(tools, model, ex["LLAMAFLASH_TOOL_ARGS"], env={K.ENV_PLAN: ex[K.ENV_PLAN]})
    assert text == stock
    assert len(lines) == 1 and "changed since the plan was made" in lines[0], lines


def test_llama_cli_moe_experts_under_a_budget_are_identical_to_stock(tools, tiny_moe_factory, tmp_path):
    from llamaflash.converters.pipeline import convert

    model = tmp_path / "moe.gguf"
    shutil.copyfile(tiny_moe_factory("qwen3moe"), model)
    convert(model, force=True, progress=False, profile=False)
    r = llamaflash_env(model, "--ram-budget-mb", "4000", "--expert-slots", "3", "-o", tmp_path / "moe.plan.gguf")
    assert r.returncode == 0, r.stderr
    ex = exports(r.stdout)
    flags = ex["LLAMAFLASH_TOOL_ARGS"]
    assert "--no-repack" in flags
    stock, _ = cli(tools, model, flags, library=False)
    text, lines = cli(tools, model, flags, env={K.ENV_PLAN: ex[K.ENV_PLAN]})
    assert text == stock and text.strip()
    assert "expert splits" in lines[-1] and "served 0 " not in lines[-1], lines


def test_llama_bench_runs_with_the_library(tools, pair, dense):
    args = [str(tools / "llama-bench"), "-m", str(pair[0]), "-p", "16", "-n", "8", "-r", "1", "-t", "2", "-o", "csv"]
    stock = subprocess.run(args, capture_output=True, text=True, env=run_env(False, None), timeout=600)
    r = subprocess.run(args, capture_output=True, text=True, env=run_env(True, {K.ENV_PLAN: dense[K.ENV_PLAN]}))
    assert stock.returncode == 0 and r.returncode == 0, r.stderr[-2000:]
    assert len(r.stdout.strip().splitlines()) == len(stock.stdout.strip().splitlines()) == 3  # header, pp, tg
    lines = [line for line in r.stderr.splitlines() if line.startswith("llamaflash:")]
    assert lines[0].startswith("llamaflash: active:") and "served 0 " not in lines[-1], lines


class Server:
    """A llama-server process on a free port; ready once /health answers."""

    def __init__(self, tools: Path, model: Path, flags: str, env: dict, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        args = [str(tools / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["-t", "2", *flags.split()]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise AssertionError(f"llama-server not ready:\n{log.read_text()}")

    def answers(self) -> dict:
        import openai

        c = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "Name three colours."}]
        chat = c.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0, seed=0)
        stream = c.chat.completions.create(
            model="m", messages=messages, max_tokens=16, temperature=0, seed=0, stream=True
        )
        streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        completion = c.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0, seed=0)
        return {
            "chat": chat.choices[0].message.content,
            "stream": streamed,
            "completion": completion.choices[0].text,
        }

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        return self.log.read_text(errors="replace")


def test_llama_server_answers_openai_exactly_as_stock(tools, pair, dense, tmp_path):
    pytest.importorskip("openai")
    flags = dense["LLAMAFLASH_TOOL_ARGS"]
    stock = Server(tools, pair[0], flags, run_env(False, None), tmp_path / "stock.log")
    try:
        want = stock.answers()
    finally:
        stock.stop()
    served = Server(tools, pair[0], flags, run_env(True, {K.ENV_PLAN: dense[K.ENV_PLAN]}), tmp_path / "lib.log")
    try:
        got = served.answers()
    finally:
        log = served.stop()
    assert got == want and all(v for v in want.values())
    assert "llamaflash: active:" in log and "FFN evaluations" in log and "served 0 FFN" not in log


def test_llama_server_with_parallel_slots_is_refused(tools, pair, dense, tmp_path):
    flags = dense["LLAMAFLASH_TOOL_ARGS"].replace("-np 1", "")  # llama-server's default: auto (4 slots)
    s = Server(tools, pair[0], flags, run_env(True, {K.ENV_PLAN: dense[K.ENV_PLAN]}), tmp_path / "np.log")
    log = s.stop()
    lines = [line for line in log.splitlines() if line.startswith("llamaflash:")]
    assert len(lines) == 1 and "parallel sequences" in lines[0] and "-np 1" in lines[0], lines
