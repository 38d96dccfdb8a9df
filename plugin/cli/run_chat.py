"""``llamaflash run`` (one prompt, the reply streamed to stdout) and ``llamaflash chat`` (interactive,
the model's chat template, streaming, history).

Contracts: replies go to stdout, everything else (fetching, loading, the lane in use, the no-sidecar
notice) to stderr, so ``llamaflash run m "q" > answer.txt`` captures only the answer. Ctrl-C stops the
reply being generated (``run`` then exits with status 130; ``chat`` keeps what was shown and asks for the
next message); in ``chat``, Ctrl-D (end of input) or Ctrl-C at an empty prompt quits. No traceback for
any of these.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, TextIO

from .models_by_name import resolve_model

#: llama.cpp rounds the context size up to a multiple of this.
CONTEXT_PAD = 256


@dataclass
class LoadOptions:
    """What ``run``, ``chat`` (and the model half of ``serve``) pass to ``llamaflash.Llama``."""

    sidecar: Optional[str] = None
    flash_mode: Optional[str] = None
    ram_budget_mb: Optional[float] = None
    n_ctx: int = 2048
    threads: Optional[int] = None
    deterministic: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)

    def llama_kwargs(self) -> Dict[str, Any]:
        # llama.cpp pads the context to a multiple of CONTEXT_PAD while llama-cpp-python sizes its token
        # buffer by the n_ctx asked for: a prompt between the two fails inside llama-cpp-python
        # ("could not broadcast ..."), so the size asked for is the padded one
        n_ctx = -(-self.n_ctx // CONTEXT_PAD) * CONTEXT_PAD
        kwargs: Dict[str, Any] = {"n_ctx": n_ctx, "verbose": False, **self.extra}
        if self.threads is not None:
            kwargs["n_threads"] = self.threads
        if self.deterministic:
            kwargs["deterministic"] = True
        for key, value in (
            ("sidecar_path", self.sidecar),
            ("flash_mode", self.flash_mode),
            ("ram_budget_mb", self.ram_budget_mb),
        ):
            if value is not None:
                kwargs[key] = value
        return kwargs


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def plain_notices() -> Iterator[None]:
    """Within: llamaflash's own notices (LlamaflashWarning, e.g. "no sidecar ... running as stock") are
    printed to stderr as plain lines when the block ends, without the warnings module's file:line prefix;
    other warnings are shown as usual."""
    from ..runtime.llama import LlamaflashWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LlamaflashWarning)
        try:
            yield
        finally:
            notices = list(caught)
    for w in notices:
        if issubclass(w.category, LlamaflashWarning):
            say(str(w.message))
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def describe_lane(llm) -> str:
    """One phrase: which lane serves the FFN layers, and why when it is stock."""
    mode = llm.flash_mode
    if mode == "offload":
        return f"flash offload within {llm.flash_plan.budget_bytes / (1 << 20):.0f} MiB"
    if mode == "stock":
        decision = llm.flash_stats().get("decision")
        return "stock llama.cpp" + (f" ({decision['reason']})" if decision else "")
    return f"llamaflash {mode} lane"


def untiled_for_determinism() -> None:
    """``--deterministic`` on the command line (every model of the process deterministic): ggml-cpu's
    tiled K-quant kernel off for this process (``GGML_CPU_TILED_MM=0`` unless the environment sets it),
    so that deterministic batches take up to 63 rows instead of 7 (eval_shapes.UNTILED_MAX_ROWS).
    ggml reads the variable at the process's first K-quant matmul: called before any model loads."""
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")


def load_model(model: str, options: LoadOptions):
    """Resolve ``model`` (a file or a registry name, fetched on first use) and load it, saying on stderr
    what is loading, how long it took and which lane runs it."""
    if options.deterministic:
        untiled_for_determinism()
    path = resolve_model(model, progress=True)
    say(f"llamaflash: loading {path} ...")
    start = time.perf_counter()
    from ..runtime.llama import Llama

    with plain_notices():
        llm = Llama(model_path=str(path), **options.llama_kwargs())
    say(f"llamaflash: loaded in {time.perf_counter() - start:.1f} s, {describe_lane(llm)}")
    return llm


def sampling_kwargs(max_tokens: Optional[int], temperature: Optional[float], seed: Optional[int]) -> Dict[str, Any]:
    """Only what the user set: llama-cpp-python's own defaults apply to the rest."""
    kwargs: Dict[str, Any] = {"max_tokens": max_tokens if max_tokens and max_tokens > 0 else None}
    if temperature is not None:
        kwargs["temperature"] = temperature
    if seed is not None:
        kwargs["seed"] = seed
    return kwargs


