"""Full-size synthetic MoE models written as quantized blocks, with no float intermediate file.

A 30B-parameter model's F16 intermediate (61 GB) does not fit the disk, and llama.cpp's reference
K-quant quantizer runs at a few million weights per second per core (hours for 29 billion expert
weights). So :func:`write_direct` streams every tensor straight into the output GGUF in its final
type:

* routed expert tensors (``ffn_{gate,up,down}_exps.weight``, 94% of the Qwen3-30B-A3B shape) are *random quantized
  blocks* made directly from a random byte stream: uniform 4-bit codes with block scales chosen so
  that the dequantized weights have mean 0 and the standard deviation that
  :meth:`.moe_weights.WeightMaker.expert_law` gives the float generator (rows the shaped regime keeps
  at zero get zero blocks). The routing depends only on the router, the attention and the embedding
  (exact float generators, below) and on the experts' output magnitudes, which these keep;
* every other matrix is generated in float32 by :class:`.moe_weights.WeightMaker` one tensor at a
  time and quantized by ggml's own quantizer (``ggml_quantize_chunk`` of llama-cpp-python's
  libggml-base, rows split over threads); 1-D tensors, biases and the router stay F32.

Mixes (:data:`MIXES`) give each tensor kind its type: ``Q4_K_M`` mirrors llama.cpp's Q4_K_M where
it matters for size and speed (experts and attention Q4_K, attn_v and output Q6_K, token table
Q4_K); ``MXFP4`` is gpt-oss's release format (experts MXFP4, every other matrix Q8_0).

Block layouts (ggml-common.h of llama-cpp-python 0.3.36):
``block_q4_K`` {f16 d, f16 dmin, u8 scales[12], u8 qs[128]} per 256 weights, w = d*sc_j*q - dmin*m_j
for sub-block j of 32 (6-bit sc_j, m_j packed as in ``get_scale_min_k4``);
``block_mxfp4`` {u8 e, u8 qs[16]} per 32 weights, w = kvalues_mxfp4[q] * 2^(e - 128).
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

#: ggml type id, weights per block, bytes per block
GGML_TYPES = {
    "F32": (0, 1, 4),
    "F16": (1, 1, 2),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q6_K": (14, 256, 210),
    "MXFP4": (39, 32, 17),
}
#: random-block types (expert tensors)
RANDOM_BLOCK_TYPES = ("Q4_K", "MXFP4")

#: kvalues_mxfp4 (e2m1 values doubled; the E8M0 "half" scale halves them back)
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float64)
#: Q4_K sub-block scale and min used for every random block (6-bit, the largest multiple of 4
#: below 64: sc = m = 60 so that dmin*m = d*sc*7.5 centres the codes 0..15 on zero)
_Q4K_SC = 60


@dataclass(frozen=True)
class QuantMix:
    """The type of each tensor kind in a directly written model."""

    experts: str
    attn: str
    attn_v: str
    token_embd: str
    output: str
    file_type: int  # general.file_type (llama_ftype)

    def tensor_type(self, name: str, as_f32: bool) -> str:
        if as_f32:
            return "F32"
        if name.endswith("_exps.weight"):
            return self.experts
        if name == "token_embd.weight":
            return self.token_embd
        if name == "output.weight":
            return self.output
        if name.endswith("attn_v.weight"):
            return self.attn_v
        return self.attn


MIXES = {
    "Q4_K_M": QuantMix(experts="Q4_K", attn="Q4_K", attn_v="Q6_K", token_embd="Q4_K", output="Q6_K", file_type=15),
    "MXFP4": QuantMix(experts="MXFP4", attn="Q8_0", attn_v="Q8_0", token_embd="Q8_0", output="Q8_0", file_type=38),
}


def row_bytes(type_name: str, n_per_row: int) -> int:
    _, block, size = GGML_TYPES[type_name]
    if n_per_row % block:
        raise ValueError(f"{type_name} needs rows that are multiples of {block} weights, got {n_per_row}")
    return n_per_row // block * size


def mix_block_problems(mix: QuantMix, row_lengths: dict[str, int]) -> list[str]:
    """Row lengths (name -> weights per row) that a mix's types cannot hold."""
    out = []
    for what, n in row_lengths.items():
        for t in {mix.experts, mix.attn, mix.attn_v, mix.token_embd, mix.output}:
            block = GGML_TYPES[t][1]
            if n % block:
                out.append(f"{what} ({n}) is not a multiple of {t}'s block of {block}")
    return sorted(set(out))


