"""The sidecar format: base-model inspection, round trip of the layout, and refusal of bad
or mismatched sidecars.

Every byte comparison reads files with plain ``open``/``seek``/``read`` at the absolute
offsets the code reports, so offsets are checked independently of gguf-py.

Tolerance of the stored transposed down (``ffn_down_t``): Q8_0 stores, per block of 32
values, d = amax/127 as f16 and q = round(x/d); the reconstruction error is at most
d/2 + 127·d·2⁻¹¹ < 0.57·amax/127 per element of that block. F16 (n_embd not a multiple of
32) is within a relative 2⁻¹¹ of the value.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from fuzz_cases import set_uint_metadata
from synth import FAST_CONVERT, truncate, write_not_gguf, write_unsupported_architecture

from llamaflash.converters import convert
from llamaflash.converters.bundle import BundleStage
from llamaflash.converters.pipeline import plan_sidecar
from llamaflash.converters.writer import write_sidecar_atomically
from llamaflash.errors import (
    BaseModelError,
    BaseModelNotFoundError,
    SidecarFormatError,
    SidecarMismatchError,
    SidecarNotFoundError,
    SidecarVersionError,
)
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_model import base_identity, read_base_model, require_supported
from llamaflash.files.sidecar import LayerLayout, default_sidecar_path, read_sidecar, validate_pair

Q8_0_BLOCK = 32


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def read_at(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(n)
    assert len(data) == n, f"{path}: short read at {offset}"
    return data


def copy_model(model: Path, directory: Path) -> Path:
    dst = directory / model.name
    shutil.copyfile(model, dst)
    return dst


def converted(model: Path, directory: Path, **settings) -> tuple[Path, Path]:
    """A private copy of ``model`` in ``directory`` and its freshly converted sidecar
    (fast synthetic calibration, see conftest.FAST_CONVERT, unless ``settings`` say otherwise)."""
    local = copy_model(model, directory)
    return local, convert(local, progress=False, **{**FAST_CONVERT, **settings})


def stored_order(sidecar: Path, lay: LayerLayout) -> np.ndarray:
    return np.frombuffer(read_at(sidecar, lay.order_offset, 4 * lay.n_ff), dtype="<i4")


def assert_layer_round_trips(model: Path, sidecar: Path, lay: LayerLayout) -> None:
    """Bundle rows are the exact base gate/up rows in stored order, padding is zero,
    down_t is the transposed base down within the requantization tolerance."""
    order = stored_order(sidecar, lay)
    assert sorted(order.tolist()) == list(range(lay.n_ff))
    g, u, stride = lay.gate_row_bytes, lay.up_row_bytes, lay.bundle_stride
    bundle = read_at(sidecar, lay.bundle_offset, lay.n_ff * stride)
    for k, neuron in enumerate(order):
        row = bundle[k * stride : (k + 1) * stride]
        assert row[:g] == read_at(model, lay.base_gate_offset + int(neuron) * g, g)
        assert row[g : g + u] == read_at(model, lay.base_up_offset + int(neuron) * u, u)
        assert row[g + u :] == bytes(stride - g - u)

    base_raw = np.frombuffer(
        read_at(model, lay.base_down_offset, lay.n_embd * lay.base_down_row_bytes), dtype=np.uint8
    ).reshape(lay.n_embd, lay.base_down_row_bytes)
    expected = gguf.quants.dequantize(base_raw, gguf.GGMLQuantizationType(lay.base_down_type))
    expected = expected.reshape(lay.n_embd, lay.n_ff).T[order]
    stored_raw = np.frombuffer(
        read_at(sidecar, lay.down_t_offset, lay.n_ff * lay.down_t_row_bytes), dtype=np.uint8
    ).reshape(lay.n_ff, lay.down_t_row_bytes)
    stored = gguf.quants.dequantize(stored_raw, gguf.GGMLQuantizationType(lay.down_t_type))
    stored = stored.reshape(lay.n_ff, lay.n_embd)
    if lay.down_t_type == gguf.GGMLQuantizationType.Q8_0:
        blocks = expected.reshape(lay.n_ff, lay.n_embd // Q8_0_BLOCK, Q8_0_BLOCK)
        bound = 0.57 * np.abs(blocks).max(axis=-1, keepdims=True) / 127 + 1e-12
        err = np.abs(stored.reshape(blocks.shape) - blocks)
        assert np.all(err <= bound)
    elif lay.down_t_type == gguf.GGMLQuantizationType.Q4_K:  # the default where 256 divides n_embd
        # 4-bit codes over each 32-value sub-block's [min, max]: within one step (range / 15) of the
        # base value, the 6-bit sub-block scale and min rounding included
        sub = expected.reshape(lay.n_ff, lay.n_embd // 32, 32)
        step = (sub.max(axis=-1, keepdims=True) - np.minimum(sub.min(axis=-1, keepdims=True), 0)) / 15
        assert np.all(np.abs(stored.reshape(sub.shape) - sub) <= step + 1e-6)
    else:
        assert lay.down_t_type == gguf.GGMLQuantizationType.F16
        np.testing.assert_allclose(stored, expected, rtol=2.0**-11, atol=1e-7)


# --------------------------------------------------------------------------------------
# base model inspection
# --------------------------------------------------------------------------------------


def test_read_base_model_reports_ffn_tensors_at_absolute_offsets(tiny_llama_q8_0):
    info = read_base_model(tiny_llama_q8_0)
    assert (info.architecture, info.n_layer, info.n_embd) == ("llama", 2, 64)
    assert info.name == "tiny-llama-synth-Q8_0"
    assert info.activation == fmt.ACTIVATION_SILU
    assert info.file_size == tiny_llama_q8_0.stat().st_size
    assert [f.layer for f in info.ffn_layers] == [0, 1]
    reader = gguf.GGUFReader(tiny_llama_q8_0)
    by_name = {t.name: t for t in reader.tensors}
    for ffn in info.ffn_layers:
        assert (ffn.n_embd, ffn.n_ff) == (64, 128)
        assert ffn.gate.shape == (64, 128) and ffn.down.shape == (128, 64)
        assert ffn.gate.row_bytes == 64 // 32 * 34 and ffn.down.row_bytes == 128 // 32 * 34
        for loc in (ffn.gate, ffn.up, ffn.down):
            assert loc.ggml_type == gguf.GGMLQuantizationType.Q8_0
            assert loc.nbytes == loc.n_rows * loc.row_bytes
            assert read_at(tiny_llama_q8_0, loc.offset, loc.nbytes) == by_name[loc.name].data.tobytes()
    assert [g.name for g in info.gate_tensors] == [fmt.base_ffn_gate_name(i) for i in range(2)]


def test_base_identity_is_stable_and_covers_header_size_and_gate_data(tiny_llama_f32, tmp_path):
    model = copy_model(tiny_llama_f32, tmp_path)
    identity = base_identity(model)
    assert identity == base_identity(model) == base_identity(tiny_llama_f32)
    assert len(identity) == 64 and int(identity, 16) >= 0

    info = read_base_model(model)
    gate = info.gate_tensors[1]
    with open(model, "r+b") as f:  # flip one byte inside the hashed prefix of a gate tensor
        f.seek(gate.offset + 100)
        byte = f.read(1)
        f.seek(gate.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert base_identity(model) != identity

    (tmp_path / "grown").mkdir()
    grown = copy_model(tiny_llama_f32, tmp_path / "grown")
    with open(grown, "ab") as f:
        f.write(b"\0")
    assert base_identity(grown) != identity


def test_unsupported_architecture_is_described_then_refused(tmp_path):
    path = write_unsupported_architecture(tmp_path / "ssm.gguf", arch="mamba")
    info = read_base_model(path)
    assert info.architecture == "mamba" and info.ffn_layers == [] and not info.is_supported
    with pytest.raises(BaseModelError) as exc:
        require_supported(info)
    message = str(exc.value)
    assert str(path) in message and "mamba" in message
    for arch in fmt.SUPPORTED_BASE_ARCHITECTURES:
        assert arch in message


def test_bad_base_models_are_refused_with_the_file_named(tiny_llama_f32, tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(BaseModelNotFoundError) as exc:
        read_base_model(missing)
    assert isinstance(exc.value, FileNotFoundError) and str(missing) in str(exc.value)

    text = write_not_gguf(tmp_path / "text.gguf")
    with pytest.raises(BaseModelError, match="not a GGUF") as exc:
        read_base_model(text)
    assert str(text) in str(exc.value)

    cut = truncate(copy_model(tiny_llama_f32, tmp_path), tiny_llama_f32.stat().st_size - 5000)
    with pytest.raises(BaseModelError, match="truncated") as exc:
        read_base_model(cut)
    assert str(cut) in str(exc.value)


# --------------------------------------------------------------------------------------
# round trip
# --------------------------------------------------------------------------------------

ROUND_TRIP_SPECS = [
    pytest.param(dict(weight_type="F32"), id="F32"),
    pytest.param(dict(weight_type="F16"), id="F16"),
    pytest.param(dict(weight_type="Q8_0"), id="Q8_0"),
    pytest.param(dict(weight_type="Q4_0"), id="Q4_0"),
    pytest.param(dict(weight_type="Q4_1"), id="Q4_1"),
    pytest.param(dict(weight_type="Q5_0"), id="Q5_0"),
    pytest.param(dict(weight_type="Q4_K_M", n_embd=256, n_ff=512), id="Q4_K_M"),
    pytest.param(dict(weight_type="Q6_K", n_embd=256, n_ff=512), id="Q6_K"),
    # n_embd not a multiple of 32: down_t is stored as F16
    pytest.param(dict(weight_type="F32", n_embd=48, n_ff=80, n_head=4, n_head_kv=2), id="F32-n_embd48"),
]


@pytest.mark.parametrize("params", ROUND_TRIP_SPECS)
def test_round_trip_is_exact_for_gate_up_and_within_tolerance_for_down(tiny_model_factory, tmp_path, params):
    model, sidecar = converted(tiny_model_factory(**params), tmp_path)
    info = validate_pair(model, sidecar)
    base = read_base_model(model)
    assert info.format_version == fmt.FORMAT_VERSION
    assert info.base_identity == base_identity(model)
    assert (info.base_arch, info.base_name, info.base_file_size) == ("llama", base.name, base.file_size)
    assert info.activation == fmt.ACTIVATION_SILU and info.n_embd == base.n_embd
    assert [lay.layer for lay in info.layers] == [f.layer for f in base.ffn_layers]
    for lay, ffn in zip(info.layers, base.ffn_layers):
        assert lay.is_resolved
        assert (lay.gate_type, lay.up_type, lay.base_down_type) == (
            ffn.gate.ggml_type,
            ffn.up.ggml_type,
            ffn.down.ggml_type,
        )
        assert (lay.base_gate_offset, lay.base_up_offset, lay.base_down_offset) == (
            ffn.gate.offset,
            ffn.up.offset,
            ffn.down.offset,
        )
        gate_block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(lay.gate_type)][1]
        up_block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(lay.up_type)][1]
        assert lay.bundle_stride % gate_block == 0 and lay.bundle_stride % up_block == 0
        assert lay.gate_row_bytes + lay.up_row_bytes <= lay.bundle_stride
        assert lay.bundle_stride - math.lcm(gate_block, up_block) < lay.gate_row_bytes + lay.up_row_bytes
        expected_down_t = "Q4_K" if lay.n_embd % 256 == 0 else "Q8_0" if lay.n_embd % 32 == 0 else "F16"
        assert gguf.GGMLQuantizationType(lay.down_t_type).name == expected_down_t
        for offset in (lay.bundle_offset, lay.down_t_offset, lay.order_offset):
            assert offset % fmt.SIDECAR_ALIGNMENT == 0
        assert stored_order(sidecar, lay).tolist() == list(range(lay.n_ff))  # default: base order
        assert_layer_round_trips(model, sidecar, lay)


@pytest.mark.parametrize("params", [ROUND_TRIP_SPECS[2], ROUND_TRIP_SPECS[6]])
def test_hot_first_conversion_round_trips(tiny_model_factory, tmp_path, params):
    model, sidecar = converted(tiny_model_factory(**params), tmp_path, order="hot")
    info = validate_pair(model, sidecar)
    assert info.sparsity.bundle_order == "hot"
    for lay in info.layers:
        order = stored_order(sidecar, lay)  # a permutation (the reader checks), hot first
        freq = np.fromfile(sidecar, dtype="<f4", count=lay.n_ff, offset=lay.freq_offset)
        assert np.all(np.diff(freq) <= 0)
        assert order.tolist() != list(range(lay.n_ff))
        assert_layer_round_trips(model, sidecar, lay)


def test_round_trip_honours_a_non_identity_order(tiny_llama_q8_0, tmp_path):
    model = copy_model(tiny_llama_q8_0, tmp_path)
    base = read_base_model(model)
    rng = np.random.default_rng(7)
    orders = {0: rng.permutation(128), 1: np.arange(128)[::-1]}
    plan = plan_sidecar(base, base_identity(model), [BundleStage(orders)])
    sidecar = write_sidecar_atomically(plan, default_sidecar_path(model))
    info = validate_pair(model, sidecar)
    for lay in info.layers:
        assert stored_order(sidecar, lay).tolist() == list(orders[lay.layer])
        assert_layer_round_trips(model, sidecar, lay)


def test_layout_dicts_carry_every_field_once_resolved(tiny_llama_q8_0, tmp_path):
    model, sidecar = converted(tiny_llama_q8_0, tmp_path)
    alone = read_sidecar(sidecar)
    assert not alone.layers[0].is_resolved
    with pytest.raises(ValueError, match="validate_pair"):
        alone.layers[0].to_dict()
    d = validate_pair(model, sidecar).layers[0].to_dict()
    for key in (
        "layer",
        "n_embd",
        "n_ff",
        "gate_type",
        "up_type",
        "gate_row_bytes",
        "up_row_bytes",
        "bundle_offset",
        "bundle_stride",
        "down_t_type",
        "down_t_offset",
        "down_t_row_bytes",
        "order_offset",
        "base_gate_offset",
        "base_up_offset",
        "base_down_offset",
        "base_down_type",
        "base_down_row_bytes",
    ):
        assert isinstance(d[key], int), key


def test_sidecar_metadata_follows_format_v1(tiny_llama_q8_0, tmp_path):
    _, sidecar = converted(tiny_llama_q8_0, tmp_path)
    reader = gguf.GGUFReader(sidecar)
    f = reader.fields
    assert f[fmt.GENERAL_ARCHITECTURE].contents() == fmt.SIDECAR_ARCHITECTURE
    assert f[fmt.GENERAL_ALIGNMENT].contents() == fmt.SIDECAR_ALIGNMENT
    assert f[fmt.KEY_FORMAT_VERSION].types == [gguf.GGUFValueType.UINT32]
    assert f[fmt.KEY_BASE_FILE_SIZE].types == [gguf.GGUFValueType.UINT64]
    assert f[fmt.KEY_LAYERS].contents() == [0, 1]
    for key in fmt.PER_LAYER_ARRAY_KEYS:
        assert f[key].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32], key
        assert len(f[key].contents()) == 2
    names = {t.name: t for t in reader.tensors}
    bundle = names[fmt.bundle_tensor_name(0)]
    assert bundle.tensor_type == gguf.GGMLQuantizationType.I8
    assert bundle.shape.tolist() == [f[fmt.KEY_BUNDLE_STRIDES].contents()[0], 128]  # ggml ne order
    assert names[fmt.order_tensor_name(1)].tensor_type == gguf.GGMLQuantizationType.I32
    assert names[fmt.down_t_tensor_name(1)].shape.tolist() == [64, 128]


# --------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------


def test_sidecar_of_another_model_is_refused_naming_both_files(tiny_model_factory, tmp_path):
    model_a, sidecar_a = converted(tiny_model_factory(weight_type="Q8_0", seed=1), tmp_path)
    (tmp_path / "b").mkdir()
    model_b = copy_model(tiny_model_factory(weight_type="Q8_0", seed=2), tmp_path / "b")
    with pytest.raises(SidecarMismatchError) as exc:
        validate_pair(model_b, sidecar_a)
    message = str(exc.value)
    assert str(model_b) in message and str(sidecar_a) in message
    assert "llamaflash convert" in message and "--force" in message


def test_unknown_format_version_is_refused(tiny_llama_q8_0, tmp_path):
    model, sidecar = converted(tiny_llama_q8_0, tmp_path)
    set_uint_metadata(sidecar, fmt.KEY_FORMAT_VERSION, 99)
    with pytest.raises(SidecarVersionError) as exc:
        validate_pair(model, sidecar)
    message = str(exc.value)
    assert str(sidecar) in message and "99" in message
    assert "version 1" in message and f"llamaflash convert {model} --force" in message
    assert "upgrade llamaflash" in message  # 99 is newer than anything this reader knows


def test_base_model_given_as_sidecar_is_refused(tiny_llama_q8_0, tmp_path):
    with pytest.raises(SidecarFormatError, match="not a llamaflash sidecar") as exc:
        read_sidecar(tiny_llama_q8_0)
    assert str(tiny_llama_q8_0) in str(exc.value)


def test_missing_not_gguf_and_truncated_sidecars_are_refused(tiny_llama_q8_0, tmp_path):
    model, sidecar = converted(tiny_llama_q8_0, tmp_path)

    missing = tmp_path / "other.flash.gguf"
    with pytest.raises(SidecarNotFoundError) as exc:
        validate_pair(model, missing)
    assert isinstance(exc.value, FileNotFoundError)
    assert f"`llamaflash convert {model} -o {missing}`" in str(exc.value)

    text = write_not_gguf(tmp_path / "text.flash.gguf")
    with pytest.raises(SidecarFormatError, match="not a GGUF") as exc:
        read_sidecar(text)
    assert str(text) in str(exc.value)

    truncate(sidecar, sidecar.stat().st_size - 5000)
    with pytest.raises(SidecarFormatError, match="truncated") as exc:
        validate_pair(model, sidecar)
    assert str(sidecar) in str(exc.value) and "--force" in str(exc.value)


def test_order_that_is_not_a_permutation_is_refused(tiny_llama_q8_0, tmp_path):
    _, sidecar = converted(tiny_llama_q8_0, tmp_path)
    reader = gguf.GGUFReader(sidecar, "r+")
    order = next(t for t in reader.tensors if t.name == fmt.order_tensor_name(1))
    order.data[5] = order.data[6]
    reader.data.flush()
    del reader, order
    with pytest.raises(SidecarFormatError, match="permutation"):
        read_sidecar(sidecar)