def _chat_pieces(stream: Iterator[dict]) -> Iterator[str]:
    for chunk in stream:
        text = chunk["choices"][0]["delta"].get("content")
        if text:
            yield text


def _completion_pieces(stream: Iterator[dict]) -> Iterator[str]:
    for chunk in stream:
        text = chunk["choices"][0]["text"]
        if text:
            yield text


def stream_out(pieces: Iterator[str], out: TextIO) -> tuple[str, bool]:
    """Write ``pieces`` to ``out`` as they come; returns (the text written, whether Ctrl-C stopped it).
    The stream is closed either way (llama.cpp's generator finishes)."""
    written: List[str] = []
    interrupted = False
    try:
        for piece in pieces:
            out.write(piece)
            out.flush()
            written.append(piece)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()
    return "".join(written), interrupted


def run_prompt(llm, prompt: str, *, raw: bool, sampling: Dict[str, Any], out: TextIO = sys.stdout) -> bool:
    """Stream the reply to ``prompt`` to ``out``: through the model's chat template as one user message,
    or (``raw``) as a plain completion of the text. Returns False when Ctrl-C stopped it."""
    if raw:
        pieces = _completion_pieces(llm.create_completion(prompt, stream=True, **sampling))
    else:
        pieces = _chat_pieces(
            llm.create_chat_completion(messages=[{"role": "user", "content": prompt}], stream=True, **sampling)
        )
    _, interrupted = stream_out(pieces, out)
    out.write("\n")
    out.flush()
    return not interrupted


CHAT_HELP = (
    "Ctrl-C stops a reply; Ctrl-D, or Ctrl-C at an empty prompt, quits. /reset forgets the conversation, /exit quits."
)


def _is_context_overflow(error: ValueError) -> bool:
    return "exceed context window" in str(error)


class ChatSession:
    """A conversation with the model: the history (system message, then user/assistant turns) is sent
    whole through the model's chat template each turn. When it no longer fits the context, the oldest
    turns are dropped (the system message stays)."""

    def __init__(self, llm, system: Optional[str], sampling: Dict[str, Any]) -> None:
        self.llm = llm
        self.sampling = sampling
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: List[Dict[str, str]] = []

    def reset(self) -> None:
        self.turns = []

    def reply(self, message: str, out: TextIO) -> bool:
        """Stream the reply to ``message`` to ``out`` and keep both in the history (a reply stopped by
        Ctrl-C is kept as far as it was shown). Returns False when Ctrl-C stopped it."""
        self.turns.append({"role": "user", "content": message})
        while True:
            stream = self.llm.create_chat_completion(messages=self.system + self.turns, stream=True, **self.sampling)
            pieces = _chat_pieces(stream)
            try:
                first = next(pieces, None)  # the prompt is evaluated here: an overflow shows before any output
            except ValueError as e:
                if not _is_context_overflow(e):
                    raise
                if len(self.turns) <= 1:
                    self.turns.pop()
                    say(
                        f"llamaflash: this message alone does not fit the context ({e}); "
                        "use a larger --n-ctx or a shorter message"
                    )
                    return True
                del self.turns[:2]  # the oldest exchange
                say("llamaflash: the conversation no longer fits the context; dropped the oldest exchange")
                continue
            except KeyboardInterrupt:
                pieces.close()
                out.write("\n")
                self.turns.pop()
                return False
            break
        text, interrupted = ("", False)
        if first is not None:
            out.write(first)
            out.flush()
            text, interrupted = stream_out(pieces, out)
            text = first + text
        out.write("\n")
        out.flush()
        self.turns.append({"role": "assistant", "content": text})
        return not interrupted


def _typed_text() -> str:
    """What the user had typed when Ctrl-C came at the prompt (empty without readline)."""
    try:
        import readline
    except ImportError:
        return ""
    return readline.get_line_buffer()


def chat_loop(
    session: ChatSession, read: Callable[[str], str] = input, out: TextIO = sys.stdout, prompt: str = ">>> "
) -> None:
    """Read messages until end of input (or Ctrl-C at an empty prompt) and answer each."""
    while True:
        try:
            message = read(prompt)
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:
            if _typed_text().strip():
                out.write("\n")  # Ctrl-C over a half-typed line discards the line
                continue
            out.write("\n")
            return
        command = message.strip()
        if not command:
            continue
        if command in ("/exit", "/quit", "/bye"):
            return
        if command == "/reset":
            session.reset()
            say("llamaflash: conversation forgotten")
            continue
        if command in ("/help", "/?"):
            say(CHAT_HELP)
            continue
        if not session.reply(message, out):
            say("llamaflash: reply stopped")
