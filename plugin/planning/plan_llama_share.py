"""llama.cpp's share of a process's memory in offload mode, from the base model's header: its
vocabulary tables, the weights it keeps (every tensor but the served FFNs), the KV cache, its compute
buffers, and the page cache dense prefill streams one served layer through. Constants fitted to
llama.cpp's own log (bench/planner_constants.py; docs/PLANNER.md, "Measured constants")."""

from __future__ import annotations

from typing import Any, Collection

import numpy as np

from ..files import sidecar_format as fmt
from ..files.gguf_header import GGUFHeader
from ..files.sidecar import SidecarInfo

MiB = 1 << 20
#: Bytes of a memory page: token_embd is read by rows, and llama_weights counts the pages they touch.
PAGE = 4096
#: llama.cpp's tokenizer tables: bytes per vocabulary entry (tokens + BPE merges) + fixed (measured
#: with vocab_only loads: SmolLM2 17.7, Gemma-3 43.4, Qwen2.5 47.5 MiB; the formula gives 18.5, 46.0, 52.9).
VOCAB_BYTES_PER_ENTRY = 176
VOCAB_FIXED_BYTES = 2 * MiB
#: Safety factor on the compute-buffer formula (it matched llama.cpp's log within 1% on three models).
COMPUTE_SAFETY = 1.05
#: Rows of logits a batch returns unless the user asks for every token's (``logits_all``): the last
#: token's. A speculative verify batch's other rows are counted where speculation is planned.
DEFAULT_OUTPUTS = 1


def header_value(header: GGUFHeader, key: str, default: Any = None) -> Any:
    """Metadata ``key`` of a parsed header: a scalar's value, an array's length; ``default`` if absent."""
    v = header.metadata.get(key)
    if v is None:
        return default
    return v.count if v.value is None else v.value


def vocabulary_size(header: GGUFHeader) -> int:
    """Entries of ``tokenizer.ggml.tokens`` (0 when the header has none)."""
    return int(header_value(header, "tokenizer.ggml.tokens", 0) or 0)


def compute_reserve_bytes(header: GGUFHeader, n_ctx: int, n_ubatch: int, device_compute_bytes: int) -> int:
    """The compute buffers llama.cpp *allocates* (its log's "CPU compute" + "LLAMAFLASH compute" + "CPU
    output"): its graph is reserved for n_ubatch tokens that all output logits, so the CPU buffer is
    n_ubatch x 4 x max(n_vocab + 3 n_embd, (n_head + 2) cells + 6 n_embd) (fitted to the log), plus
    ``device_compute_bytes`` and one row of logits, all x COMPUTE_SAFETY. Most of it is never touched
    (:func:`compute_touched_bytes`)."""
    g = _graph_dims(header, n_ctx)
    cpu = n_ubatch * 4 * max(g["n_vocab"] + 3 * g["n_embd"], (g["n_head"] + 2) * g["cells"] + 6 * g["n_embd"])
    return int(COMPUTE_SAFETY * (cpu + device_compute_bytes + g["n_vocab"] * 4))


