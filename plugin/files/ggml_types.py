"""ggml's tensor types: id, name, values per block and bytes per block.

The runtime reads GGUF headers and plans with these sizes; it does not import gguf-py for them
(gguf-py pulls yaml, numpy.ma and more: several MiB of anonymous memory in every process that loads a
model, which matters where the budget is tight). The table mirrors ggml's ``ggml_type`` enum and
``type_traits`` (blck_size, type_size); tests/test_ggml_types.py checks it against gguf-py's
``GGML_QUANT_SIZES`` entry by entry, and the converter (which writes GGUFs) keeps using gguf-py.

A row of ``n`` values of type ``t`` takes ``n // block(t) * block_bytes(t)`` bytes; ``n`` must be a
multiple of ``block(t)``.
"""

from __future__ import annotations

from typing import NamedTuple


class GGMLType(NamedTuple):
    name: str
    block: int  # values per block
    block_bytes: int  # bytes per block


#: ggml_type id -> (name, values per block, bytes per block)
GGML_TYPES: dict[int, GGMLType] = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 18),
    3: GGMLType("Q4_1", 32, 20),
    6: GGMLType("Q5_0", 32, 22),
    7: GGMLType("Q5_1", 32, 24),
    8: GGMLType("Q8_0", 32, 34),
    9: GGMLType("Q8_1", 32, 40),
    10: GGMLType("Q2_K", 256, 84),
    11: GGMLType("Q3_K", 256, 110),
    12: GGMLType("Q4_K", 256, 144),
    13: GGMLType("Q5_K", 256, 176),
    14: GGMLType("Q6_K", 256, 210),
    15: GGMLType("Q8_K", 256, 292),
    16: GGMLType("IQ2_XXS", 256, 66),
    17: GGMLType("IQ2_XS", 256, 74),
    18: GGMLType("IQ3_XXS", 256, 98),
    19: GGMLType("IQ1_S", 256, 50),
    20: GGMLType("IQ4_NL", 32, 18),
    21: GGMLType("IQ3_S", 256, 110),
    22: GGMLType("IQ2_S", 256, 82),
    23: GGMLType("IQ4_XS", 256, 136),
    24: GGMLType("I8", 1, 1),
    25: GGMLType("I16", 1, 2),
    26: GGMLType("I32", 1, 4),
    27: GGMLType("I64", 1, 8),
    28: GGMLType("F64", 1, 8),
    29: GGMLType("IQ1_M", 256, 56),
    30: GGMLType("BF16", 1, 2),
    34: GGMLType("TQ1_0", 256, 54),
    35: GGMLType("TQ2_0", 256, 66),
    39: GGMLType("MXFP4", 32, 17),
    40: GGMLType("NVFP4", 64, 36),
    41: GGMLType("Q1_0", 128, 18),
}

_BY_NAME = {t.name: i for i, t in GGML_TYPES.items()}

F32 = _BY_NAME["F32"]
F16 = _BY_NAME["F16"]
Q8_0 = _BY_NAME["Q8_0"]
Q2_K = _BY_NAME["Q2_K"]
I8 = _BY_NAME["I8"]
I32 = _BY_NAME["I32"]


def ggml_type(type_id: int) -> GGMLType:
    """The type with id ``type_id``; ValueError naming the id when ggml has no such type."""
    t = GGML_TYPES.get(int(type_id))
    if t is None:
        raise ValueError(f"unknown ggml type {type_id}")
    return t


def type_name(type_id: int) -> str:
    """ggml's name of the type (``Q4_K``), or ``type <id>`` for an id ggml does not have."""
    t = GGML_TYPES.get(int(type_id))
    return t.name if t is not None else f"type {type_id}"


def type_id(name: str) -> int:
    """The id of the type named ``name`` (``"Q8_0"``); ValueError for an unknown name."""
    try:
        return _BY_NAME[name.upper()]
    except KeyError:
        raise ValueError(f"unknown ggml type '{name}'") from None


def row_bytes(type_id: int, n: int) -> int:
    """Bytes of ``n`` values of the type; ValueError unless ``n`` is a whole number of blocks."""
    t = ggml_type(type_id)
    if n % t.block:
        raise ValueError(f"{n} elements is not a multiple of the block size {t.block} of ggml type {t.name}")
    return n // t.block * t.block_bytes
