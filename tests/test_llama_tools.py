"""The backend library inside stock llama-cli, llama-server and llama-bench, built from the pinned
llama-cpp-python sdist against the wheel's libraries (scripts/build_llama_tools.sh; built on first use,
then reused while the wheel is the same).

Reference: the same tool, same flags, without GGML_BACKEND_PATH (exact modes); under a RAM budget (the
sparse lane over the flash cache, lossy), llamaflash.Llama at the same budget in the library's
configuration (see `llamaflash_tokens`). Tolerance: none — greedy tokens (llama-server) or text
(llama-cli) must be identical. Refusals: stock text, exactly one `llamaflash:` line on stderr, exit 0.
"""

from __future__ import annotations

import json
import os
import re
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
#: a llama-cli / llama-server chat template that is the identity on one user message, so the tokens the
#: tool evaluates are those of llama_cpp's tokenize(PROMPT) (BOS by the vocabulary's own flag)
IDENTITY_TEMPLATE = "{{ messages[0]['content'] }}"
N_PREDICT = 24
#: prompts of both prefill lanes under a budget: up to eval_shapes.MAX_ROWS (7) tokens a prompt runs on
#: the sparse lane, longer ones on the dense lane (the tests check the token counts)
PROMPTS = {"sparse-prefill": "The fox", "dense-prefill": "The quick brown fox jumps over the lazy dog. " * 2}


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