def compute_touched_bytes(
    header: GGUFHeader,
    n_ctx: int,
    n_ubatch: int,
    served: Collection[str],
    device_compute_bytes: int,
    n_outputs: int,
    flash_attn: bool = False,
) -> int:
    """The pages of llama.cpp's compute buffers a batch of n_ubatch tokens writes, of which
    ``n_outputs`` return logits. The buffers are anonymous memory, charged to the process (and its
    cgroup) only when written; ggml-alloc places a smaller batch's tensors at the offsets of the
    reserved graph, so each tensor touches the prefix of its region that its real size covers.
    Per token, the phases that follow one another in the graph are summed (an upper bound on their
    union; measured on Qwen2.5-1.5B dense and a qwen3moe at n_ubatch 512 with 500 prompt tokens: 67
    and 53 MiB touched, this gives 115 and 110 MiB):
      attention                  (n_head + 2) cells + 6 n_embd  (KQ scores and the projections)
        with flash attention     cells / 2 + 6 n_embd           (the f16 mask row; no KQ scores:
                                 Qwen2.5-1.5B offload, n_ctx 1280, 1000 prompt tokens: anonymous
                                 memory grew 38 MiB more at n_ubatch 512 than at 32; this gives 36)
      FFN when llama.cpp runs it 3 n_ff + 2 n_embd              (gate, up, product)
      routed experts, likewise   n_used (3 n_ff_exp + n_embd)   (gate, up, product and outputs per slot)
    times n_ubatch x 4 bytes, plus n_outputs x (n_vocab + 3 n_embd) x 4 for the output layer, plus the
    LLAMAFLASH device's ``device_compute_bytes``, all x COMPUTE_SAFETY; never more than
    :func:`compute_reserve_bytes`. ``served``: tensors llamaflash serves (their FFN is not in llama.cpp's
    graph on the CPU)."""
    g = _graph_dims(header, n_ctx)
    arch, n_embd = g["arch"], g["n_embd"]
    names = {t.name for t in header.tensors}
    dense = any(n.endswith(".ffn_up.weight") and n not in served for n in names)
    routed = any(n.endswith("_exps.weight") and n not in served for n in names)
    per_token = (g["cells"] // 2 if flash_attn else (g["n_head"] + 2) * g["cells"]) + 6 * n_embd
    if dense:
        n_ff = int(np.max(header_value(header, f"{arch}.feed_forward_length", 0)))
        per_token += 3 * n_ff + 2 * n_embd
    if routed:
        n_ff_exp = int(header_value(header, f"{arch}.expert_feed_forward_length", 0) or 0)
        n_used = int(header_value(header, f"{arch}.expert_used_count", 0) or 0)
        per_token += n_used * (3 * n_ff_exp + n_embd)
    outputs = min(n_outputs, n_ubatch) * 4 * (g["n_vocab"] + 3 * n_embd)
    touched = int(COMPUTE_SAFETY * (n_ubatch * 4 * per_token + outputs + device_compute_bytes))
    return min(touched, compute_reserve_bytes(header, n_ctx, n_ubatch, device_compute_bytes))


def _graph_dims(header: GGUFHeader, n_ctx: int) -> dict[str, Any]:
    h = header
    arch = header_value(h, "general.architecture", "")
    n_embd = int(header_value(h, f"{arch}.embedding_length"))
    return {
        "arch": arch,
        "n_embd": n_embd,
        "n_head": int(np.max(header_value(h, f"{arch}.attention.head_count", 1))),
        "n_vocab": int(header_value(h, "tokenizer.ggml.tokens", 0) or header_value(h, f"{arch}.vocab_size", 0)),
        "cells": -(-n_ctx // 256) * 256,
    }


def llama_memory(
    header: GGUFHeader,
    n_ctx: int,
    n_ubatch: int,
    served: Collection[str],
    device_compute_bytes: int,
    embeddings_by_rows: bool,
    logits_all: bool = False,
    flash_attn: bool = False,
) -> dict[str, int]:
    """llama.cpp's memory when llamaflash serves the tensors named in ``served`` (bytes):
    ``llama_vocab``, ``llama_weights`` (every other tensor: resident), ``kv_cache`` (f16 K and V for
    every layer and cell; n_ctx rounded up to 256), ``compute_buffers`` (the pages a batch touches,
    :func:`compute_touched_bytes`, with ``n_outputs`` rows of logits per batch: DEFAULT_OUTPUTS, the
    last token's; n_ubatch with ``logits_all``).
    ``embeddings_by_rows``: token_embd is mmapped and, when the model has its own output matrix, read
    by rows (get_rows): the pages of n_ctx rows are counted, not the whole table."""
    h = header
    g = _graph_dims(h, n_ctx)
    arch, n_embd, n_vocab, cells = g["arch"], g["n_embd"], g["n_vocab"], g["cells"]
    n_layer = int(header_value(h, f"{arch}.block_count"))
    n_head = g["n_head"]
    kv_heads = np.broadcast_to(np.asarray(header_value(h, f"{arch}.attention.head_count_kv", n_head)), (n_layer,))
    k_len = int(header_value(h, f"{arch}.attention.key_length", n_embd // n_head))
    v_len = int(header_value(h, f"{arch}.attention.value_length", k_len))
    entries = n_vocab + int(header_value(h, "tokenizer.ggml.merges", 0))
    size = {t.name: t.nbytes for t in h.tensors}
    # token_embd is only read by rows (get_rows) when the model has its own output matrix: count the
    # pages of n_ctx rows, not the whole table (tied embeddings are the output matmul: whole)
    if embeddings_by_rows and "output.weight" in size and "token_embd.weight" in size:
        emb = size["token_embd.weight"]
        size["token_embd.weight"] = min(emb, n_ctx * (-(-(emb // max(1, n_vocab)) // PAGE) + 1) * PAGE)
    n_outputs = n_ubatch if logits_all else DEFAULT_OUTPUTS
    parts = {
        "llama_vocab": VOCAB_FIXED_BYTES + VOCAB_BYTES_PER_ENTRY * entries,
        "llama_weights": sum(b for name, b in size.items() if name not in served),
        "kv_cache": int(kv_heads.sum()) * cells * (k_len + v_len) * 2,
        "compute_buffers": compute_touched_bytes(
            h, n_ctx, n_ubatch, served, device_compute_bytes, n_outputs, flash_attn
        ),
    }
    if logits_all:
        parts["python_logits"] = n_ctx * n_vocab * 4
    return parts


#: The dense lane's token chunks (csrc/lanes/dense_lane.h): splits over DENSE_CHUNK_TOKENS tokens are
#: computed in chunks of dense_chunk_tokens(n) tokens (at most DENSE_MAX_CHUNKS chunks), gate / up /
#: activation in the lane's scratch of 3 x n_ff x (chunk + 7) floats.
DENSE_CHUNK_TOKENS = 64
DENSE_MAX_CHUNKS = 8


def dense_chunk_tokens(n_tokens: int) -> int:
    """Tokens per chunk of a dense split of ``n_tokens`` (csrc/lanes/dense_lane.h)."""
    if n_tokens <= DENSE_CHUNK_TOKENS:
        return n_tokens
    spread = -(-n_tokens // DENSE_MAX_CHUNKS)
    return max(DENSE_CHUNK_TOKENS, -(-spread // 8) * 8)


def device_touched_bytes(n_ubatch: int, n_embd: int, n_ff: int, verify_rows: int = 8) -> int:
    """The LLAMAFLASH device's compute memory a split of up to n_ubatch tokens writes: the FFN output
    [n_embd, T]; the gate / up / activation [n_ff, T] of splits computed whole (T <= DENSE_CHUNK_TOKENS:
    decode, verify batches, short prompts); and, when n_ubatch is chunked, the lane's chunk scratch
    (the [n_ff, T] nodes of a chunked split are never written). All f32."""
    whole = min(n_ubatch, max(DENSE_CHUNK_TOKENS, verify_rows))
    scratch = 3 * n_ff * (dense_chunk_tokens(n_ubatch) + 7) if n_ubatch > DENSE_CHUNK_TOKENS else 0
    return 4 * (n_ubatch * n_embd + 3 * n_ff * whole + scratch)


def llama_share(
    header: GGUFHeader,
    info: SidecarInfo,
    n_ctx: int,
    n_ubatch: int,
    logits_all: bool = False,
    flash_attn: bool = False,
) -> dict[str, int]:
    """llama.cpp's memory in offload mode (bytes): :func:`llama_memory` with the served layers'
    ffn_gate/up/down served (the LLAMAFLASH device's compute: :func:`device_touched_bytes`; token_embd
    read by rows), and ``prefill_window`` (one served layer's base up + down bytes, page cache during dense
    prefill). ``header``: the base model's (:func:`~llamaflash.files.gguf_header.read_gguf_header`);
    ``logits_all``, ``flash_attn`` (the context's): as :func:`llama_memory`."""
    served = {fmt.base_ffn_gate_name(lay.layer) for lay in info.layers}
    served |= {fmt.base_ffn_up_name(lay.layer) for lay in info.layers}
    served |= {fmt.base_ffn_down_name(lay.layer) for lay in info.layers}
    n_ff = max(lay.n_ff for lay in info.layers)
    size = {t.name: t.nbytes for t in header.tensors}
    return {
        **llama_memory(
            header,
            n_ctx,
            n_ubatch,
            served,
            device_touched_bytes(n_ubatch, _graph_dims(header, n_ctx)["n_embd"], n_ff),
            True,
            logits_all,
            flash_attn,
        ),
        "prefill_window": max(
            size[fmt.base_ffn_up_name(lay.layer)] + size[fmt.base_ffn_down_name(lay.layer)] for lay in info.layers
        ),
    }
