"""Benchmark plumbing shared by ``bench/*.py`` and ``llamaflash bench``.

- the fixed English prompt text (tokenised by a worker and truncated to exactly N tokens, so every
  configuration sees identical token ids);
- model resolution (asset name or path), page-cache warming, sha256;
- machine / version description, and the other load on a shared machine;
- the worker subprocess runner (:mod:`llamaflash.bench.worker`, run by file path in a fresh
  interpreter; one JSON result line per run, marked with :data:`RESULT_MARK`);
- medians, greedy agreement, JSON output.

Only the standard library is imported here: the process running a benchmark never loads a model,
each run does so in a fresh subprocess.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from .worker import PROGRESS_MARK, RESULT_MARK, STOCK_CONFIGS, cpu_busy_seconds

__all__ = [
    "PROMPT_TEXT",
    "RESULT_MARK",
    "PROGRESS_MARK",
    "STOCK_CONFIGS",
    "WORKER",
    "WorkerError",
    "cpu_busy_seconds",
    "machine_busy_fraction",
    "wait_until_quiet",
    "machine_info",
    "resolve_model",
    "sha256_file",
    "warm_page_cache",
    "sidecar_path_for",
    "run_worker",
    "worker_command",
    "parse_worker_output",
    "require_ok",
    "prompt_tokens",
    "timed_run",
    "median",
    "greedy_agreement",
    "write_json",
    "timestamp",
]

#: The worker script; run it by path (``python WORKER '<json spec>'``), see :mod:`llamaflash.bench.worker`.
WORKER = Path(__file__).resolve().with_name("worker.py")


# A fixed, original English text (~530 tokens with the Llama/Qwen/Gemma tokenisers).  Prompts are
# its first N tokens; it is repeated if N is larger.  Changing it changes every benchmark: don't.
PROMPT_TEXT = (
    "The old harbour town sits at the mouth of a slow brown river, where the water from the hills "
    "meets the grey sea and the two argue politely for most of the year. Every morning before dawn "
    "the fishing boats go out past the lighthouse, and every evening they come back with whatever "
    "the tide allowed: mackerel in summer, herring in the autumn, and in the long winter months "
    "mostly stories about the fish that got away. The lighthouse keeper, a patient woman named "
    "Margaret, has kept a logbook for thirty-one years. In it she writes the weather, the wind "
    "direction, the height of the waves at noon, and the names of the boats that passed. Nobody "
    "asked her to do this. The light has been automatic since before she arrived, and the "
    "harbour authority sends an engineer twice a year to check the lamp and the batteries. But "
    "Margaret believes that a place is only understood by someone who pays attention to it every "
    "single day, and so she pays attention.\n\n"
    "Her logbooks fill two shelves in the small kitchen at the base of the tower. Researchers from "
    "the university came one spring to copy them, because thirty years of careful daily "
    "observations turned out to be worth more than they had imagined. They found that the storms "
    "had shifted later in the year, that the prevailing wind had turned a few degrees toward the "
    "south, and that the number of boats had fallen by half and then, more recently, begun to "
    "rise again as younger families returned to the town. None of these changes would have been "
    "visible from a single year, or even from five. They appeared only when the pages were laid "
    "side by side, one ordinary day after another, until the pattern could not be ignored.\n\n"
    "Margaret was pleased but not surprised. She had always thought of the logbook as a kind of "
    "conversation with the future, a way of telling someone she would never meet what it had "
    "been like to stand on this particular rock and watch this particular sea. When the "
    "researchers asked what she would do differently if she started again, she thought about it "
    "for a long time. Then she said that she would have written down more about the people: who "
    "came to the harbour to watch the boats leave, who waited on the quay when the weather turned "
    "bad, who laughed and who stayed silent. The numbers, she said, tell you what happened. Only "
    "the people tell you what it meant. The researchers wrote that down too, and it became the "
    "first line of the report they published the following winter, which the town library keeps "
    "on a shelf by the window, next to a photograph of the lighthouse in a storm."
)


# --------------------------------------------------------------------------------------------
# model files


def resolve_model(model: str) -> tuple[Path, str, str]:
    """(path, short name, sha256) for an asset name (fetched and verified) or a GGUF path."""
    from llamaflash.files import assets

    if model in assets.MODELS:
        path = assets.fetch_model(model)
        return path, model, assets.MODELS[model].sha256
    path = Path(model).expanduser().resolve()
    if not path.is_file():
        raise SystemExit(f"model {model!r} is neither a known asset ({', '.join(assets.list_models())}) nor a file")
    return path, path.stem, sha256_file(path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(8 << 20):
            h.update(b)
    return h.hexdigest()


def warm_page_cache(path: Path) -> float:
    """Read a file once so an in-memory benchmark starts with it in the page cache; returns seconds."""
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    return time.perf_counter() - t


def sidecar_path_for(model: Path) -> Path:
    """Where llamaflash expects the sidecar of ``model``: ``<stem>.flash.gguf`` beside it."""
    return model.with_name(model.stem + ".flash.gguf")


# --------------------------------------------------------------------------------------------
# machine


def _pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def files_record(model_path: Path, model_name: str, model_sha: str, sidecar: Path | None) -> dict[str, Any]:
    """The ``model`` and ``sidecar`` entries of a benchmark's JSON (sidecar None: no llamaflash config)."""
    return {
        "model": {
            "name": model_name,
            "path": str(model_path),
            "sha256": model_sha,
            "bytes": model_path.stat().st_size,
        },  # fmt: skip
        "sidecar": {"path": str(sidecar), "bytes": sidecar.stat().st_size} if sidecar is not None else None,
    }


