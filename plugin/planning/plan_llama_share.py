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


def header_value(header: GGUFHeader, key: str, default: Any = None) -> Any:
    """Metadata ``key`` of a parsed header: a scalar's value, an array's length; ``default`` if absent."""
    v = header.metadata.get(key)
    if v is None:
        return default
    return v.count if v.value is None else v.value


def vocabulary_size(header: GGUFHeader) -> int:
    """Entries of ``tokenizer.ggml.tokens`` (0 when the header has none)."""
    return int(header_value(header, "tokenizer.ggml.tokens", 0) or 0)


def llama_memory(
    header: GGUFHeader,
    n_ctx: int,
    n_ubatch: int,
    served: Collection[str],
    device_compute_bytes: int,
    embeddings_by_rows: bool,
) -> dict[str, int]:
    """llama.cpp's memory when llamaflash serves the tensors named in ``served`` (bytes):
    ``llama_vocab``, ``llama_weights`` (every other tensor: resident), ``kv_cache`` (f16 K and V for
    every layer and cell; n_ctx rounded up to 256), ``compute_buffers`` (CPU: n_ubatch x 4 x
    max(n_vocab + 3 n_embd, (n_head + 2) n_ctx + 6 n_embd), fitted to llama.cpp's log; the LLAMAFLASH
    device's ``device_compute_bytes``; logits output: n_vocab x 4; all x COMPUTE_SAFETY).
    ``embeddings_by_rows``: token_embd is mmapped and, when the model has its own output matrix, read
    by rows (get_rows): the pages of n_ctx rows are counted, not the whole table."""
    h = header
    arch = header_value(h, "general.architecture", "")
    n_layer, n_embd = int(header_value(h, f"{arch}.block_count")), int(header_value(h, f"{arch}.embedding_length"))
    n_head = int(np.max(header_value(h, f"{arch}.attention.head_count", 1)))
    kv_heads = np.broadcast_to(np.asarray(header_value(h, f"{arch}.attention.head_count_kv", n_head)), (n_layer,))
    k_len = int(header_value(h, f"{arch}.attention.key_length", n_embd // n_head))
    v_len = int(header_value(h, f"{arch}.attention.value_length", k_len))
    n_vocab = int(header_value(h, "tokenizer.ggml.tokens", 0) or header_value(h, f"{arch}.vocab_size", 0))
    entries = n_vocab + int(header_value(h, "tokenizer.ggml.merges", 0))
    size = {t.name: t.nbytes for t in h.tensors}
    # token_embd is only read by rows (get_rows) when the model has its own output matrix: count the
    # pages of n_ctx rows, not the whole table (tied embeddings are the output matmul: whole)
    if embeddings_by_rows and "output.weight" in size and "token_embd.weight" in size:
        emb = size["token_embd.weight"]
        size["token_embd.weight"] = min(emb, n_ctx * (-(-(emb // max(1, n_vocab)) // PAGE) + 1) * PAGE)
    cells = -(-n_ctx // 256) * 256
    cpu = n_ubatch * 4 * max(n_vocab + 3 * n_embd, (n_head + 2) * cells + 6 * n_embd)
    return {
        "llama_vocab": VOCAB_FIXED_BYTES + VOCAB_BYTES_PER_ENTRY * entries,
        "llama_weights": sum(b for name, b in size.items() if name not in served),
        "kv_cache": int(kv_heads.sum()) * cells * (k_len + v_len) * 2,
        "compute_buffers": int(COMPUTE_SAFETY * (cpu + device_compute_bytes + n_vocab * 4)),
    }


def llama_share(header: GGUFHeader, info: SidecarInfo, n_ctx: int, n_ubatch: int) -> dict[str, int]:
    """llama.cpp's memory in offload mode (bytes): :func:`llama_memory` with the served layers'
    ffn_gate/up/down served (the LLAMAFLASH device's compute: n_ubatch x 3 n_ff x 4; token_embd read
    by rows), and ``prefill_window`` (one served layer's base up + down bytes, page cache during dense
    prefill). ``header``: the base model's (:func:`~llamaflash.files.gguf_header.read_gguf_header`)."""
    served = {fmt.base_ffn_gate_name(lay.layer) for lay in info.layers}
    served |= {fmt.base_ffn_up_name(lay.layer) for lay in info.layers}
    served |= {fmt.base_ffn_down_name(lay.layer) for lay in info.layers}
    n_ff = max(lay.n_ff for lay in info.layers)
    size = {t.name: t.nbytes for t in header.tensors}
    return {
        **llama_memory(header, n_ctx, n_ubatch, served, n_ubatch * 3 * n_ff * 4, embeddings_by_rows=True),
        "prefill_window": max(
            size[fmt.base_ffn_up_name(lay.layer)] + size[fmt.base_ffn_down_name(lay.layer)] for lay in info.layers
        ),
    }