def cli(
    tools: Path, model: Path, flags: str, library: bool = True, env: dict | None = None, prompt: str = PROMPT
) -> tuple[str, list]:
    """(the completion llama-cli printed, its `llamaflash:` stderr lines); single turn, greedy. A prompt
    other than PROMPT runs with IDENTITY_TEMPLATE."""
    args = [str(tools / "llama-cli"), "-m", str(model), "-p", prompt, "-n", str(N_PREDICT), "--temp", "0", "-st"]
    args += ["--simple-io", "-t", "2", "--seed", "0", *flags.split()]
    if prompt != PROMPT:
        args += ["--chat-template", IDENTITY_TEMPLATE]
    r = subprocess.run(args, capture_output=True, text=True, env=run_env(library, env), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout.split("> " + prompt, 1)[1].split("[ Prompt:", 1)[0]
    return text, [line for line in r.stderr.splitlines() if line.startswith("llamaflash:")]


def offload_plan(model: Path, sidecar: Path, n_ctx: int, out: Path) -> tuple[dict, float]:
    """`llamaflash env` at the smallest budget it accepts for ``model`` (the minimum its refusal of 1
    MiB names): flash offload, the sparse lane over the neuron cache. Asserts that the plan leaves FFN
    clusters on flash (fewer pinned than the layers have), so decode reads from the sidecar. Returns
    (the exports, the budget in MiB)."""
    common = ["--sidecar", sidecar, "--flash-mode", "sparse", "--n-ctx", str(n_ctx), "-o", out]
    low = llamaflash_env(model, *common, "--ram-budget-mb", "1")
    assert low.returncode == 2, low.stderr
    budget = float(re.search(r"--ram-budget-mb (\d+)", low.stderr).group(1))
    r = llamaflash_env(model, *common, "--ram-budget-mb", str(budget))
    assert r.returncode == 0, r.stderr
    values = plan_file.read_plan_values(out)
    assert values[K.MODE] == "offload" and values[K.RAM_BUDGET_MB] == budget
    clusters = sum(-(-n_ff // values[K.SPARSE_CLUSTER_SIZE]) for n_ff in values[K.LAYER + "n_ff"])
    assert sum(values[K.OFFLOAD_HOT_COUNTS]) < clusters, "every cluster pinned: nothing read from flash"
    return exports(r.stdout), budget


def llamaflash_tokens(model: Path, sidecar: Path, budget: float, plan: Path, prompt: str) -> tuple[list, list, str]:
    """(prompt token ids, greedy token ids, their text) of llamaflash.Llama in the configuration the library runs
    for ``plan``: the same budget, sidecar, n_ctx, 2 threads, seed 0, flash_mode "sparse" (the plan's
    lane), speculation off (flash_speculative=False: the tools have none; with it, a lone decode row
    past 256 positions would be padded), the plan's n_batch / n_ubatch (the tools keep a prompt's compute
    pages, Llama frees them after it: Llama's own plan would take a larger n_ubatch). Llama frees a prompt's compute pages after it and the tools do not, so at the same budget
    Llama may pin more clusters (up to all of them): where rows come from does not change the tokens. Up to N_PREDICT tokens, stopping after an end-of-generation token as llama-server does."""
    import llama_cpp

    from llamaflash import Llama

    values = plan_file.read_plan_values(plan)
    llm = Llama(
        str(model),
        sidecar_path=str(sidecar),
        n_ctx=values[K.N_CTX],
        n_batch=values[K.N_BATCH],
        n_ubatch=values[K.N_UBATCH],
        n_threads=2,
        seed=0,
        verbose=False,
        flash_mode="sparse",
        ram_budget_mb=budget,
        flash_speculative=False,
    )
    try:
        assert llm.flash_mode == "offload"
        ids = llm.tokenize(prompt.encode(), special=True)
        out = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) >= N_PREDICT or llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
                break
        text = llm.detokenize(out).decode(errors="replace")  # random tiny models: invalid UTF-8
    finally:
        llm.close()
    return ids, out, text


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


@pytest.mark.real_model
@pytest.mark.parametrize("lane", sorted(PROMPTS))
def test_llama_cli_smollm2_under_a_budget_gives_the_text_of_llamaflash_llama(tools, smollm2_sidecar, tmp_path, lane):
    """SmolLM2 at the smallest budget `env` accepts (clusters on flash; sparse lane, lossy): llama-cli's
    greedy reply equals llamaflash.Llama's at the same budget and settings (llamaflash_tokens)."""
    from llamaflash.runtime.eval_shapes import MAX_ROWS

    model, sidecar = smollm2_sidecar
    plan = tmp_path / "s.plan.gguf"
    ex, budget = offload_plan(model, sidecar, 512, plan)
    ids, want, want_text = llamaflash_tokens(model, sidecar, budget, plan, PROMPTS[lane])
    assert (len(ids) <= MAX_ROWS) == (lane == "sparse-prefill"), ids
    text, lines = cli(tools, model, ex["LLAMAFLASH_TOOL_ARGS"], env={K.ENV_PLAN: ex[K.ENV_PLAN]}, prompt=PROMPTS[lane])
    assert len(want) > 5 and text.strip() == want_text.strip(), (text, want_text)
    assert lines[0].startswith("llamaflash: active:") and "offload" in lines[0], lines
    assert "FFN evaluations" in lines[-1] and "flash reads: 0 clusters" not in lines[-1], lines


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

    def tokens(self, prompt: list) -> list:
        """Greedy token ids that /completion generates for ``prompt`` (token ids, evaluated whole: no
        prompt cache), up to N_PREDICT."""
        body = {
            "prompt": prompt,
            "n_predict": N_PREDICT,
            "temperature": 0,
            "return_tokens": True,
            "cache_prompt": False,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())["tokens"]

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


@pytest.fixture(scope="module")
def offload(pair) -> tuple[dict, float, Path]:
    """The tiny pair planned at the smallest budget `env` accepts (offload_plan): (exports, budget, plan)."""
    plan = pair[0].with_name("offload.plan.gguf")
    ex, budget = offload_plan(pair[0], pair[1], 256, plan)
    return ex, budget, plan


@pytest.mark.parametrize("lane", sorted(PROMPTS))
def test_llama_server_under_a_budget_gives_the_tokens_of_llamaflash_llama(tools, pair, offload, tmp_path, lane):
    """A dense model under a budget (sparse lane over the flash cache, lossy): llama-server's greedy
    token ids for the prompt's ids equal llamaflash.Llama's at the same budget and settings
    (llamaflash_tokens), for a prompt on each prefill lane; the library read clusters from flash."""
    from llamaflash.runtime.eval_shapes import MAX_ROWS

    ex, budget, plan = offload
    ids, want, _ = llamaflash_tokens(pair[0], pair[1], budget, plan, PROMPTS[lane])
    assert (len(ids) <= MAX_ROWS) == (lane == "sparse-prefill"), ids
    served = Server(
        tools, pair[0], ex["LLAMAFLASH_TOOL_ARGS"], run_env(True, {K.ENV_PLAN: str(plan)}), tmp_path / "s.log"
    )
    try:
        got = served.tokens(ids)
    finally:
        log = served.stop()
    assert got == want and len(want) > 5
    lines = [line for line in log.splitlines() if line.startswith("llamaflash:")]
    assert "active:" in lines[0] and "offload" in lines[0], lines
    assert "sparse lane" in lines[-1] and "flash reads: 0 clusters" not in lines[-1], lines


def test_llama_server_locks_the_moe_dense_part_as_llamaflash_llama(tools, tiny_moe_factory, tmp_path):
    """An MoE model under a budget: the tool process locks the dense part of the base file in RAM
    (VmLck of llama-server, which locks nothing else without --mlock) exactly as llamaflash.Llama at
    the same budget does (flash_stats()["experts"]["dense_locked_bytes"]: the same ranges of the same
    mapping)."""
    from llamaflash import Llama
    from llamaflash.converters.pipeline import convert

    model = tmp_path / "moe.gguf"
    shutil.copyfile(tiny_moe_factory("qwen3moe"), model)
    convert(model, force=True, progress=False, profile=False)
    plan = tmp_path / "moe.plan.gguf"
    r = llamaflash_env(model, "--ram-budget-mb", "4000", "--expert-slots", "3", "--n-ctx", "256", "-o", plan)
    assert r.returncode == 0, r.stderr
    ex = exports(r.stdout)
    llm = Llama(str(model), n_ctx=256, n_threads=2, verbose=False, ram_budget_mb=4000, flash_expert_slots=3)
    try:
        assert llm.flash_mode == "experts"
        want = llm.flash_stats()["experts"]["dense_locked_bytes"]
    finally:
        llm.close()
    assert want > 0
    served = Server(
        tools, model, ex["LLAMAFLASH_TOOL_ARGS"], run_env(True, {K.ENV_PLAN: str(plan)}), tmp_path / "m.log"
    )
    try:
        status = Path(f"/proc/{served.proc.pid}/status").read_text()
    finally:
        log = served.stop()
    locked_kib = int(re.search(r"^VmLck:\s+(\d+) kB", status, re.M).group(1))
    assert locked_kib * 1024 == want, (locked_kib, want)
    lines = [line for line in log.splitlines() if line.startswith("llamaflash:")]
    assert any(line.startswith("llamaflash: locked the dense part in RAM") for line in lines), lines
