"""Tiny synthetic llama-architecture GGUF models for tests, and helpers that make bad files.

:func:`write_tiny_llama` writes a complete, loadable llama model (random weights, a small
SentencePiece-style vocabulary with byte fallback) that stock ``llama_cpp.Llama`` loads
and generates from. FFN and attention matrices can be F32, F16, Q8_0, Q4_0, Q4_1, Q5_0
(quantized with ``gguf.quants``) or K-quants Q4_K, Q4_K_M, Q6_K (an F32 model quantized
by llama.cpp's ``llama_model_quantize``; needs n_embd and n_ff multiples of 256).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

#: Weight types written directly with gguf-py (name → ggml type).
DIRECT_WEIGHT_TYPES: dict[str, gguf.GGMLQuantizationType] = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
    "Q5_0": gguf.GGMLQuantizationType.Q5_0,
}

#: Weight types produced by llama.cpp's quantizer: name → (llama_ftype, pure).
#: "Q4_K" is pure Q4_K (every matrix Q4_K); "Q4_K_M" is llama.cpp's usual mix (some
#: ffn_down and attn_v in Q6_K).
KQUANT_WEIGHT_TYPES: dict[str, tuple[int, bool]] = {
    "Q4_K": (15, True),  # LLAMA_FTYPE_MOSTLY_Q4_K_M, pure
    "Q4_K_M": (15, False),  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    "Q6_K": (18, False),  # LLAMA_FTYPE_MOSTLY_Q6_K
}

#: llama_ftype recorded in general.file_type for directly written models.
_DIRECT_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8}

#: Words the synthetic vocabulary knows whole (as "▁word" pieces).
WORDS: tuple[str, ...] = (
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "I",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "or",
    "had",
    "by",
    "hello",
    "world",
    "once",
    "upon",
    "time",
    "there",
    "cat",
    "dog",
    "sat",
    "mat",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "Shakespeare",
    "Austen",
)


def _word_pieces() -> tuple[str, ...]:
    """The bare "▁", punctuation, then every prefix of every "▁word" (SentencePiece's merges
    build a word one symbol at a time, so each intermediate prefix must be a token)."""
    pieces = ["▁", ".", ",", "!", "?"]
    for word in WORDS:
        full = "▁" + word
        pieces += [full[:n] for n in range(2, len(full) + 1)]
    return tuple(dict.fromkeys(pieces))


#: Word pieces of the synthetic vocabulary (after the specials and the 256 byte tokens).
WORD_PIECES: tuple[str, ...] = _word_pieces()

CONTEXT_LENGTH = 256


@dataclass(frozen=True)
class TinyModelSpec:
    """Parameters of a synthetic model; equal specs produce byte-identical files."""

    n_layer: int = 2
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    weight_type: str = "F32"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.weight_type not in DIRECT_WEIGHT_TYPES and self.weight_type not in KQUANT_WEIGHT_TYPES:
            raise ValueError(f"unknown weight_type {self.weight_type!r}")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
        block = 256 if self.weight_type in KQUANT_WEIGHT_TYPES else 32
        if self.weight_type not in ("F32", "F16") and (self.n_embd % block or self.n_ff % block):
            raise ValueError(f"{self.weight_type} needs n_embd and n_ff multiples of {block}")

    @property
    def model_name(self) -> str:
        """``general.name`` written into the model."""
        return f"tiny-llama-synth-{self.weight_type}"

    @property
    def file_stem(self) -> str:
        return (
            f"tiny-llama-L{self.n_layer}-E{self.n_embd}-F{self.n_ff}-H{self.n_head}"
            f"-KV{self.n_head_kv}-{self.weight_type}-s{self.seed}"
        )


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """The synthetic SentencePiece ("llama") vocabulary: tokens, scores, token types.

    Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>``, 3..258 the byte tokens ``<0x00>``..``<0xFF>``,
    then :data:`WORD_PIECES`.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    tokens += list(WORD_PIECES)
    types += [gguf.TokenType.NORMAL] * len(WORD_PIECES)
    # SentencePiece merges prefer higher scores: longer pieces first.
    scores = [0.0] * (3 + 256) + [float(len(p)) - 10.0 for p in WORD_PIECES]
    return tokens, scores, [int(t) for t in types]


