"""Which GGUF tensors and hyperparameters each Mixture-of-Experts architecture of llama.cpp needs.

Read from llama.cpp's model loaders in the llama-cpp-python 0.3.36 sdist (``src/models/<arch>.cpp``,
``llama_model_base::load_hparams``). numpy shapes are ggml's ``ne`` reversed:

===========  ==================================================================================
arch         per layer, besides attn_norm, attn_{q,k,v,output}, ffn_gate_inp [n_expert, n_embd]
             and ffn_{gate,up}_exps [n_expert, n_ff_exp, n_embd], ffn_down_exps [n_expert,
             n_embd, n_ff_exp]
===========  ==================================================================================
qwen3moe     ffn_norm, attn_q_norm / attn_k_norm [head_dim]; rope NEOX; expert FFN SwiGLU,
             softmax gating, weights renormalised over the selected experts
llama        (Mixtral) ffn_norm; rope NORM with rope dim == head dim; the expert FFN size is
             ``llama.feed_forward_length``; softmax gating, weights renormalised
gpt-oss      post_attention_norm (the FFN norm), attn_sinks [n_head], attn_output.bias,
             ffn_gate_inp.bias, ffn_{gate,up}_exps.bias [n_expert, n_ff_exp],
             ffn_down_exps.bias [n_expert, n_embd]; ``attention.sliding_window`` required (every
             other layer is sliding-window); rope NEOX; swiglu_oai (alpha 1.702, clamp 7);
             softmax over the selected experts' logits
qwen2moe     ffn_norm; shared expert ffn_gate_inp_shexp [n_embd] (sigmoid gate),
             ffn_{gate,up}_shexp [n_ff_shexp, n_embd], ffn_down_shexp [n_embd, n_ff_shexp];
             rope NEOX; softmax gating, weights not renormalised
===========  ==================================================================================

Every architecture here also takes ``output.weight`` [n_vocab, n_embd] (written always: gpt-oss and
qwen2moe require it) and ``output_norm.weight``, ``token_embd.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

ROPE_NORM = "norm"  # pairs (2i, 2i+1) rotate together
ROPE_NEOX = "neox"  # pairs (i, i + head_dim/2) rotate together


@dataclass(frozen=True)
class ArchInfo:
    """What differs between the supported architectures."""

    name: str  # general.architecture
    vocab: str  # default tokenizer (a vocabulary of moe_vocab.VOCABS)
    rope: str  # ROPE_NORM or ROPE_NEOX
    ffn_norm: str  # name of the FFN input norm tensor
    qk_norm: bool  # attn_q_norm / attn_k_norm per head
    attn_sinks: bool  # attn_sinks, attn_output.bias (gpt-oss)
    expert_bias: bool  # ffn_gate_inp.bias and ffn_*_exps.bias (gpt-oss)
    shared_expert: bool  # *_shexp (qwen2moe)
    sliding_window: bool  # attention.sliding_window (gpt-oss)


ARCHS: Dict[str, ArchInfo] = {
    "qwen3moe": ArchInfo("qwen3moe", "qwen2", ROPE_NEOX, "ffn_norm", True, False, False, False, False),
    "llama": ArchInfo("llama", "llama-spm", ROPE_NORM, "ffn_norm", False, False, False, False, False),
    "gpt-oss": ArchInfo("gpt-oss", "qwen2", ROPE_NEOX, "post_attention_norm", False, True, True, False, True),
    "qwen2moe": ArchInfo("qwen2moe", "qwen2", ROPE_NEOX, "ffn_norm", False, False, False, True, False),
}


@dataclass(frozen=True)
class Dims:
    """The sizes of one model (everything the tensor shapes and hyperparameters depend on)."""

    n_vocab: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    n_ctx_train: int
    rope_base: float
    sliding_window: int
    rms_eps: float = 1e-6


def hparams(arch: ArchInfo, d: Dims) -> List[Tuple[str, object, str]]:
    """(key without the ``<arch>.`` prefix, value, kind) for the model's hyperparameters; kind is
    "u32" or "f32"."""
    out: List[Tuple[str, object, str]] = [
        ("context_length", d.n_ctx_train, "u32"),
        ("embedding_length", d.n_embd, "u32"),
        ("block_count", d.n_layer, "u32"),
        # llama sizes its experts by feed_forward_length; the others read expert_feed_forward_length
        ("feed_forward_length", d.n_ff_exp, "u32"),
        ("expert_feed_forward_length", d.n_ff_exp, "u32"),
        ("attention.head_count", d.n_head, "u32"),
        ("attention.head_count_kv", d.n_head_kv, "u32"),
        ("attention.key_length", d.head_dim, "u32"),
        ("attention.value_length", d.head_dim, "u32"),
        ("rope.dimension_count", d.head_dim, "u32"),
        ("rope.freq_base", d.rope_base, "f32"),
        ("attention.layer_norm_rms_epsilon", d.rms_eps, "f32"),
        ("expert_count", d.n_expert, "u32"),
        ("expert_used_count", d.n_expert_used, "u32"),
    ]
    if arch.shared_expert:
        out.append(("expert_shared_feed_forward_length", d.n_ff_shexp, "u32"))
    if arch.sliding_window:
        out.append(("attention.sliding_window", d.sliding_window, "u32"))
    return out


def tensor_shapes(arch: ArchInfo, d: Dims) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, numpy shape) of every tensor of the model, in file order."""
    q_dim, kv_dim = d.n_head * d.head_dim, d.n_head_kv * d.head_dim
    out: List[Tuple[str, Tuple[int, ...]]] = [("token_embd.weight", (d.n_vocab, d.n_embd))]
    for i in range(d.n_layer):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (d.n_embd,)),
            (b + "attn_q.weight", (q_dim, d.n_embd)),
            (b + "attn_k.weight", (kv_dim, d.n_embd)),
            (b + "attn_v.weight", (kv_dim, d.n_embd)),
            (b + "attn_output.weight", (d.n_embd, q_dim)),
        ]
        if arch.qk_norm:
            out += [(b + "attn_q_norm.weight", (d.head_dim,)), (b + "attn_k_norm.weight", (d.head_dim,))]
        if arch.attn_sinks:
            out += [(b + "attn_sinks.weight", (d.n_head,)), (b + "attn_output.bias", (d.n_embd,))]
        out += [
            (b + f"{arch.ffn_norm}.weight", (d.n_embd,)),
            (b + "ffn_gate_inp.weight", (d.n_expert, d.n_embd)),
            (b + "ffn_gate_exps.weight", (d.n_expert, d.n_ff_exp, d.n_embd)),
            (b + "ffn_up_exps.weight", (d.n_expert, d.n_ff_exp, d.n_embd)),
            (b + "ffn_down_exps.weight", (d.n_expert, d.n_embd, d.n_ff_exp)),
        ]
        if arch.expert_bias:
            out += [
                (b + "ffn_gate_inp.bias", (d.n_expert,)),
                (b + "ffn_gate_exps.bias", (d.n_expert, d.n_ff_exp)),
                (b + "ffn_up_exps.bias", (d.n_expert, d.n_ff_exp)),
                (b + "ffn_down_exps.bias", (d.n_expert, d.n_embd)),
            ]
        if arch.shared_expert:
            out += [
                (b + "ffn_gate_inp_shexp.weight", (d.n_embd,)),
                (b + "ffn_gate_shexp.weight", (d.n_ff_shexp, d.n_embd)),
                (b + "ffn_up_shexp.weight", (d.n_ff_shexp, d.n_embd)),
                (b + "ffn_down_shexp.weight", (d.n_embd, d.n_ff_shexp)),
            ]
    out += [("output_norm.weight", (d.n_embd,)), ("output.weight", (d.n_vocab, d.n_embd))]
    return out


def stored_as_f32(name: str, shape: Tuple[int, ...]) -> bool:
    """Tensors written in F32 (the others F16): 1-D tensors, 2-D biases, and the router, which
    llama.cpp's quantizer never quantizes."""
    return len(shape) == 1 or name.endswith(".bias") or name.endswith("ffn_gate_inp.weight")
