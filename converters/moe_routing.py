"""Which experts a Mixture-of-Experts model routes each token to, recorded from stock llama.cpp.

llama.cpp's MoE FFN (``llm_graph_context::build_moe_ffn`` in ``src/llama-graph.cpp`` of
llama-cpp-python 0.3.36) names the selected experts of layer L ``ffn_moe_topk-L``: an I32 view
[n_expert_used, n_tokens] (ggml order; numpy [n_tokens, n_expert_used]) of the router's argsort,
rows n_expert * 4 bytes apart. :class:`RoutingRecorder` runs the model through llama-cpp-python's
llama.cpp (no llamaflash) with the scheduler's eval callback asking for exactly those tensors, and
copies them out batch by batch. Weights stay plain and file-backed (``use_extra_bufts=False``): the
numerics llamaflash reproduces, and no anonymous copy of the experts (stock's default repacks every
Q4_K expert into anonymous memory, which for a 17 GB model needs 17 GB of RAM; file-backed pages are
reclaimable, so the recorder runs under a memory limit smaller than the model, re-reading from disk). Every batch requests the logits of all its tokens, so that the last
layer routes every token (otherwise llama.cpp computes only the output rows there); once the last
layer's experts are read, the callback ends the graph's computation (returning false, which the
scheduler takes as "stop"): what is left is that layer's expert FFN, the output norm and the
vocabulary projection, which change neither the routing nor the KV cache, and the projection of
every token would cost more than the rest of the model.

Each sequence is evaluated from an empty context, in batches of ``n_batch`` tokens, with the
KV cache kept between batches: the trace is exactly what stock llama.cpp selects on that text.
With ``n_seq`` > 1 (and ``n_batch`` equal to the context), up to ``n_seq`` sequences are evaluated
side by side in one batch (their own sequence ids in a unified KV cache, flash attention on): each
MoE layer then reads each expert's weights once for all of them, where a memory limit below the
model's size makes every batch re-read the experts from disk.
Statistics of a trace: :mod:`.moe_routing_stats`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import _internals
from llama_cpp._logger import set_verbose

from llamaflash.converters.llama_runner import _P_TENSOR, _ggml, _parse_name

#: the graph tensor holding the selected experts of a layer (name "<kind>-<layer>")
TOPK_KIND = "ffn_moe_topk"
_GGML_TYPE_I32 = 26


@dataclass(frozen=True)
class RoutingTrace:
    """The experts each token was routed to, per MoE layer.

    ``experts[layer]``: int32 [n_tokens, n_expert_used], token i's selected expert ids in llama.cpp's
    order (descending router probability); ``tokens``: the n_tokens token ids evaluated, in order;
    ``sequence_starts``: the index of the first token of every independently evaluated sequence
    (``[0, ...]``; consecutive-token statistics never pair tokens across a start).
    """

    experts: dict[int, np.ndarray]
    n_expert: int
    tokens: np.ndarray
    sequence_starts: np.ndarray

    def __post_init__(self) -> None:
        n = int(self.tokens.size)
        for layer, ids in self.experts.items():
            if ids.ndim != 2 or ids.shape[0] != n:
                raise ValueError(f"layer {layer}: expert ids of shape {ids.shape}, expected [{n}, n_used]")
            if ids.size and (ids.min() < 0 or ids.max() >= self.n_expert):
                raise ValueError(f"layer {layer}: expert ids outside [0, {self.n_expert})")
        starts = np.asarray(self.sequence_starts)
        if n and (starts.size == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= n):
            raise ValueError(f"sequence_starts {starts.tolist()} must start at 0 and increase below {n}")

    @property
    def layers(self) -> list[int]:
        return sorted(self.experts)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def n_used(self) -> int:
        return int(next(iter(self.experts.values())).shape[1]) if self.experts else 0

    def continues_previous(self) -> np.ndarray:
        """bool [n_tokens]: token i follows token i-1 in the same sequence."""
        out = np.ones(self.n_tokens, dtype=bool)
        out[np.asarray(self.sequence_starts, dtype=np.int64)] = False
        return out


def _read_topk(t, ptr: int) -> np.ndarray:
    """An I32 ggml tensor [ne0, ne1] with any row stride, as int32 numpy [ne1, ne0]."""
    ne0, ne1 = int(t.ne[0]), int(t.ne[1])
    if t.type != _GGML_TYPE_I32 or t.ne[2] != 1 or t.ne[3] != 1 or t.nb[0] != 4:
        raise RuntimeError(
            f"llama.cpp tensor {t.name.decode()} is not a 2-D I32 tensor with contiguous rows "
            f"(type {t.type}, ne {list(t.ne)}, nb {list(t.nb)}); this llama.cpp build is not supported"
        )
    nbytes = int(_ggml.ggml_nbytes(ptr))
    raw = np.empty(nbytes // 4 + 1, dtype=np.int32)
    _ggml.ggml_backend_tensor_get(ptr, raw.ctypes.data, 0, nbytes)
    rows = np.lib.stride_tricks.as_strided(raw, shape=(ne1, ne0), strides=(int(t.nb[1]), 4))
    return rows.copy()


class RoutingRecorder:
    """One stock llama.cpp model + context that records the experts of every MoE layer."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        n_ctx: int = 2048,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_seq: int = 1,
    ) -> None:
        if n_batch <= 0 or n_ctx <= 0 or n_seq <= 0:
            raise ValueError("n_ctx, n_batch and n_seq must be positive")
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such model file")
        n_threads = n_threads or max(1, min(os.cpu_count() or 1, 8))
        set_verbose(False)
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = False
        self.model = _internals.LlamaModel(path_model=os.fspath(path), params=mparams, verbose=False)
        meta = self.model.metadata()
        arch = meta.get("general.architecture", "")
        self.n_expert = int(meta.get(f"{arch}.expert_count", 0))
        if self.n_expert <= 0:
            self.model.close()
            raise ValueError(f"{path} is not a Mixture-of-Experts model ({arch} has no {arch}.expert_count)")
        #: the last layer: its routing is the last thing the graph needs to compute
        self._last_layer = int(meta.get(f"{arch}.block_count", 0)) - 1
        self.n_ctx = int(min(n_ctx, self.model.n_ctx_train() or n_ctx))
        self.n_batch = min(n_batch, self.n_ctx)
        if n_seq > 1 and self.n_batch != self.n_ctx:
            raise ValueError("several sequences per batch need n_batch == n_ctx (one batch per sequence)")
        self.n_seq = n_seq
        self._rows: dict[int, list[np.ndarray]] = {}
        self._error: BaseException | None = None
        self._callback = llama_cpp.ggml_backend_sched_eval_callback(self._eval_callback)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = self.n_ctx * n_seq
        cparams.n_batch = self.n_batch * n_seq
        cparams.n_ubatch = self.n_batch * n_seq
        cparams.n_seq_max = n_seq
        if n_seq > 1:
            cparams.kv_unified = True  # one ubatch in batch order (per-sequence streams would split it)
            cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED  # no [n_kv, n_tokens] scores
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        cparams.cb_eval = self._callback
        cparams.cb_eval_user_data = None
        self.ctx = _internals.LlamaContext(model=self.model, params=cparams, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=self.n_batch * n_seq, embd=0, n_seq_max=n_seq, verbose=False)

    def tokenize(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (no BOS, special tokens not parsed) as int32."""
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self.model.vocab, data, len(data), buf, capacity, False, False)
        if n < 0:  # pragma: no cover - more tokens than bytes + 16 cannot happen
            raise RuntimeError(f"tokenization failed ({n})")
        return np.frombuffer(buf, dtype=np.int32, count=n).copy()

    def record(
        self, sequences: Sequence[Sequence[int]] | np.ndarray, progress: Callable[[int, int], None] | None = None
    ) -> RoutingTrace:
        """Evaluates each sequence of token ids from an empty context (one 1-D array is one
        sequence); a sequence longer than the context is cut into context-sized pieces, each
        evaluated from an empty context. Returns the routing of every token. ``progress(done,
        total)`` is called after each batch with the tokens evaluated so far."""
        if isinstance(sequences, np.ndarray) and sequences.ndim == 1:
            sequences = [sequences]
        pieces: list[np.ndarray] = []
        for seq in sequences:
            seq = np.asarray(seq, dtype=np.int32)
            if seq.ndim != 1:
                raise ValueError("each sequence must be a 1-D list of token ids")
            n_vocab = self.model.n_vocab()
            if seq.size and (seq.min() < 0 or seq.max() >= n_vocab):
                raise ValueError(f"token ids must lie in [0, {n_vocab})")
            pieces += [seq[i : i + self.n_ctx] for i in range(0, seq.size, self.n_ctx)]
        self._rows = {}
        starts, offset = [], 0
        total = int(sum(p.size for p in pieces))
        for i in range(0, len(pieces), self.n_seq):
            group = pieces[i : i + self.n_seq]
            for piece in group:
                starts.append(offset)
                offset += piece.size
            if len(group) == 1:
                self._evaluate(group[0], offset - group[0].size, total, progress)
            else:
                self._evaluate_side_by_side(group, offset, total, progress)
        experts = {layer: np.concatenate(rows).astype(np.int32) for layer, rows in self._rows.items()}
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
        if not experts and tokens.size:
            raise RuntimeError(
                f"llama.cpp computed no {TOPK_KIND} tensors: not a MoE graph, or this llama.cpp names them differently"
            )
        return RoutingTrace(experts, self.n_expert, tokens, np.asarray(starts, dtype=np.int64))

    def _evaluate(
        self, tokens: np.ndarray, offset: int, total: int, progress: Callable[[int, int], None] | None
    ) -> None:
        self.ctx.kv_cache_clear()
        for begin in range(0, tokens.size, self.n_batch):
            chunk = tokens[begin : begin + self.n_batch]
            before = {layer: sum(r.shape[0] for r in rows) for layer, rows in self._rows.items()}
            self.batch.set_batch(chunk.tolist(), n_past=begin, logits_all=True)
            self._error = None
            self.ctx.decode(self.batch)
            if self._error is not None:
                raise self._error
            for layer, rows in self._rows.items():
                got = sum(r.shape[0] for r in rows) - before.get(layer, 0)
                if got != chunk.size:
                    raise RuntimeError(f"layer {layer}: llama.cpp routed {got} tokens of a batch of {chunk.size}")
            if progress is not None:
                progress(offset + begin + chunk.size, total)

    def _evaluate_side_by_side(
        self, group: list[np.ndarray], done: int, total: int, progress: Callable[[int, int], None] | None
    ) -> None:
        """Sequences of at most one batch each, evaluated in one batch (sequence j as sequence id j);
        the routed rows come out in batch order, i.e. the sequences one after another."""
        self.ctx.kv_cache_clear()
        before = {layer: sum(r.shape[0] for r in rows) for layer, rows in self._rows.items()}
        self.batch.reset()
        for j, piece in enumerate(group):
            self.batch.add_sequence(piece.tolist(), j, True)
        n = int(sum(p.size for p in group))
        self._error = None
        self.ctx.decode(self.batch)
        if self._error is not None:
            raise self._error
        for layer, rows in self._rows.items():
            got = sum(r.shape[0] for r in rows) - before.get(layer, 0)
            if got != n:
                raise RuntimeError(f"layer {layer}: llama.cpp routed {got} tokens of a batch of {n}")
        if progress is not None:
            progress(done, total)

    def _eval_callback(self, t_ptr: int, ask: bool, user_data: int) -> bool:
        try:
            t = ctypes.cast(t_ptr, _P_TENSOR).contents
            parsed = _parse_name(t.name)
            if parsed is None or parsed[0] != TOPK_KIND:
                return False
            if ask:
                return True
            self._rows.setdefault(parsed[1], []).append(_read_topk(t, t_ptr))
            return parsed[1] != self._last_layer
        except BaseException as exc:  # never let an exception cross into C; re-raised by record()
            if self._error is None:
                self._error = exc
            return False

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.batch.close()
        self.ctx.close()
        self.model.close()

    def __enter__(self) -> "RoutingRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def text_sequences(
    recorder: RoutingRecorder, n_tokens: int, seq_len: int = 512, cache_dir: Path | None = None, text: str | None = None
) -> list[np.ndarray]:
    """About ``n_tokens`` tokens of real text in sequences of ``seq_len``: evenly spaced windows
    over the registry calibration corpus (English essays and code, the document heads the converter
    calibrates on; :func:`llamaflash.converters.texts.default_calibration`), or over ``text``."""
    from llamaflash.converters import texts

    if text is None:
        text = texts.default_calibration(cache_dir).text
    windows = texts.calibration_tokens(recorder.tokenize, text, n_tokens, seq_len)
    out, total = [], 0
    for w in windows:
        if total >= n_tokens:
            break
        w = w[: n_tokens - total]
        out.append(w)
        total += w.size
    return out


def record_text_routing(
    model_path: str | os.PathLike[str],
    n_tokens: int = 4096,
    seq_len: int = 512,
    cache_dir: Path | None = None,
    text: str | None = None,
    n_threads: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    n_seq: int = 1,
) -> RoutingTrace:
    """The routing of ``model_path`` on about ``n_tokens`` tokens of real text (:func:`text_sequences`),
    ``n_seq`` sequences of ``seq_len`` side by side per batch."""
    with RoutingRecorder(model_path, n_ctx=seq_len, n_batch=seq_len, n_threads=n_threads, n_seq=n_seq) as rec:
        return rec.record(text_sequences(rec, n_tokens, seq_len, cache_dir, text), progress)


def main(argv: list[str] | None = None) -> int:
    """``python -m llamaflash.converters.moe_routing MODEL [--tokens N] [--json OUT]``: records the
    routing of MODEL on the registry calibration text and prints its statistics."""
    import argparse
    import json
    import sys

    from llamaflash.converters import moe_routing_stats

    p = argparse.ArgumentParser(prog="python -m llamaflash.converters.moe_routing", description=main.__doc__)
    p.add_argument("model", type=Path)
    p.add_argument("--tokens", type=int, default=4096, help="tokens of text to route (default 4096)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--top-k", type=int, default=8, help="k of the top-k share (default 8)")
    p.add_argument("--slots", type=str, default="", help="LRU cache sizes per layer to simulate, e.g. 16,32")
    p.add_argument("--pin", type=int, default=0, help="also simulate with the N most used experts pinned")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="write the statistics here")
    a = p.parse_args(argv)
    try:
        trace = record_text_routing(a.model, a.tokens, a.seq_len, n_threads=a.threads)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"moe_routing: {e}", file=sys.stderr)
        return 1
    slots = [int(s) for s in a.slots.split(",") if s]
    s = moe_routing_stats.summarize(trace, a.top_k, slots, a.pin)
    print(
        f"{a.model}: {s['n_tokens']} tokens in {s['n_sequences']} sequences, {s['n_expert']} experts, "
        f"{s['n_used']} used (random reuse {s['random_reuse']:.3f})"
    )
    print(
        f"  top-{a.top_k} share  mean {s['top_k_share']['mean']:.3f}  min {s['top_k_share']['min']:.3f}  "
        f"max {s['top_k_share']['max']:.3f}"
    )
    print(f"  reuse        mean {s['reuse']['mean']:.3f}  min {s['reuse']['min']:.3f}  max {s['reuse']['max']:.3f}")
    for slot in slots:
        lru = np.mean([v["lru"][slot] for v in s["layers"].values()])
        line = f"  LRU {slot} slots/layer: hit rate {lru:.3f}"
        if a.pin and slot >= a.pin:
            pinned = np.mean([v["pinned_lru"][slot] for v in s["layers"].values()])
            line += f"; top-{a.pin} pinned + LRU: {pinned:.3f}"
        print(line)
    if a.json:
        a.json.write_text(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
