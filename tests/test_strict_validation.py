"""Strict structure checks of what llamaflash reads, before llama.cpp starts.

Reference for the GGUF structure: llama.cpp's own reader (``gguf_init_from_file``) refuses a file
whose tensor offsets are not the running offsets (each the previous tensor's offset plus its size
padded to the alignment, in header order), with duplicate tensor names, or with more than 4
dimensions; llamaflash must refuse at least those files, earlier and naming the tensor. Sidecar
value rules are those of ``docs/SIDECAR.md`` ("Validation"). Every case edits a copy of a clean,
freshly converted file (the clean copy itself is read first, as control) and expects a
``LlamaflashError`` that names the file, the key or tensor, and a way out. Counts (block count,
array lengths, tensor count) are corrupted to huge values to show that no loop follows them: each
such read must finish within a short deadline.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner
from fuzz_cases import deadline, edit_tensor_info, relative_offsets
from synth import write_unsupported_architecture

import llamaflash
from llamaflash.cli.cli import EXIT_LLAMAFLASH_ERROR, main
from llamaflash.converters import convert
from llamaflash.errors import BaseModelError, SidecarFormatError
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_header import GGUFHeaderError, read_gguf_header
from llamaflash.files.gguf_model import read_base_model
from llamaflash.files.sidecar import read_sidecar, validate_pair

BLOCK_COUNT_KEY = "llama.block_count"


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def set_scalar(path: Path, key: str, value) -> None:
    """Overwrite the scalar metadata ``key`` of GGUF ``path`` in place (its stored type kept)."""
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    reader.data.flush()


def set_array_entry(path: Path, key: str, index: int, value) -> None:
    """Overwrite entry ``index`` of the numeric metadata array ``key`` in place."""
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields[key]
    field.parts[field.data[index]][0] = value
    reader.data.flush()


def set_array_count(path: Path, key: str, count: int) -> None:
    """Overwrite the declared length of the metadata array ``key`` (parts: key length, key,
    value type, element type, count, ...)."""
    reader = gguf.GGUFReader(path, "r+")
    reader.fields[key].parts[4][0] = count
    reader.data.flush()


def write_floats(path: Path, offset: int, index: int, value: float) -> None:
    """Overwrite float32 number ``index`` of the data at absolute ``offset``."""
    with open(path, "r+b") as f:
        f.seek(offset + 4 * index)
        f.write(np.float32(value).tobytes())


@pytest.fixture
def pair(clean_pair, tmp_path) -> tuple[Path, Path]:
    """A private copy of the clean pair, checked to read cleanly before a test edits it."""
    model, sidecar = (tmp_path / p.name for p in clean_pair)
    for src, dst in zip(clean_pair, (model, sidecar)):
        shutil.copyfile(src, dst)
    validate_pair(model, sidecar)
    return model, sidecar


@pytest.fixture
def llama_must_not_start(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError("llama.cpp was started although the input is bad")

    monkeypatch.setattr(llama_cpp.Llama, "__init__", refuse)


def assert_refused_everywhere(model: Path, sidecar: Path, *fragments: str) -> None:
    """read_sidecar, validate_pair, ``llamaflash inspect`` and ``Llama()`` all refuse the sidecar with
    a SidecarFormatError naming it, each of ``fragments`` and the ways out."""
    with pytest.raises(SidecarFormatError) as exc:
        read_sidecar(sidecar)
    message = str(exc.value)
    assert str(sidecar) in message and "--force" in message and "copy it again" in message, message
    for fragment in fragments:
        assert fragment in message, message
    with pytest.raises(SidecarFormatError):
        validate_pair(model, sidecar)
    result = CliRunner().invoke(main, ["inspect", str(sidecar)])
    assert result.exit_code == EXIT_LLAMAFLASH_ERROR, result.output
    assert all(fragment in result.output for fragment in fragments), result.output
    with pytest.raises(SidecarFormatError):
        llamaflash.Llama(model_path=str(model), sidecar_path=str(sidecar), verbose=False)


# --------------------------------------------------------------------------------------
# the base model: counts bounded by the tensors present
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [0xFFFFFFFF, 2 ^ 0xFF000000, 3, 1, 0],
    ids=["all-ones", "top-byte-flipped", "one-too-many", "one-too-few", "zero"],
)
def test_implausible_block_count_is_refused_at_once(tiny_llama_q8_0, tmp_path, value, llama_must_not_start):
    # the tiny model has blocks 0 and 1: a larger count has no tensors behind it, a smaller one leaves
    # tensors llama.cpp would refuse as unused
    model = tmp_path / "model.gguf"
    shutil.copyfile(tiny_llama_q8_0, model)
    set_scalar(model, BLOCK_COUNT_KEY, value)
    with deadline(5):
        with pytest.raises(BaseModelError) as exc:
            read_base_model(model)
        for fragment in (str(model), BLOCK_COUNT_KEY, str(value), "blocks 0..1", "copy the model again"):
            assert fragment in str(exc.value)
        with pytest.raises(BaseModelError, match=BLOCK_COUNT_KEY):
            llamaflash.Llama(model_path=str(model), verbose=False)
        with pytest.raises(BaseModelError, match=BLOCK_COUNT_KEY):
            convert(model, progress=False, profile=False)
    assert not (tmp_path / "model.flash.gguf").exists()


def test_block_count_of_an_unserved_architecture_is_bounded_by_its_tensors(tmp_path):
    model = write_unsupported_architecture(tmp_path / "mamba.gguf")
    assert read_base_model(model).n_layer == 1
    set_scalar(model, "mamba.block_count", 0xFFFFFFFF)
    with deadline(5), pytest.raises(BaseModelError, match="only 2 tensors"):
        read_base_model(model)


def test_huge_string_array_and_tensor_counts_are_refused_at_once(tiny_llama_f32, tmp_path):
    tokens = tmp_path / "tokens.gguf"
    shutil.copyfile(tiny_llama_f32, tokens)
    set_array_count(tokens, "tokenizer.ggml.tokens", 1 << 60)
    with deadline(5), pytest.raises(GGUFHeaderError, match="string array"):
        read_gguf_header(tokens)

    counts = tmp_path / "counts.gguf"
    shutil.copyfile(tiny_llama_f32, counts)
    with open(counts, "r+b") as f:  # tensor count: u64 at byte 8
        f.seek(8)
        f.write((0xFF << 56 | 40).to_bytes(8, "little"))
    with deadline(5), pytest.raises(BaseModelError, match="declares"):
        read_base_model(counts)


def test_base_tensor_structure_is_checked_like_llama_cpp(tiny_llama_f32, tmp_path):
    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copyfile(tiny_llama_f32, dst)
        return dst

    offsets = relative_offsets(tiny_llama_f32)
    shifted = copy("shifted.gguf")  # the data of blk.1.ffn_up moved by one alignment unit
    edit_tensor_info(shifted, "blk.1.ffn_up.weight", offset=offsets["blk.1.ffn_up.weight"] + 32)
    with pytest.raises(BaseModelError, match=r"'blk\.1\.ffn_up\.weight' has data offset \d+, expected \d+"):
        read_base_model(shifted)

    overflow = copy("overflow.gguf")  # 2**32 · 2**32 elements: a 64-bit product would wrap to 0
    edit_tensor_info(overflow, "blk.0.ffn_gate.weight", dims=[1 << 32, 1 << 32])
    with pytest.raises(BaseModelError, match="over 2\\*\\*63 elements"):
        read_base_model(overflow)

    twice = copy("twice.gguf")
    edit_tensor_info(twice, "blk.0.ffn_up.weight", new_name="blk.1.ffn_up.weight")
    with pytest.raises(BaseModelError, match=r"'blk\.1\.ffn_up\.weight' appears twice"):
        read_base_model(twice)


# --------------------------------------------------------------------------------------
# the sidecar: structure
# --------------------------------------------------------------------------------------


def test_moved_tensor_data_is_refused(pair, llama_must_not_start):
    model, sidecar = pair
    offsets = relative_offsets(sidecar)
    edit_tensor_info(sidecar, "blk.1.ffn_down_t", offset=offsets["blk.1.ffn_down_t"] + 4096)
    assert_refused_everywhere(model, sidecar, "'blk.1.ffn_down_t' has data offset")


def test_swapped_tensor_offsets_are_refused(pair, llama_must_not_start):
    model, sidecar = pair
    offsets = relative_offsets(sidecar)
    a, b = fmt.bundle_tensor_name(0), fmt.bundle_tensor_name(1)
    edit_tensor_info(sidecar, a, offset=offsets[b])
    edit_tensor_info(sidecar, b, offset=offsets[a])
    assert_refused_everywhere(model, sidecar, f"'{a}' has data offset {offsets[b]}, expected {offsets[a]}")


def test_aliased_tensor_data_is_refused(pair, llama_must_not_start):
    model, sidecar = pair
    offsets = relative_offsets(sidecar)
    edit_tensor_info(sidecar, "blk.1.ffn_down_t", offset=offsets["blk.1.ffn_bundle"])
    assert_refused_everywhere(model, sidecar, "'blk.1.ffn_down_t' has data offset", "overlap or alias")


@pytest.mark.parametrize("edit", ["rows", "type"])
def test_shape_or_type_that_changes_the_size_is_refused(pair, edit, llama_must_not_start):
    # the next tensor's offset no longer follows from this tensor's size (or, at the last tensor,
    # the reader's shape check names it)
    model, sidecar = pair
    name = fmt.down_t_tensor_name(0)
    t = next(t for t in read_gguf_header(sidecar).tensors if t.name == name)
    if edit == "rows":
        edit_tensor_info(sidecar, name, dims=[t.shape[0], t.shape[1] * 2])
    else:
        edit_tensor_info(sidecar, name, ggml_type=int(gguf.GGMLQuantizationType.F32))
    assert_refused_everywhere(model, sidecar, "has data offset")


# --------------------------------------------------------------------------------------
# the sidecar: values
# --------------------------------------------------------------------------------------


def test_shuffled_order_in_a_base_order_file_is_refused(pair, llama_must_not_start):
    model, sidecar = pair
    lay = read_sidecar(sidecar).layers[1]
    order = np.random.default_rng(0).permutation(lay.n_ff).astype("<i4")
    with open(sidecar, "r+b") as f:
        f.seek(lay.order_offset)
        f.write(order.tobytes())
    assert_refused_everywhere(model, sidecar, "'blk.1.ffn_order' must be the identity", "'base'")


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, 1e30])
def test_threshold_that_is_not_a_calibrated_value_is_refused(pair, value, llama_must_not_start):
    # the file's threshold table brackets every layer's threshold (the target is one of its
    # levels, so the bracket is the entry itself): 1e30 is finite but far outside it
    model, sidecar = pair
    set_array_entry(sidecar, fmt.KEY_THRESHOLDS, 1, value)
    assert_refused_everywhere(model, sidecar, "layer 1", "threshold")


def test_threshold_table_entries_are_checked(pair, llama_must_not_start):
    model, sidecar = pair
    info = read_sidecar(sidecar)
    n = len(info.sparsity.threshold_levels)
    set_array_entry(sidecar, fmt.KEY_THRESHOLD_TABLE, n + 1, float("inf"))
    assert_refused_everywhere(model, sidecar, fmt.KEY_THRESHOLD_TABLE, "inf")

    row = info.layers[1].threshold_table
    set_array_entry(sidecar, fmt.KEY_THRESHOLD_TABLE, n + 1, row[0] / 2)  # below the lower level's
    assert_refused_everywhere(model, sidecar, "layer 1", "decreases")


@pytest.mark.parametrize(
    "key, value",
    [(fmt.KEY_SPARSITY_REACHED, 1.5), (fmt.KEY_SPARSITY_REACHED, float("nan")), (fmt.KEY_FFN_REL_ERROR, float("inf"))],
)
def test_per_layer_measurements_are_range_checked(pair, key, value, llama_must_not_start):
    model, sidecar = pair
    set_array_entry(sidecar, key, 0, value)
    assert_refused_everywhere(model, sidecar, "layer 0", key)


@pytest.mark.parametrize("which, value", [("freq", 2.0), ("freq", float("nan")), ("mag", -1.0), ("mag", float("inf"))])
def test_neuron_statistics_are_range_checked(pair, which, value, llama_must_not_start):
    model, sidecar = pair
    lay = read_sidecar(sidecar).layers[0]
    write_floats(sidecar, lay.freq_offset if which == "freq" else lay.mag_offset, 7, value)
    assert_refused_everywhere(model, sidecar, f"'blk.0.ffn_{which}' entry 7")


@pytest.mark.parametrize("key", [fmt.KEY_N_EMBD, fmt.KEY_N_FF])
def test_zero_widths_are_refused(pair, key, llama_must_not_start):
    model, sidecar = pair
    if key == fmt.KEY_N_EMBD:
        set_scalar(sidecar, key, 0)
    else:
        set_array_entry(sidecar, key, 0, 0)
    assert_refused_everywhere(model, sidecar, key, "expected at least 1")
