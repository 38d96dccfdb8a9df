"""llamaflash's table of ggml types against gguf-py's (ggml's sizes as the converter writes them)."""

from __future__ import annotations

import gguf
import pytest

from llamaflash.files import ggml_types


def test_table_matches_gguf_py_type_by_type():
    theirs = {int(t): (t.name, b, n) for t, (b, n) in gguf.GGML_QUANT_SIZES.items()}
    ours = {i: (t.name, t.block, t.block_bytes) for i, t in ggml_types.GGML_TYPES.items()}
    assert ours == theirs


def test_row_bytes_and_names():
    assert ggml_types.row_bytes(ggml_types.type_id("q4_k"), 512) == 2 * 144
    assert ggml_types.row_bytes(ggml_types.F32, 3) == 12
    assert ggml_types.type_name(ggml_types.Q8_0) == "Q8_0"
    assert ggml_types.type_name(1000) == "type 1000"
    with pytest.raises(ValueError, match="block size 256 of ggml type Q4_K"):
        ggml_types.row_bytes(12, 100)
    with pytest.raises(ValueError, match="unknown ggml type 1000"):
        ggml_types.ggml_type(1000)
    with pytest.raises(ValueError, match="unknown ggml type 'Q9_Z'"):
        ggml_types.type_id("Q9_Z")
