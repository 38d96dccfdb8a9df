"""The backend library (libllamaflash_backend.so) loaded the way stock llama.cpp tools load it:
``ggml_backend_load_all()`` with GGML_BACKEND_PATH, configured by the plan `llamaflash env` writes.

The host is tests/tool_host.py (stock llama_cpp.Llama in a fresh process, after ggml_backend_load_all);
tests/test_llama_tools.py runs the real llama-cli / llama-server. Reference: the same host without the
library. Tolerance: none — greedy token ids must be identical (exact modes), and a refusal must leave the
output identical to stock, print exactly one `llamaflash:` line on stderr and exit 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llamaflash.files import plan_file
from llamaflash.files import plan_keys as K

HOST = Path(__file__).with_name("tool_host.py")
PROMPT = "The quick brown fox"
N_TOKENS = 24


def llamaflash_env(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llamaflash", "env", *map(str, args)], capture_output=True, text=True, timeout=600
    )


def exports(stdout: str) -> dict:
    """The variables `llamaflash env` exports (parsed as the shell would)."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("export "):
            name, value = line[len("export ") :].split("=", 1)
            out[name] = subprocess.run(["sh", "-c", f"printf %s {value}"], capture_output=True, text=True).stdout
    return out


def host(model: Path, flags: str = "", env: dict | None = None, library: bool = True) -> tuple[dict, list]:
    """(JSON result, llamaflash stderr lines) of tool_host.py; ``env`` adds to a clean environment."""
    e = {k: v for k, v in os.environ.items() if k not in ("GGML_BACKEND_PATH", K.ENV_PLAN)}
    if library:
        e["GGML_BACKEND_PATH"] = str(plan_file.library_path())
    e.update(env or {})
    r = subprocess.run(
        [sys.executable, str(HOST), str(model), PROMPT, str(N_TOKENS), *flags.split()],
        capture_output=True,
        text=True,
        env=e,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), [line for line in r.stderr.splitlines() if line.startswith("llamaflash:")]


@pytest.fixture(scope="module")
def pair(converted, tmp_path_factory) -> tuple[Path, Path]:
    """A private copy of the converted tiny Q8_0 pair (the tests change files)."""
    d = tmp_path_factory.mktemp("library")
    model, sidecar = converted
    shutil.copyfile(model, d / model.name)
    shutil.copyfile(sidecar, d / sidecar.name)
    return d / model.name, d / sidecar.name


@pytest.fixture(scope="module")
def dense_plan(pair) -> dict:
    model, _ = pair
    r = llamaflash_env(model, "--flash-mode", "dense", "-o", model.with_name("dense.plan.gguf"))
    assert r.returncode == 0, r.stderr
    return exports(r.stdout)


@pytest.fixture(scope="module")
def stock_tokens(pair) -> list:
    return host(pair[0], library=False)[0]["tokens"]


def test_library_is_installed_and_exports_the_entry_points():
    lib = plan_file.library_path()
    assert lib.exists()
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    assert " T ggml_backend_init" in symbols and " T ggml_backend_score" in symbols


def test_env_prints_exports_and_writes_the_plan(pair, dense_plan):
    model, sidecar = pair
    assert dense_plan["GGML_BACKEND_PATH"] == str(plan_file.library_path())
    values = plan_file.read_plan_values(dense_plan[K.ENV_PLAN])
    assert values[K.FORMAT] == K.FORMAT_VERSION
    assert values[K.KIND] == K.KIND_DENSE and values[K.MODE] == "dense"
    assert values[K.MODEL_PATH] == str(model) and values[K.SIDECAR_PATH] == str(sidecar)
    assert values[K.MODEL_SIZE] == model.stat().st_size
    assert values[K.GGML_COMMIT] == plan_file.ggml_identity()[0]
    assert values[K.SPARSE_ENABLED] is False and values[K.OFFLOAD] is False
    assert len(values[K.LAYER + "layer"]) == 2
    assert dense_plan["LLAMAFLASH_TOOL_ARGS"] == "-ot llamaflash=CPU -c 512 -np 1"


