"""Mixture-of-Experts base models: which tensors are routed experts, where each expert's bytes lie.

llama.cpp stores an MoE layer's routed experts as 3-D tensors ``blk.N.ffn_{gate,up,down}_exps.weight``
(or one merged ``ffn_gate_up_exps``) of shape ``[ne0 = input, ne1 = output rows, n_expert]``: expert
``e``'s matrix is the contiguous slice ``[offset + e * expert_bytes, + expert_bytes)`` of the file.
The router is ``blk.N.ffn_gate_inp.weight`` ``[n_embd, n_expert]``. Everything else (attention, norms,
router, shared experts ``*_shexp``, embeddings, output) is the model's dense part.

:func:`read_moe_model` describes that layout from the parsed header (no tensor data is read);
:func:`router_matrix` reads one router as float32 for the next-layer expert predictor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import ggml_types
from .gguf_header import GGUFHeader, TensorInfo

#: Expert tensor kinds, in the native enum's order (``_native.ExpertTensorKind``).
EXPERT_KINDS = ("gate", "up", "down", "gate_up")

#: Architectures whose MoE layers llamaflash serves exactly: llama.cpp builds their routed experts with
#: build_moe_ffn (MUL_MAT_ID over ``*_exps``, element-wise ops, optional ADD_ID biases), which the
#: expert lane computes with ggml's own numerics. Tested bit-identical: qwen3moe, llama (Mixtral
#: layout), gpt-oss. Other MoE architectures run as stock llama.cpp, with one line saying why.
SERVED_MOE_ARCHITECTURES = ("qwen3moe", "qwen2moe", "llama", "gpt-oss", "olmoe")

_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")


@dataclass(frozen=True)
class ExpertTensor:
    """One expert tensor of a layer: ``kind`` in EXPERT_KINDS; ``offset`` absolute in the base file."""

    name: str
    kind: str
    ggml_type: int
    ne0: int
    ne1: int
    n_expert: int
    offset: int
    expert_bytes: int

    def slice_offset(self, expert: int) -> int:
        return self.offset + expert * self.expert_bytes


@dataclass(frozen=True)
class MoeLayer:
    layer: int
    n_expert: int
    n_used: int
    tensors: tuple[ExpertTensor, ...]
    router: TensorInfo | None

    @property
    def expert_bytes(self) -> int:
        """One expert's bytes over all its tensors."""
        return sum(t.expert_bytes for t in self.tensors)


@dataclass(frozen=True)
class MoeModelInfo:
    path: Path
    architecture: str
    n_layer: int
    n_embd: int
    n_expert: int
    n_used: int
    layers: tuple[MoeLayer, ...]
    file_size: int
    expert_bytes_total: int = field(default=0)

    @property
    def dense_bytes(self) -> int:
        """Bytes of the file that are not routed experts (weights llama.cpp keeps resident, and the header)."""
        return self.file_size - self.expert_bytes_total

    @property
    def supported(self) -> bool:
        return self.architecture in SERVED_MOE_ARCHITECTURES

    @property
    def n_expert_tensors(self) -> int:
        return sum(len(layer.tensors) for layer in self.layers)


def _meta(header: GGUFHeader, key: str) -> object:
    v = header.metadata.get(key)
    return None if v is None else v.value


def read_moe_model(header: GGUFHeader) -> MoeModelInfo | None:
    """The MoE layout of a base model, or None when it has no routed expert tensors."""
    arch = str(_meta(header, "general.architecture") or "")
    by_layer: dict[int, list[ExpertTensor]] = {}
    for t in header.tensors:
        m = _EXPS.match(t.name)
        if m is None or len(t.shape) != 3:
            continue
        ne0, ne1, n_expert = (int(x) for x in t.shape)
        eb = ggml_types.row_bytes(t.ggml_type, ne0) * ne1
        by_layer.setdefault(int(m.group(1)), []).append(
            ExpertTensor(t.name, m.group(2), t.ggml_type, ne0, ne1, n_expert, t.offset, eb)
        )
    if not by_layer:
        return None
    n_expert = int(_meta(header, f"{arch}.expert_count") or 0)
    n_used = int(_meta(header, f"{arch}.expert_used_count") or 0)
    n_layer = int(_meta(header, f"{arch}.block_count") or 0)
    n_embd = int(_meta(header, f"{arch}.embedding_length") or 0)
    routers = {t.name: t for t in header.tensors}
    layers = []
    for il in sorted(by_layer):
        tensors = tuple(sorted(by_layer[il], key=lambda t: EXPERT_KINDS.index(t.kind)))
        n_exp = tensors[0].n_expert
        layers.append(MoeLayer(il, n_exp, n_used, tensors, routers.get(f"blk.{il}.ffn_gate_inp.weight")))
    total = sum(layer.expert_bytes * layer.n_expert for layer in layers)
    return MoeModelInfo(
        Path(header.path),
        arch,
        n_layer,
        n_embd,
        n_expert or layers[0].n_expert,
        n_used,
        tuple(layers),
        header.file_size,
        total,
    )


def check_layout(moe: MoeModelInfo) -> str | None:
    """Why this MoE model cannot be served exactly (None: it can)."""
    if not moe.supported:
        return (
            f"architecture '{moe.architecture}' has routed experts, but llamaflash serves only "
            f"{', '.join(SERVED_MOE_ARCHITECTURES)} exactly"
        )
    if moe.n_used <= 0 or moe.n_used > moe.n_expert:
        return f"expert_used_count {moe.n_used} is not in [1, expert_count {moe.n_expert}]"
    for layer in moe.layers:
        kinds = {t.kind for t in layer.tensors}
        if not ({"up", "down"} <= kinds or {"gate_up", "down"} <= kinds):
            return f"layer {layer.layer}: expert tensors {sorted(kinds)} lack up/down"
        if any(t.n_expert != layer.n_expert for t in layer.tensors):
            return f"layer {layer.layer}: expert tensors disagree on the expert count"
    return None


def router_matrix(path: str | Path, router: TensorInfo) -> np.ndarray:
    """The router ``[n_expert, n_embd]`` as float32 (dequantized when stored quantized)."""
    n_embd, n_expert = int(router.shape[0]), int(router.shape[1])
    raw = np.fromfile(path, dtype=np.uint8, count=router.nbytes, offset=router.offset)
    if router.ggml_type == ggml_types.F32:
        out = raw.view(np.float32)
    elif router.ggml_type == ggml_types.F16:
        out = raw.view(np.float16).astype(np.float32)
    else:
        import gguf  # quantized routers only: gguf-py's dequantizer

        out = gguf.quants.dequantize(raw.reshape(n_expert, -1), gguf.GGMLQuantizationType(router.ggml_type))
    return np.ascontiguousarray(out.reshape(n_expert, n_embd), dtype=np.float32)