# --------------------------------------------------------------------------------------------
# ggml's quantizer


@lru_cache(maxsize=1)
def _ggml() -> ctypes.CDLL:
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if (lib_dir / name).exists():
            lib = ctypes.CDLL(str(lib_dir / name))
            break
    else:  # pragma: no cover - depends on the llama-cpp-python build
        raise RuntimeError(f"libggml-base not found in {lib_dir}")
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.restype = None
    return lib


def quantize_rows(x: np.ndarray, type_name: str, n_threads: int = 1) -> np.ndarray:
    """float32 [rows, n] -> uint8 [rows, row_bytes] in ``type_name`` (ggml's quantizer, no imatrix)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize_rows takes a 2-D array, got shape {x.shape}")
    rows, n = x.shape
    if type_name == "F32":
        return x.view(np.uint8).reshape(rows, n * 4)
    if type_name == "F16":
        return x.astype(np.float16).view(np.uint8).reshape(rows, n * 2)
    type_id = GGML_TYPES[type_name][0]
    out = np.empty((rows, row_bytes(type_name, n)), np.uint8)
    lib = _ggml()
    lib.ggml_quantize_init(type_id)
    step = max(1, -(-rows // max(1, n_threads)))

    def part(r0: int) -> int:
        r1 = min(rows, r0 + step)
        return lib.ggml_quantize_chunk(
            type_id, x[r0:].ctypes.data, out[r0:].ctypes.data, 0, r1 - r0, n, None
        )  # ctypes releases the GIL during the call

    starts = range(0, rows, step)
    if len(starts) == 1:
        part(0)
    else:
        with ThreadPoolExecutor(len(starts)) as pool:
            list(pool.map(part, starts))
    return out


# --------------------------------------------------------------------------------------------
# random blocks


def _q4k_scale_bytes() -> np.ndarray:
    """The 12 packed scale bytes with sc_j = m_j = _Q4K_SC for all 8 sub-blocks."""
    lo6, hi2 = _Q4K_SC & 63, _Q4K_SC >> 4
    b = np.empty(12, np.uint8)
    b[0:4] = lo6 | ((hi2 & 3) << 6)  # sc_j, j < 4, with the top bits of sc_{j+4}
    b[4:8] = lo6 | ((hi2 & 3) << 6)  # m_j, j < 4, with the top bits of m_{j+4}
    b[8:12] = (_Q4K_SC & 15) | ((_Q4K_SC & 15) << 4)  # low 4 bits of sc_{j+4} and m_{j+4}
    return b


def random_blocks(
    rng: np.random.Generator, n_rows: int, n_per_row: int, type_name: str, std: float, zero_rows=None
) -> np.ndarray:
    """uint8 [n_rows, row_bytes]: random ``type_name`` rows whose weights have mean 0 and standard
    deviation ``std`` (Q4_K exactly up to the f16 rounding of d; MXFP4 in expectation, mixing two
    adjacent power-of-two scales); rows where ``zero_rows`` (bool [n_rows]) is set are all zero."""
    if type_name not in RANDOM_BLOCK_TYPES:
        raise ValueError(f"random blocks exist for {', '.join(RANDOM_BLOCK_TYPES)}, not {type_name}")
    _, block, size = GGML_TYPES[type_name]
    per_row = row_bytes(type_name, n_per_row) // size
    n_blocks = n_rows * per_row
    out = np.frombuffer(bytearray(rng.bytes(n_blocks * size)), np.uint8).reshape(n_blocks, size)
    if type_name == "Q4_K":
        d = np.float16(std / (_Q4K_SC * np.sqrt(255.0 / 12.0)))  # uniform codes 0..15: std sqrt(255/12)
        dmin = np.float16(float(d) * 7.5)
        out[:, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        out[:, 2:4] = np.frombuffer(dmin.tobytes(), np.uint8)
        out[:, 4:16] = _q4k_scale_bytes()
    else:
        mean_sq = float(np.mean(_MXFP4_VALUES**2))  # uniform codes
        e_lo = int(np.floor(np.log2(std / np.sqrt(mean_sq)))) + 128
        v_lo = mean_sq * 4.0 ** (e_lo - 128)
        p_hi = (std * std / v_lo - 1.0) / 3.0  # share of blocks at e_lo + 1 (variance 4 v_lo)
        out[:, 0] = np.where(out[:, 0] < np.uint8(round(p_hi * 256)), e_lo + 1, e_lo)
    rows = out.reshape(n_rows, per_row * size)
    if zero_rows is not None:
        rows[np.asarray(zero_rows, bool)] = 0
    return rows


def dequantize_random(rows: np.ndarray, type_name: str) -> np.ndarray:
    """float32 values of rows made by :func:`random_blocks` (only their fixed scale pattern is
    decoded), for checking the law they follow."""
    _, block, size = GGML_TYPES[type_name]
    b = rows.reshape(-1, size)
    if type_name == "Q4_K":
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = b[:, 16:]
        # 4 groups of 32 bytes: low nibbles are sub-block 2g, high nibbles 2g+1
        q = np.concatenate(
            [
                np.stack([qs[:, 32 * g : 32 * g + 32] & 15, qs[:, 32 * g : 32 * g + 32] >> 4], 1).reshape(len(b), 64)
                for g in range(4)
            ],
            1,
        )
        return (d * _Q4K_SC * q - dmin * _Q4K_SC).reshape(rows.shape[0], -1)
    scale = np.exp2(b[:, 0].astype(np.float32) - 128.0)[:, None]
    q = np.concatenate([b[:, 1:] & 15, b[:, 1:] >> 4], 1)
    return (_MXFP4_VALUES[q] * scale).astype(np.float32).reshape(rows.shape[0], -1)


# --------------------------------------------------------------------------------------------
# the writer


def write_direct(
    path: Path,
    arch_name: str,
    model_name: str,
    hparams: list,
    source_repr: str,
    tok_meta,
    shapes: list,
    maker,
    mix: QuantMix,
    stored_as_f32: Callable[[str, tuple], bool],
    n_threads: int,
    say: Callable[[str], None],
    n_layer: int,
) -> None:
    """Writes the GGUF at ``path``: metadata, then every tensor of ``shapes`` in ``mix``'s types."""
    import gguf

    types = [mix.tensor_type(name, stored_as_f32(name, shape)) for name, shape in shapes]
    w = gguf.GGUFWriter(path, arch_name)
    try:
        w.add_name(model_name)
        w.add_file_type(mix.file_type)
        for key, value, kind in hparams:
            if kind == "u32":
                w.add_uint32(f"{arch_name}.{key}", int(value))
            else:
                w.add_float32(f"{arch_name}.{key}", float(value))
        w.add_string("general.source.synthetic", source_repr)
        for m in tok_meta:
            w.add_key_value(m.key, m.value, m.vtype, m.sub_type)
        for (name, shape), t in zip(shapes, types):
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            nbytes = rows * row_bytes(t, shape[-1])
            byte_shape = tuple(shape[:-1]) + (row_bytes(t, shape[-1]),)
            raw = getattr(gguf.GGMLQuantizationType, t)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for (name, shape), t in zip(shapes, types):
            w.write_tensor_data(_tensor_bytes(name, tuple(shape), t, maker, n_threads))
            if name.endswith("ffn_down_exps.weight"):
                say(f"layer {int(name.split('.')[1]) + 1}/{n_layer} written")
    finally:
        w.close()


def _tensor_bytes(name: str, shape: tuple, t: str, maker, n_threads: int) -> np.ndarray:
    """uint8 [*shape[:-1], row_bytes]: one tensor in type ``t``."""
    if name.endswith("_exps.weight"):
        std, zero = maker.expert_law(name, shape)
        rows = int(np.prod(shape[:-1]))
        zero_rows = None if zero is None else np.broadcast_to(zero, shape[:-1]).reshape(-1)
        out = random_blocks(maker.rng(name), rows, shape[-1], t, std, zero_rows)
    else:
        data = maker.make(name, shape)
        if not np.all(np.isfinite(data)):
            raise RuntimeError(f"weights of {name} are not finite")
        out = quantize_rows(data.reshape(-1, shape[-1]), t, n_threads)
    return out.reshape(tuple(shape[:-1]) + (out.shape[-1],))
