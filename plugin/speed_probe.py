"""One timed greedy run of a model, in its own process: prefill and decode speed, tokens and text.

`python -m llamaflash.speed_probe SPEC_JSON` loads the model described by SPEC_JSON (see `ProbeSpec`)
with stock `llama_cpp.Llama` or with `llamaflash.Llama`, evaluates the prompt as one batch, decodes
`max_tokens` greedy tokens one at a time, and prints one JSON line (`ProbeResult`) on stdout. Each run
is a fresh interpreter so that runs do not share page cache state, allocator state or OpenMP pools,
and so that a crash or an OOM kill of one run is reported instead of ending the caller.

Used by the machine tuning (`lane_decision.measure`) and by `llamaflash demo`.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

#: A fixed English prompt of about 200 tokens for speed measurements (content does not matter for
#: speed; a realistic length does, because prefill runs as one batch).
SPEED_PROMPT = (
    "The history of the printing press begins in the middle of the fifteenth century, when a goldsmith "
    "in Mainz combined a screw press, oil-based ink and movable metal type into a system that could "
    "produce books far faster than any scribe. Within fifty years presses were at work in more than two "
    "hundred European towns, and millions of volumes had been printed: bibles and grammars, calendars and "
    "sermons, almanacs, maps and the first newspapers. Printing lowered the price of a book, spread the "
    "same text unchanged to distant readers, and made it possible to correct an error once and for all "
    "readers of the next edition. Scholars argue about how quickly these effects were felt, but most "
    "agree that the press changed how knowledge was stored, checked and shared. Explain, in a few short "
    "paragraphs, what the most important consequences of printing were for science, for religion and "
    "for the everyday life of ordinary people, and give one concrete example of each."
)


@dataclass
class ProbeSpec:
    """What one probe run loads and measures. `engine`: "stock" (llama_cpp.Llama) or "llamaflash"
    (llamaflash.Llama with `llama_kwargs` as given, e.g. sidecar_path, flash_mode, ram_budget_mb)."""
    engine: str
    model: str
    prompt: str = SPEED_PROMPT
    max_tokens: int = 64
    n_threads: int = 2
    n_ctx: int = 1024
    chat_template: bool = False  # wrap the prompt in the model's own chat template
    ignore_eos: bool = False  # decode exactly max_tokens (speed measurements), not stopping at EOS
    llama_kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ProbeResult:
    engine: str
    text: str
    tokens: List[int]
    prompt_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    load_s: float
    stats: Optional[Dict[str, Any]]


def _format_prompt(llm, prompt: str) -> str:
    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        return prompt
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    def vocab(t):
        return llm.detokenize([t], special=True).decode("utf-8", errors="replace")

    fmt = Jinja2ChatFormatter(template=template, eos_token=vocab(llm.token_eos()), bos_token=vocab(llm.token_bos()))
    return fmt(messages=[{"role": "user", "content": prompt}]).prompt


def run_in_process(spec: ProbeSpec) -> ProbeResult:
    """Loads, prefills and decodes in this process (the body of a probe run)."""
    import numpy as np
    import llama_cpp

    kwargs = dict(n_ctx=spec.n_ctx, n_threads=spec.n_threads, n_threads_batch=spec.n_threads, verbose=False)
    t0 = time.perf_counter()
    if spec.engine == "llamaflash":
        from llamaflash import Llama

        llm = Llama(model_path=spec.model, **kwargs, **spec.llama_kwargs)
    elif spec.engine == "stock":
        llm = llama_cpp.Llama(model_path=spec.model, **kwargs)
    else:
        raise ValueError(f"engine={spec.engine!r}: use 'stock' or 'llamaflash'")
    load_s = time.perf_counter() - t0
    templated = spec.chat_template and bool(llm.metadata.get("tokenizer.chat_template"))
    prompt = _format_prompt(llm, spec.prompt) if templated else spec.prompt
    tokens = llm.tokenize(prompt.encode(), add_bos=not templated, special=True)  # a template writes its own BOS
    n_vocab = llm.n_vocab()

    def greedy() -> int:  # logits of the last evaluated token (llm.scores holds them only with logits_all)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    llm.eval(tokens[:8])  # warm-up: first-touch page faults, thread pool start-up (not timed)
    llm.reset()           # the next eval clears the KV cache from position 0
    t0 = time.perf_counter()
    llm.eval(tokens)
    prefill_s = time.perf_counter() - t0
    out: List[int] = []
    t0 = time.perf_counter()
    for _ in range(spec.max_tokens):
        tok = greedy()
        if tok == llm.token_eos() and not spec.ignore_eos:
            break
        out.append(tok)
        llm.eval([tok])
    decode_s = time.perf_counter() - t0
    stats = llm.flash_stats() if hasattr(llm, "flash_stats") else None
    return ProbeResult(engine=spec.engine, text=llm.detokenize(out).decode("utf-8", errors="replace"), tokens=out,
                       prompt_tokens=len(tokens), prefill_tok_s=len(tokens) / prefill_s,
                       decode_tok_s=len(out) / decode_s if out else 0.0, load_s=load_s, stats=stats)


class ProbeFailed(RuntimeError):
    def __init__(self, spec: ProbeSpec, returncode: int, stderr: str):
        super().__init__(f"{spec.engine} run of {spec.model} failed (exit {returncode}):\n{stderr[-2000:]}")
        self.returncode = returncode


def run(spec: ProbeSpec, timeout: Optional[float] = None) -> ProbeResult:
    """One probe run in a fresh interpreter. Raises ProbeFailed with its stderr."""
    cmd = [sys.executable, "-m", "llamaflash.speed_probe", json.dumps(dataclasses.asdict(spec))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise ProbeFailed(spec, proc.returncode, proc.stderr)
    return ProbeResult(**json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m llamaflash.speed_probe SPEC_JSON\n")
        return 2
    result = run_in_process(ProbeSpec(**json.loads(argv[0])))
    print(json.dumps(dataclasses.asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
