"""The decode bound: bytes that must move per generated token ÷ measured bandwidth.

Decode of one token reads every weight matrix once (a GEMV each), except the token embedding, of
which it reads one row (unless the output projection is tied to it: then lm_head reads all of it).
The KV cache and activations are small next to the weights at these context lengths and are left
out (stated in the output). For the sparse lane, a served layer reads its gate matrix (all
neurons: gate-first selection by ggml's GEMV), then per active neuron one up row and one down_t
row of the sidecar's type, instead of the whole up and down matrices (with the dense-up variant:
the whole up matrix and the active down_t rows).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from llamaflash.files.gguf_header import read_gguf_header
from llamaflash.files.sidecar import SidecarInfo


@dataclass
class DecodeBytes:
    stock: int  # bytes per token, stock llama.cpp (and the dense lane)
    ffn: int  # of which the served FFN layers' gate/up/down
    sparse: int | None = None  # bytes per token with the sparse lane at the measured active fractions
    note: str = "weights only (KV cache and activations left out)"

    def bound_tps(self, bandwidth: float, sparse: bool = False) -> float:
        b = self.sparse if sparse else self.stock
        return bandwidth / b if b else float("nan")


def decode_bytes(
    model_path: str | os.PathLike[str],
    sidecar: SidecarInfo | None = None,
    active_fraction: dict[int, float] | None = None,
    dense_up: bool = False,
) -> DecodeBytes:
    """Weight bytes read per decoded token (see the module docstring); ``active_fraction``: per
    served layer, the fraction of neurons the sparse lane computed (``flash_stats()``);
    ``dense_up``: the lane computed u for every neuron with ggml's GEMV (the whole up matrix)."""
    header = read_gguf_header(model_path)
    names = {t.name for t in header.tensors}
    tied = "output.weight" not in names
    stock = 0
    ffn_bytes: dict[int, dict[str, int]] = {}
    for t in header.tensors:
        if t.name == "token_embd.weight" and not tied:
            stock += t.nbytes // max(1, t.shape[1] if len(t.shape) > 1 else 1)  # one row
            continue
        stock += t.nbytes
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            ffn_bytes.setdefault(int(parts[1]), {})[parts[2]] = t.nbytes
    served = {layer.layer: layer for layer in sidecar.layers} if sidecar is not None else {}
    ffn = sum(sum(b.values()) for layer, b in ffn_bytes.items() if layer in served or not served)
    out = DecodeBytes(stock=stock, ffn=ffn)
    if sidecar is not None and active_fraction:
        sparse = stock
        for layer, spec in served.items():
            frac = active_fraction.get(layer)
            if frac is None:
                continue
            b = ffn_bytes[layer]
            sparse -= b["ffn_down"] + (0 if dense_up else b["ffn_up"])
            sparse += int(frac * spec.n_ff * ((0 if dense_up else spec.up_row_bytes) + spec.down_t_row_bytes))
        out.sparse = sparse
    return out
