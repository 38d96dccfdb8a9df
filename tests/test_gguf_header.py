"""The fast GGUF header reader agrees with gguf-py's GGUFReader and refuses bad files."""

from __future__ import annotations

import shutil
import struct

import gguf
import pytest
from synth import truncate, vocabulary, write_not_gguf

from llamaflash.converters import convert
from llamaflash.files.gguf_header import GGUFHeaderError, ValueType, read_gguf_header


def assert_matches_gguf_py(path) -> None:
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    assert header.data_offset == reader.data_offset
    assert header.alignment == reader.alignment
    assert header.file_size == path.stat().st_size
    assert [(t.name, t.ggml_type, t.shape, t.offset, t.nbytes) for t in header.tensors] == [
        (t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ]
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = header.metadata[key]
        if value.type == ValueType.ARRAY and value.element_type == ValueType.STRING:
            assert value.value is None and value.count == len(field.data)
        elif value.type == ValueType.ARRAY:
            assert value.value.tolist() == field.contents(), key
        else:
            assert value.value == field.contents(), key


@pytest.mark.parametrize(
    "params",
    [
        dict(weight_type="F32"),
        dict(weight_type="Q8_0"),
        dict(weight_type="Q4_K_M", n_embd=256, n_ff=512),
    ],
    ids=["F32", "Q8_0", "Q4_K_M"],
)
def test_agrees_with_gguf_py_on_models(tiny_model_factory, params):
    assert_matches_gguf_py(tiny_model_factory(**params))


def test_agrees_with_gguf_py_on_a_sidecar(tiny_llama_q8_0, tmp_path):
    sidecar = convert(tiny_llama_q8_0, tmp_path / "m.flash.gguf", progress=False)
    assert_matches_gguf_py(sidecar)
    assert read_gguf_header(sidecar).alignment == 4096


def test_string_arrays_are_counted_not_decoded(tiny_llama_f32):
    tokens = read_gguf_header(tiny_llama_f32).metadata[gguf.Keys.Tokenizer.LIST]
    assert tokens.element_type == ValueType.STRING and tokens.count == len(vocabulary()[0])


def test_bad_files_are_classified(tiny_llama_f32, tmp_path):
    with pytest.raises(GGUFHeaderError) as exc:
        read_gguf_header(write_not_gguf(tmp_path / "text.gguf"))
    assert exc.value.kind == GGUFHeaderError.NOT_GGUF

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFHeaderError) as exc:
        read_gguf_header(empty)
    assert exc.value.kind == GGUFHeaderError.NOT_GGUF

    for size in (10, 3000, tiny_llama_f32.stat().st_size - 1):  # header cut / data cut
        cut = tmp_path / f"cut{size}.gguf"
        shutil.copyfile(tiny_llama_f32, cut)
        truncate(cut, size)
        with pytest.raises(GGUFHeaderError, match="truncated") as exc:
            read_gguf_header(cut)
        assert exc.value.kind == GGUFHeaderError.TRUNCATED

    future = tmp_path / "future.gguf"
    future.write_bytes(b"GGUF" + struct.pack("<IQQ", 99, 0, 0))
    with pytest.raises(GGUFHeaderError, match="version 99") as exc:
        read_gguf_header(future)
    assert exc.value.kind == GGUFHeaderError.UNSUPPORTED

    with pytest.raises(FileNotFoundError):
        read_gguf_header(tmp_path / "absent.gguf")