def write_tiny_llama(path: str | os.PathLike[str], spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the model described by ``spec`` to ``path`` and return ``path``."""
    path = Path(path)
    if spec.weight_type in KQUANT_WEIGHT_TYPES:
        f32_path = path.with_name(path.name + ".f32.tmp")
        try:
            f32_spec = TinyModelSpec(**{**asdict(spec), "weight_type": "F32"})
            _write_direct(f32_path, f32_spec, name=spec.model_name)
            _quantize_with_llama_cpp(f32_path, path, *KQUANT_WEIGHT_TYPES[spec.weight_type])
        finally:
            f32_path.unlink(missing_ok=True)
    else:
        _write_direct(path, spec)
    return path


def synthetic_text(n_words: int, seed: int = 0) -> str:
    """Deterministic text of ``n_words`` words from :data:`WORDS` (about one token each for the
    synthetic vocabulary), in sentences of 4 to 12 words, one sentence per line now and then."""
    rng = np.random.default_rng(seed)
    words = rng.choice(np.array(WORDS), size=n_words)
    out, i = [], 0
    while i < n_words:
        k = int(rng.integers(4, 13))
        sentence = " ".join(words[i : i + k])
        out.append(sentence[:1].upper() + sentence[1:] + ".")
        i += k
    lines = [" ".join(out[j : j + 3]) for j in range(0, len(out), 3)]
    return "\n".join(lines) + "\n"


#: Conversion settings (``convert()`` keywords) for tests on synthetic models: self-contained synthetic
#: calibration and validation texts (no registry download), few levels, short validation; a synthetic
#: model converts well under a second.
FAST_CONVERT = dict(
    calib_text=synthetic_text(3000, seed=1),
    valid_text=synthetic_text(800, seed=2),
    valid_tokens=512,
    calib_tokens=2048,
    levels=(0.25, 0.5, 0.75),
)


def write_not_gguf(path: str | os.PathLike[str]) -> Path:
    """Write a small file that is not a GGUF (plain text) to ``path``."""
    path = Path(path)
    path.write_text("this is not a GGUF model, just some text\n" * 20)
    return path


def write_unsupported_architecture(path: str | os.PathLike[str], arch: str = "mamba") -> Path:
    """Write a small, well-formed GGUF of architecture ``arch`` with no FFN tensors."""
    path = Path(path)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.add_tensor("blk.0.ssm_in.weight", np.zeros((64, 32), dtype=np.float32))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return path


def truncate(path: str | os.PathLike[str], n_bytes: int) -> Path:
    """Cut the file at ``path`` down to its first ``n_bytes`` bytes."""
    os.truncate(path, n_bytes)
    return Path(path)


# --------------------------------------------------------------------------------------
# internals
# --------------------------------------------------------------------------------------


def _write_direct(path: Path, spec: TinyModelSpec, name: str | None = None) -> None:
    rng = np.random.default_rng(spec.seed)
    qtype = DIRECT_WEIGHT_TYPES[spec.weight_type]
    tokens, scores, token_types = vocabulary()
    head_dim = spec.n_embd // spec.n_head
    n_embd_kv = head_dim * spec.n_head_kv

    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name or spec.model_name)
    w.add_file_type(_DIRECT_FILE_TYPES[spec.weight_type])
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(token_types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    def matrix(n_out: int, n_in: int) -> np.ndarray:
        # fan-in scaled so that activations stay O(1) through the residual stream
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def add_matrix(name: str, data: np.ndarray) -> None:
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    ones = np.ones(spec.n_embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), spec.n_embd)).astype(np.float32))
    for i in range(spec.n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        add_matrix(f"blk.{i}.attn_q.weight", matrix(spec.n_embd, spec.n_embd))
        add_matrix(f"blk.{i}.attn_k.weight", matrix(n_embd_kv, spec.n_embd))
        add_matrix(f"blk.{i}.attn_v.weight", matrix(n_embd_kv, spec.n_embd))
        add_matrix(f"blk.{i}.attn_output.weight", matrix(spec.n_embd, spec.n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        add_matrix(f"blk.{i}.ffn_gate.weight", matrix(spec.n_ff, spec.n_embd))
        add_matrix(f"blk.{i}.ffn_up.weight", matrix(spec.n_ff, spec.n_embd))
        add_matrix(f"blk.{i}.ffn_down.weight", matrix(spec.n_embd, spec.n_ff))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", matrix(len(tokens), spec.n_embd))

    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()


def _quantize_with_llama_cpp(src: Path, dst: Path, ftype: int, pure: bool) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.pure = pure
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, ftype={ftype}) failed: {rc}")
