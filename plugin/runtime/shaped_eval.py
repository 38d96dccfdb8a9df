"""How `llamaflash.Llama` evaluates tokens in the shapes of plugin/runtime/eval_shapes.py: batch-invariant
chunks, the replay of a recorded prompt, and recording a prompt once evaluated. Functions of the
`Llama` (its context, batch, token and logits buffers, KV history and prompt records)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import llama_cpp.llama_cpp as raw
import numpy as np

from . import eval_shapes
from .eval_shapes import Segment

if TYPE_CHECKING:
    from .llama import Llama


def eval_invariant(llm: "Llama", tokens, all_logits: bool) -> None:
    """Evaluates `tokens` at n_tokens in batch-invariant chunks (eval_shapes.invariant_chunks): a
    lone token past the split-KV length is decoded with a filler row after it (the same token), whose
    KV entry is removed and whose logits are replaced by the token's, so that sampling the last
    output row samples the token's. A chunk before the last computes no logits unless `all_logits`
    (nothing samples them): no product by the output matrix, and no last-layer FFN for its last row
    (llama.cpp runs the last layer's FFN on output rows only); every KV entry is the same."""
    n_past = llm.n_tokens
    t0 = time.perf_counter()
    # any 1..MAX_ROWS rows are invariant: chunks also fit a smaller n_batch / n_ubatch (an MoE plan's)
    max_rows = max(3, min(llm._invariant_rows, llm.n_batch, llm.context_params.n_ubatch))
    # a lone row is padded where another batch may compute the same position (deterministic mode, and
    # speculation verifying drafts in batches) and a row alone gets other bits: past 256 positions over
    # an f16 KV cache (split KV), at any position where a matrix takes tinyBLAS from 2 rows
    always = llm._tinyblas_matrix is not None
    pad_lone = (llm._deterministic or llm._speculator is not None) and (llm._kv_may_split or always)
    end = n_past + len(tokens)
    chunks = eval_shapes.invariant_chunks(n_past, len(tokens), max_rows, pad_lone, always)
    for i, (first, rows) in enumerate(chunks):
        real = min(rows, end - first)
        chunk = tokens[first - n_past : first - n_past + real]
        chunk = chunk + [chunk[-1]] * (rows - real)  # filler rows after a lone token
        outputs = all_logits or rows > real  # a filler's batch: every row, the token's copied over the filler's
        llm._ctx.kv_cache_seq_rm(-1, first, -1)
        llm._kv_history.cut(first)
        llm._batch.set_batch(batch=chunk, n_past=first, logits_all=outputs)
        if not outputs and i + 1 < len(chunks):
            llm._batch.batch.logits[rows - 1] = False  # an inner chunk: no row is sampled
        llm._ctx.decode(llm._batch)
        if rows > real:
            llm._ctx.kv_cache_seq_rm(-1, first + real, -1)
            logits = np.ctypeslib.as_array(raw.llama_get_logits(llm._ctx.ctx), shape=(rows, llm._n_vocab))
            logits[real:] = logits[real - 1]
        llm.input_ids[first : first + real] = chunk[:real]
        if llm._logits_all:
            logits = np.ctypeslib.as_array(raw.llama_get_logits(llm._ctx.ctx), shape=(rows, llm._n_vocab))
            llm.scores[first : first + real, :] = logits[:real]
        llm.n_tokens = first + real
        llm._kv_history.add(Segment(first, rows, outputs))
    llm._requires_eval = False
    if llm._speculator is not None and all_logits and not llm._logits_all:
        llm._speculator.record_verify(len(tokens), time.perf_counter() - t0, n_past)


def replay_prompt(llm: "Llama", tokens) -> None:
    """Brings the context to the recorded state of prompt `tokens` (see eval_shapes), leaving
    n_tokens == len(tokens) and its last position's logits ready to sample; nothing when the
    prompt has no record (its first evaluation is llama-cpp-python's own)."""
    record = llm._prompt_records.get(tokens)
    if record is None:
        return
    n = len(tokens)
    held = llm._input_ids
    shared = 0
    for a, b in zip(held, tokens):
        if a != b:
            break
        shared += 1
    plan = eval_shapes.plan_replay(record, llm._kv_history, shared, n)
    if llm._flash is not None:
        llm._flash.check_files()
    llm._ctx.kv_cache_seq_rm(-1, plan.keep, -1)
    llm.n_tokens = plan.keep
    llm._kv_history.cut(plan.keep)
    try:
        for i, seg in enumerate(plan.segments):
            end = eval_shapes.segment_end(plan.segments, i, n)
            real = [int(t) for t in tokens[seg.start : end]]
            # rows cut since (a verify batch behind a rejected draft) are filled in again: the rows
            # before them get the bits of the recorded shape, then the filler is removed
            batch = real + [real[-1]] * (seg.size - len(real))
            llm._batch.set_batch(batch=batch, n_past=seg.start, logits_all=seg.all_logits)
            llm._ctx.decode(llm._batch)
            if len(batch) > len(real):
                llm._ctx.kv_cache_seq_rm(-1, end, -1)
                if seg.all_logits:  # the last real row's logits are the ones sampled next (row -1)
                    logits = np.ctypeslib.as_array(raw.llama_get_logits(llm._ctx.ctx), shape=(len(batch), llm._n_vocab))
                    logits[len(real) :] = logits[len(real) - 1]
            llm.input_ids[seg.start : end] = real
            if llm._logits_all:
                logits = np.ctypeslib.as_array(raw.llama_get_logits(llm._ctx.ctx), shape=(len(batch), llm._n_vocab))
                llm.scores[seg.start : end, :] = logits[: len(real)]
            llm.n_tokens = end
            llm._kv_history.add(seg)
    except RuntimeError as e:
        llm._kv_history.forget()
        raise llm._decode_failure(e) from e
    if not plan.segments:
        # the cache holds the prompt as it was evaluated: its recorded logits are the ones to sample
        row = raw.llama_get_logits_ith(llm._ctx.ctx, -1)
        if not row:
            llm._kv_history.forget()
            return replay_prompt(llm, tokens)
        np.ctypeslib.as_array(row, shape=(llm._n_vocab,))[:] = record.logits
        if llm._logits_all:
            llm.scores[n - 1, :] = record.logits
        llm.input_ids[:n] = tokens
        llm.n_tokens = n
    llm._requires_eval = False


def record_prompt(llm: "Llama", evaluated: bool) -> None:
    """After an evaluation inside generate: once the prompt is evaluated, its segments and last
    logits go to the prompt records."""
    pending = llm._pending_prompt
    if pending is None or llm.n_tokens < len(pending):
        return
    llm._pending_prompt = None
    n = len(pending)
    if llm.n_tokens != n or not np.array_equal(llm.input_ids[:n], pending):
        return
    if not evaluated and llm._prompt_records.get(pending) is not None:
        return  # sampled from the cache as recorded
    if not llm._kv_history.known:
        return
    row = raw.llama_get_logits_ith(llm._ctx.ctx, -1)
    logits = np.ctypeslib.as_array(row, shape=(llm._n_vocab,)).copy() if row else None
    llm._prompt_records.put(pending, llm._kv_history.covering(n), logits)