def test_dense_mode_is_identical_to_stock(pair, dense_plan, stock_tokens):
    result, lines = host(pair[0], dense_plan["LLAMAFLASH_TOOL_ARGS"], {K.ENV_PLAN: dense_plan[K.ENV_PLAN]})
    assert "LLAMAFLASH" in result["devices"]
    assert result["tokens"] == stock_tokens
    assert lines[0].startswith("llamaflash: active:"), lines
    # the exit line: the FFN layers really ran on the device (2 layers x every ubatch)
    served = [line for line in lines if "FFN evaluations" in line]
    assert served and not served[0].startswith("llamaflash: served 0 "), lines


def refused(pair, stock_tokens, env: dict, flags: str = "-c 512 -np 1") -> str:
    """Runs the host with the library and ``env``; asserts a refusal and returns its one line."""
    result, lines = host(pair[0], flags, env)
    assert result["devices"] == ["CPU"]
    assert result["tokens"] == stock_tokens
    assert len(lines) == 1, lines
    assert lines[0].startswith("llamaflash: not active: ") and lines[0].endswith("This run is stock llama.cpp.")
    return lines[0]


def test_no_configuration_is_refused(pair, stock_tokens):
    line = refused(pair, stock_tokens, {})
    assert "LLAMAFLASH_PLAN is not set" in line and "llamaflash env" in line


def test_mismatched_ggml_build_is_refused(pair, dense_plan, stock_tokens):
    line = refused(pair, stock_tokens, {K.ENV_PLAN: dense_plan[K.ENV_PLAN], K.ENV_EXPECT_GGML_COMMIT: "0000000"})
    assert "built for ggml" in line and "commit 0000000" in line


def test_parallel_sequences_are_refused(pair, dense_plan, stock_tokens):
    line = refused(pair, stock_tokens, {K.ENV_PLAN: dense_plan[K.ENV_PLAN]}, "-c 512 -np 4")
    assert "4 parallel sequences" in line and "-np 1" in line


def test_missing_or_damaged_plan_is_refused(pair, stock_tokens, tmp_path):
    line = refused(pair, stock_tokens, {K.ENV_PLAN: str(tmp_path / "none.plan.gguf")})
    assert "does not exist" in line
    bad = tmp_path / "bad.plan.gguf"
    bad.write_bytes(b"not a gguf")
    assert "not a GGUF" in refused(pair, stock_tokens, {K.ENV_PLAN: str(bad)})


def test_changed_sidecar_is_refused(pair, stock_tokens, tmp_path):
    model, sidecar = (shutil.copyfile(p, tmp_path / p.name) for p in pair)
    plan = tmp_path / "p.plan.gguf"
    assert llamaflash_env(model, "--flash-mode", "dense", "-o", plan).returncode == 0
    os.utime(sidecar, ns=(sidecar.stat().st_atime_ns, sidecar.stat().st_mtime_ns + 10**9))
    line = refused((model, sidecar), stock_tokens, {K.ENV_PLAN: str(plan)})
    assert "changed since the plan was made" in line and str(sidecar) in line


def test_sidecar_of_another_model_is_refused_by_env(pair, tiny_model_factory, tmp_path):
    other = tmp_path / "other.gguf"
    shutil.copyfile(tiny_model_factory(weight_type="Q8_0", n_embd=96, n_ff=192, seed=5), other)
    r = llamaflash_env(other, "--flash-mode", "dense", "--sidecar", pair[1], "-o", tmp_path / "x.plan.gguf")
    assert r.returncode == 2
    assert "llamaflash" in r.stderr and not (tmp_path / "x.plan.gguf").exists()