def machine_info() -> dict[str, Any]:
    cpu = None
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if cpu is None and line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            if not flags and line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    mem_total_kb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total_kb = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpu": cpu or platform.processor(),
        "cores_online": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "simd": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "f16c", "fma") if f in flags],
        "mem_total_mb": round(mem_total_kb / 1024) if mem_total_kb else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "llama_cpp_python": _pkg_version("llama_cpp_python"),
        "llamaflash": _pkg_version("llamaflash"),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


# --------------------------------------------------------------------------------------------
# other load on the machine (the benchmarks share a small machine: measure, don't assume, quiet)


def machine_busy_fraction(seconds: float = 1.0) -> float:
    """Fraction of all cores busy over the next ``seconds`` (this process sleeps meanwhile)."""
    b0, t0 = cpu_busy_seconds(), time.monotonic()
    time.sleep(seconds)
    return (cpu_busy_seconds() - b0) / ((time.monotonic() - t0) * (os.cpu_count() or 1))


def wait_until_quiet(max_wait: float, threshold: float = 0.10, window: float = 1.0) -> float:
    """Sleep until the machine is at most ``threshold`` busy over one ``window`` (or ``max_wait``
    seconds have passed); returns the last busy fraction measured."""
    deadline = time.monotonic() + max_wait
    busy = machine_busy_fraction(window)
    while busy > threshold and time.monotonic() < deadline:
        busy = machine_busy_fraction(window)
    return busy


# --------------------------------------------------------------------------------------------
# subprocesses


class WorkerError(RuntimeError):
    pass


def run_worker(
    spec: dict[str, Any],
    *,
    timeout: float | None = 900,
    env: dict[str, str] | None = None,
    cmd_prefix: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the worker with ``spec`` (JSON) in a fresh interpreter; return its result dict.

    ``cmd_prefix`` lets a caller wrap the command (e.g. to start it inside a memory cgroup).
    Raises WorkerError with the exit status and stderr tail when no result line comes back.
    """
    cmd = [*cmd_prefix, *worker_command(spec)]
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as e:
        raise WorkerError(f"worker timed out after {timeout}s: {spec.get('config')}") from e
    result, _ = parse_worker_output(proc.stdout)
    if result is not None:
        if proc.returncode != 0:
            result.setdefault("warnings", []).append(f"worker exit status {proc.returncode}")
        return result
    tail = "\n".join((proc.stderr or "").strip().splitlines()[-25:])
    raise WorkerError(f"worker for {spec.get('config')!r} exited {proc.returncode} without a result:\n{tail}")


def worker_command(spec: dict[str, Any]) -> list[str]:
    """argv that runs one worker with ``spec`` in a fresh interpreter."""
    return [sys.executable, str(WORKER), json.dumps(spec)]


def parse_worker_output(stdout: str | None) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the result dict or None, the progress dicts in order) from a worker's stdout."""
    result, progress = None, []
    for line in (stdout or "").splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK) :])
        elif line.startswith(PROGRESS_MARK):
            progress.append(json.loads(line[len(PROGRESS_MARK) :]))
    return result, progress


def require_ok(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` if the worker's run succeeded (``"ok"``); else WorkerError with its error and traceback."""
    if not result.get("ok"):
        raise WorkerError(
            f"worker for {result.get('config')!r} failed: {result.get('error')}\n{result.get('traceback', '')}".rstrip()
        )
    return result


def prompt_tokens(model: Path | str, n_prompt: int, threads: int = 1, timeout: float | None = 900) -> list[int]:
    """The first ``n_prompt`` tokens of :data:`PROMPT_TEXT` (repeated as needed) in ``model``'s
    vocabulary, BOS first where the model adds one; tokenized by a worker (vocabulary only)."""
    tok = run_worker(
        {
            "mode": "tokenize",
            "model": str(model),
            "config": "tokenize",
            "prompt_text": PROMPT_TEXT,
            "n_prompt": n_prompt,
            "threads": threads,
        },
        timeout=timeout,
    )
    return require_ok(tok)["prompt_tokens"]


def timed_run(
    model: Path | str,
    config: str,
    prompt: Sequence[int],
    n_gen: int,
    threads: int,
    timeout: float | None = 900,
    **spec: Any,
) -> dict[str, Any]:
    """One "run" of the worker in a fresh process: load ``model`` as ``config`` (``spec``: more worker
    keys, e.g. ``sidecar_path``, ``flash_mode``), warm up, prefill ``prompt`` as one batch, decode
    ``n_gen`` greedy tokens one at a time, each step timed (see :mod:`llamaflash.bench.worker`).
    Returns the result dict (``prefill_tps``, ``decode_tps``, ``tokens``, ``flash_stats``, ...);
    WorkerError if the run failed. The context holds the prompt and the generated tokens."""
    n_ctx = max(512, len(prompt) + n_gen + 1)
    return require_ok(
        run_worker(
            {
                "mode": "run",
                "model": str(model),
                "config": config,
                "prompt_tokens": list(prompt),
                "n_gen": n_gen,
                "threads": threads,
                "n_ctx": n_ctx,
                **spec,
            },
            timeout=timeout,
        )
    )


# --------------------------------------------------------------------------------------------
# statistics and output


def median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def greedy_agreement(ref: Sequence[int], toks: Sequence[int]) -> tuple[float, int | None]:
    """(fraction of positions with identical tokens, index of the first difference or None)."""
    n = min(len(ref), len(toks))
    if n == 0:
        return 0.0, 0
    same = sum(1 for a, b in zip(ref[:n], toks[:n]) if a == b)
    first = next((i for i, (a, b) in enumerate(zip(ref[:n], toks[:n])) if a != b), None)
    if first is None and len(ref) != len(toks):
        first = n
    return same / max(len(ref), len(toks)), first


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
