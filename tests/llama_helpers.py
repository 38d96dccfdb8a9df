"""Helpers for tests that run models through stock llama-cpp-python and through llamaflash."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PROMPT = "Once upon a time there was a quick brown fox that jumps over the lazy dog, and the cat sat on the mat."


@dataclass
class Run:
    prompt_logits: np.ndarray  # [n_prompt_tokens, n_vocab]
    generated: list[int]
    stats: dict


def run_model(llm, prompt: str = PROMPT, n_gen: int = 16) -> Run:
    """Evaluates `prompt` (one batch), then greedily generates `n_gen` tokens one at a time.

    The model must be created with logits_all=True so every prompt position's logits are kept."""
    tokens = llm.tokenize(prompt.encode())
    llm.reset()
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float32).copy()
    out: list[int] = []
    for _ in range(n_gen):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    stats = llm.flash_stats() if hasattr(llm, "flash_stats") else {}
    return Run(logits, out, stats)


def rel_max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(1e-6, float(np.abs(a).max())))


def run_in_subprocess(code: str, timeout: float = 300) -> dict:
    """Runs `code` (which must print one JSON line last) in a fresh interpreter; returns that JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)