def test_a_model_the_plan_does_not_serve_runs_stock(pair, dense_plan, tiny_model_factory, tmp_path):
    other = tmp_path / "other.gguf"  # same architecture and shapes, other weights
    shutil.copyfile(tiny_model_factory(weight_type="Q8_0", n_embd=96, n_ff=192, seed=5), other)
    stock = host(other, library=False)[0]["tokens"]
    result, lines = host(other, "-c 512 -np 1", {K.ENV_PLAN: dense_plan[K.ENV_PLAN]})
    assert result["tokens"] == stock
    refusals = [line for line in lines if "not active" in line]
    assert len(refusals) == 1 and "is not '" in refusals[0], lines
    assert any("served 0 FFN evaluations" in line for line in lines), lines


def test_budget_flags_beyond_the_plan_are_refused(pair, stock_tokens, tmp_path):
    model, _ = pair
    plan = tmp_path / "o.plan.gguf"
    r = llamaflash_env(model, "--flash-mode", "sparse", "--ram-budget-mb", "4000", "--n-ctx", "256", "-o", plan)
    assert r.returncode == 0, r.stderr
    line = refused(pair, stock_tokens, {K.ENV_PLAN: str(plan)}, "-c 512 -np 1")
    assert "counted -c 256" in line


def test_offload_gives_the_tokens_of_llamaflash_llama(pair, tmp_path):
    """A dense model under a budget (sparse lane over the flash cache, lossy): the library gives the
    tokens llamaflash.Llama gives at the same budget and settings (speculation off: tools have none)."""
    from llamaflash import Llama

    model, _ = pair
    plan = tmp_path / "o.plan.gguf"
    r = llamaflash_env(model, "--flash-mode", "sparse", "--ram-budget-mb", "4000", "--n-ctx", "256", "-o", plan)
    assert r.returncode == 0, r.stderr
    ex = exports(r.stdout)
    assert "-fa on --no-repack" in ex["LLAMAFLASH_TOOL_ARGS"]
    result, lines = host(model, ex["LLAMAFLASH_TOOL_ARGS"], {K.ENV_PLAN: str(plan)})
    assert "LLAMAFLASH" in result["devices"], lines
    llm = Llama(
        str(model),
        n_ctx=256,
        n_threads=2,
        seed=0,
        verbose=False,
        flash_mode="sparse",
        ram_budget_mb=4000,
        flash_speculative=False,
    )
    want = []
    for token in llm.generate(llm.tokenize(PROMPT.encode()), top_k=1, temp=0.0, reset=True):
        want.append(int(token))
        if len(want) >= N_TOKENS or token == llm.token_eos():
            break
    assert llm.flash_mode == "offload"
    assert result["tokens"] == want
    assert any("sparse lane" in line and "served 0 " not in line for line in lines), lines


def test_moe_experts_under_a_budget_are_identical_to_stock(tiny_moe_factory, tmp_path):
    from llamaflash.converters.pipeline import convert

    model = tmp_path / "moe.gguf"
    shutil.copyfile(tiny_moe_factory("qwen3moe"), model)
    convert(model, force=True, progress=False, profile=False)
    plan = tmp_path / "moe.plan.gguf"
    r = llamaflash_env(model, "--ram-budget-mb", "4000", "--expert-slots", "3", "--n-ctx", "256", "-o", plan)
    assert r.returncode == 0, r.stderr
    ex = exports(r.stdout)
    values = plan_file.read_plan_values(plan)
    assert values[K.KIND] == K.KIND_EXPERTS and set(values[K.EXPERTS_N_SLOTS]) == {3}
    assert values[K.EXPERTS_PREFETCH] and values[K.EXPERTS_OVERLAP]
    flags = ex["LLAMAFLASH_TOOL_ARGS"]
    stock = host(model, flags, library=False)[0]["tokens"]
    result, lines = host(model, flags, {K.ENV_PLAN: str(plan)})
    assert "LLAMAFLASH" in result["devices"], lines
    assert result["tokens"] == stock
    served = [line for line in lines if "expert splits" in line]
    assert served and "misses" in served[0] and "served 0 " not in served[0], lines
