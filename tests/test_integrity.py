"""Row checksums (sidecar integrity section, csrc/io/crc32c.*, csrc/io/integrity.*, plugin/files/integrity.py): the
converter stores the CRC-32C of every row the engine reads; the engine checks them before computing
(in memory at load, offload on every flash read); `llamaflash verify` checks them offline. A flipped
byte in any checked row is an error naming the file, the tensor and the row, never a wrong output.
A file that shrinks or changes while in use is a FlashIoError at the next evaluation."""

from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import pytest
from click.testing import CliRunner
from offload_helpers import KW, C, make_plan

import llamaflash
from llamaflash import _native
from llamaflash.cli.cli import main
from llamaflash.converters import convert
from llamaflash.converters.bundle import BundleStage
from llamaflash.converters.pipeline import plan_sidecar
from llamaflash.converters.writer import write_sidecar_atomically
from llamaflash.errors import FlashIoError, SidecarIntegrityError
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_model import base_identity, read_base_model
from llamaflash.files.integrity import verify_files
from llamaflash.files.sidecar import read_sidecar, validate_pair


def crc32c_reference(data: bytes) -> int:
    """Bitwise CRC-32C (reflected 0x82F63B78, init and final XOR 0xFFFFFFFF): the definition."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_matches_its_definition_in_every_implementation():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, size=(37, 203), dtype=np.uint8)  # odd sizes: the byte tails too
    expected = [crc32c_reference(r.tobytes()) for r in rows]
    impls = ["auto", "table"] + (["hardware"] if _native.crc32c_implementation() == "sse4.2" else [])
    for impl in impls:
        assert list(_native.crc32c_rows(rows, 203, impl)) == expected, impl
    # rows of 192 bytes and more run in three lanes joined by a shift table per row size: every
    # remainder modulo 24 around the switch, and row sizes of real models (Q4_1 576, Q4_K 1536 ...)
    for size in list(range(180, 230)) + [360, 720, 864, 1536, 4097]:
        data = rng.integers(0, 256, size=(3, size), dtype=np.uint8)
        want = [crc32c_reference(r.tobytes()) for r in data]
        for impl in impls:
            assert list(_native.crc32c_rows(data, size, impl)) == want, (impl, size)
    assert _native.crc32c_rows(b"123456789", 9)[0] == 0xE3069283  # the published check value
    with pytest.raises(ValueError, match="whole number"):
        _native.crc32c_rows(b"12345", 2)


def test_crc32c_of_pieces_combines_to_the_whole():
    # the expert cache checks a slice as pieces on several threads, joined by crc32c_combine
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, size=884_736 + 13, dtype=np.uint8).tobytes()
    whole = int(_native.crc32c_rows(data, len(data))[0])
    for cut in (0, 1, 7, 191, 4096, 442_368, len(data) - 1, len(data)):
        a, b = data[:cut], data[cut:]
        crc_a = int(_native.crc32c_rows(a, len(a))[0]) if a else 0
        crc_b = int(_native.crc32c_rows(b, len(b))[0]) if b else 0
        if not a:
            assert crc_b == whole
            continue
        assert _native.crc32c_combine(crc_a, crc_b, len(b)) == whole, cut
    small = b"123456789"
    pieces = [int(_native.crc32c_rows(small[i : i + 1], 1)[0]) for i in range(len(small))]
    crc = pieces[0]
    for p in pieces[1:]:
        crc = _native.crc32c_combine(crc, p, 1)
    assert crc == 0xE3069283


def test_the_converter_checksums_every_row_the_engine_reads(converted):
    model, sidecar = converted
    info = validate_pair(model, sidecar)
    assert info.format_version == fmt.INTEGRITY_FORMAT_VERSION and info.integrity == fmt.INTEGRITY_ALGORITHM
    for lay in info.layers:
        table = np.fromfile(sidecar, "<u4", lay.n_ff * 4, offset=lay.checksum_offset).reshape(lay.n_ff, 4)
        down = np.fromfile(sidecar, "<u4", lay.n_embd, offset=lay.down_checksum_offset)
        sets = [
            (sidecar, lay.bundle_offset, lay.bundle_stride, table[:, 0]),
            (sidecar, lay.down_t_offset, lay.down_t_row_bytes, table[:, 1]),
            (model, lay.base_gate_offset, lay.gate_row_bytes, table[:, 2]),
            (model, lay.base_up_offset, lay.up_row_bytes, table[:, 3]),
            (model, lay.base_down_offset, lay.base_down_row_bytes, down),
        ]
        for path, offset, row_bytes, expected in sets:
            data = path.read_bytes()
            for r in (0, 1, len(expected) - 1):
                row = data[offset + r * row_bytes : offset + (r + 1) * row_bytes]
                assert crc32c_reference(row) == expected[r]


def test_a_bundle_only_sidecar_carries_checksums_too(converted, tmp_path):
    model, _ = converted
    out = convert(model, tmp_path / "v1.flash.gguf", progress=False, profile=False)
    info = read_sidecar(out)
    assert info.format_version == 1 and info.integrity == fmt.INTEGRITY_ALGORITHM
    assert verify_files(out, model).ok


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _copies(converted, tmp_path):
    model, sidecar = converted
    m, s = tmp_path / "m.gguf", tmp_path / "m.flash.gguf"
    shutil.copy(model, m)
    shutil.copy(sidecar, s)
    return m, s, validate_pair(m, s).layers[1]


# (row set, the lane that reads it in memory, byte offset of the flip inside that row set)
FLIPS = [
    ("bundle", "dense", lambda lay: (lay.bundle_offset + 7 * lay.bundle_stride + 3, fmt.bundle_tensor_name(1), 7)),
    (
        "down_t",
        "sparse",
        lambda lay: (lay.down_t_offset + 40 * lay.down_t_row_bytes + 5, fmt.down_t_tensor_name(1), 40),
    ),
    ("base_up", "sparse", lambda lay: (lay.base_up_offset + 100 * lay.up_row_bytes + 9, fmt.base_ffn_up_name(1), 100)),
    (
        "base_down",
        "dense",
        lambda lay: (lay.base_down_offset + 2 * lay.base_down_row_bytes, fmt.base_ffn_down_name(1), 2),
    ),
]


@pytest.mark.parametrize("what,lane,where", FLIPS, ids=[f[0] for f in FLIPS])
def test_a_flipped_byte_in_memory_is_refused_at_load(converted, tmp_path, what, lane, where):
    m, s, lay = _copies(converted, tmp_path)
    offset, tensor, row = where(lay)
    _flip(m if what.startswith("base") else s, offset)
    with pytest.raises(SidecarIntegrityError) as e:
        llamaflash.Llama(model_path=str(m), sidecar_path=str(s), flash_mode=lane, **KW)
    msg = str(e.value)
    assert tensor in msg and f"row {row} " in msg and ("m.gguf" if what.startswith("base") else "m.flash.gguf") in msg
    assert ("copy" in msg) and (what.startswith("base") or "--force" in msg)
    # the measuring switch: the same files load unchecked
    llamaflash.Llama(model_path=str(m), sidecar_path=str(s), flash_mode=lane, flash_verify=False, **KW).close()
    # offline, `llamaflash verify` names the same row
    result = CliRunner().invoke(main, ["verify", str(s), str(m)])
    assert result.exit_code == 1 and f"{tensor} row {row} " in result.output


@pytest.mark.parametrize("what", ["base_down", "base_up", "base_gate"])
def test_the_default_running_stock_refuses_a_damaged_base_model(converted, tmp_path, what):
    """The in-memory default runs stock (no stored measurement: llama.cpp reads the FFN weights, the
    engine does not); with a sidecar it still checks the base model's FFN rows at load."""
    m, s, lay = _copies(converted, tmp_path)
    # (rows past the gate's first 4096 bytes: those are part of the pair's identity, a mismatch there
    # is a SidecarMismatchError before any check)
    tensor, row_bytes, offset, row = {
        "base_down": (fmt.base_ffn_down_name(1), lay.base_down_row_bytes, lay.base_down_offset, 50),
        "base_up": (fmt.base_ffn_up_name(1), lay.up_row_bytes, lay.base_up_offset, 150),
        "base_gate": (fmt.base_ffn_gate_name(1), lay.gate_row_bytes, lay.base_gate_offset, 150),
    }[what]
    for k in range(8):  # 8 bytes of one row of layer 1
        _flip(m, offset + row * row_bytes + 2 * k)
    with pytest.raises(SidecarIntegrityError) as e:
        llamaflash.Llama(model_path=str(m), sidecar_path=str(s), **KW)
    msg = str(e.value)
    assert f"'{m}'" in msg and f"tensor {tensor} row {row} " in msg and "copy or download it again" in msg
    # the measuring switch: the same files load unchecked, as stock
    unchecked = llamaflash.Llama(model_path=str(m), sidecar_path=str(s), flash_verify=False, **KW)
    assert unchecked.flash_mode == "stock" and unchecked.flash_stats()["integrity"]["checked"] is False
    unchecked.close()


def test_the_default_running_stock_checks_every_base_ffn_row_at_load(converted):
    model, sidecar = converted
    llm = llamaflash.Llama(model_path=str(model), sidecar_path=str(sidecar), **KW)
    assert llm.flash_mode == "stock"
    checked = llm.flash_stats()["integrity"]
    info = read_sidecar(sidecar)
    base_ffn = sum(
        lay.n_ff * (lay.gate_row_bytes + lay.up_row_bytes) + lay.n_embd * lay.base_down_row_bytes for lay in info.layers
    )
    assert checked["checked"] is True and checked["load_verified_bytes"] == base_ffn
    assert checked["load_verify_seconds"] > 0
    llm.close()


def test_offload_checks_each_flash_read_before_its_cluster_is_used(converted, tmp_path, forced_plan):
    m, s, lay = _copies(converted, tmp_path)
    forced_plan(make_plan(s, 0, prefetch_layers=0))  # nothing pinned: every cluster read at decode
    clean = llamaflash.Llama(model_path=str(m), sidecar_path=str(s), ram_budget_mb=64, **KW)
    clean.eval(clean.tokenize(b"hello there"))
    clean.eval([int(np.argmax(clean.scores[clean.n_tokens - 1]))])
    stats = clean.flash_stats()["integrity"]
    assert stats["checked"] and stats["read_verified_bytes"] > 0 and stats["load_verified_bytes"] > 0
    # the waiting thread checks a layer's slots while later reads of the layer are in flight; what
    # arrives last (at least the layer's last slot) is checked by the threads computing it
    assert stats["read_clusters_checked_by_compute"] > 0
    clean.close()
    for row in range(lay.n_ff):  # every down_t row of layer 1 damaged: whatever the token needs
        _flip(s, lay.down_t_offset + row * lay.down_t_row_bytes)
    llm = llamaflash.Llama(model_path=str(m), sidecar_path=str(s), ram_budget_mb=64, **KW)
    with pytest.raises(SidecarIntegrityError, match=fmt.down_t_tensor_name(1)):
        llm.eval(llm.tokenize(b"hello there"))  # short batches run on the sparse lane (verify batches)
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    llm.close()


def test_a_cluster_checked_by_its_compute_thread_fails_the_eval_every_time(converted, tmp_path, forced_plan):
    # the layer's last demand read is checked by the thread that computes its cluster (nothing is left
    # in flight to overlap with): damage only that cluster's rows. The slot is dropped, so the next
    # eval reads and checks it again and fails again, never computing from it.
    m, s, lay = _copies(converted, tmp_path)
    last = (lay.n_ff - 1) // C
    for row in range(last * C, lay.n_ff):
        _flip(s, lay.down_t_offset + row * lay.down_t_row_bytes)
    forced_plan(make_plan(s, 0, prefetch_layers=0))
    llm = llamaflash.Llama(model_path=str(m), sidecar_path=str(s), ram_budget_mb=64, **KW)
    tokens = llm.tokenize(b"hello there")
    for _ in range(2):
        with pytest.raises(SidecarIntegrityError, match=fmt.down_t_tensor_name(1)) as e:
            llm.eval(tokens[:1])
        assert f"row {last * C} " in str(e.value)
        llm.reset()
    assert llm.flash_stats()["integrity"]["read_clusters_checked_by_compute"] > 0
    llm.close()


def test_offload_checks_pinned_clusters_at_load(converted, tmp_path, forced_plan):
    m, s, lay = _copies(converted, tmp_path)
    _flip(s, lay.down_t_offset + 3)
    forced_plan(make_plan(s, 6, prefetch_layers=1))  # everything pinned
    with pytest.raises(SidecarIntegrityError, match="row 0 "):
        llamaflash.Llama(model_path=str(m), sidecar_path=str(s), ram_budget_mb=64, **KW)


def test_a_sidecar_without_checksums_loads_with_a_warning(converted, tmp_path):
    model, _ = converted
    base = read_base_model(model)
    old = tmp_path / "old.flash.gguf"
    write_sidecar_atomically(plan_sidecar(base, base_identity(model, base), [BundleStage()]), old)
    assert read_sidecar(old).integrity is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = llamaflash.Llama(model_path=str(model), sidecar_path=str(old), flash_mode="dense", **KW)
    assert any("no checksums" in str(w.message) for w in caught)
    assert llm.flash_stats()["integrity"]["algorithm"] is None and not llm.flash_stats()["integrity"]["checked"]
    llm.close()
    result = CliRunner().invoke(main, ["verify", str(old)])
    assert result.exit_code == 1 and "no checksums" in result.output
    assert "checksums:        none" in CliRunner().invoke(main, ["inspect", str(old)]).output


def test_verify_command_reports_what_it_checked(converted):
    model, sidecar = converted
    result = CliRunner().invoke(main, ["verify", str(sidecar), str(model)])
    assert result.exit_code == 0, result.output
    for kind in ("ffn_bundle", "ffn_down_t", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
        assert kind in result.output
    assert "OK" in result.output
    alone = CliRunner().invoke(main, ["verify", str(sidecar)])
    assert alone.exit_code == 0 and "base model rows not checked" in alone.output


def test_flash_verify_must_be_a_bool(converted):
    model, _ = converted
    with pytest.raises(ValueError, match="flash_verify"):
        llamaflash.Llama(model_path=str(model), flash_mode="dense", flash_verify="yes", **KW)


@pytest.mark.parametrize("lane", ["dense", "sparse"])
def test_a_file_that_shrinks_in_use_is_a_flash_io_error_before_compute(converted, tmp_path, lane):
    """In memory the weights are mapped: a truncated file would be a SIGBUS when touched. The check
    before every evaluation turns it into FlashIoError first."""
    m, s, _ = _copies(converted, tmp_path)
    llm = llamaflash.Llama(model_path=str(m), sidecar_path=str(s), flash_mode=lane, **KW)
    llm.eval(llm.tokenize(b"hello"))
    os.truncate(s, os.path.getsize(s) // 2)
    with pytest.raises(FlashIoError, match="m.flash.gguf.*shrank"):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    llm.close()


@pytest.mark.parametrize("lane", ["dense", "sparse"])
def test_a_file_rewritten_in_place_is_checked_again_in_memory(converted, tmp_path, lane):
    """Same size, new modification time: the mapped rows are checked again before the evaluation. The
    same bytes pass (and the model goes on); a changed row is SidecarIntegrityError; without checks
    (flash_verify=False) the change itself is a FlashIoError."""
    m, s, lay = _copies(converted, tmp_path)
    llm = llamaflash.Llama(model_path=str(m), sidecar_path=str(s), flash_mode=lane, **KW)
    llm.eval(llm.tokenize(b"hello"))
    s.write_bytes(s.read_bytes())  # rewritten with the same bytes
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    # a row both lanes map in place here (plain weights: flash_batch_invariant): the bundles
    _flip(s, lay.bundle_offset + 11 * lay.bundle_stride + 2)
    with pytest.raises(SidecarIntegrityError, match=f"{fmt.bundle_tensor_name(1)} row 11 "):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    llm.close()
    unchecked = llamaflash.Llama(model_path=str(m), sidecar_path=str(s), flash_mode=lane, flash_verify=False, **KW)
    unchecked.eval(unchecked.tokenize(b"hello"))
    os.utime(s, ns=(0, 1))
    with pytest.raises(FlashIoError, match="m.flash.gguf.*modified"):
        unchecked.eval([1])
    unchecked.close()


@pytest.mark.parametrize("what", ["base_down", "base_gate"])
def test_offload_views_are_checked_at_every_split_that_reads_them(converted, tmp_path, forced_plan, what):
    """Offload drops the prefill views' pages (and a streamed gate's) after each split, so they come
    back from the file: each split checks them first. A row rewritten in place with its modification
    time put back (invisible to the per-evaluation stat) fails the next split that reads it."""
    m, s, lay = _copies(converted, tmp_path)
    forced_plan(make_plan(s, 0, prefetch_layers=1, stream_gate=True))
    llm = llamaflash.Llama(model_path=str(m), sidecar_path=str(s), ram_budget_mb=64, **KW)
    prompt = llm.tokenize(b"a prompt longer than any verify batch, for the dense lane")
    llm.eval(prompt)
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    st = os.stat(m)
    offset = (
        lay.base_down_offset + 5 * lay.base_down_row_bytes
        if what == "base_down"
        else lay.base_gate_offset + 9 * lay.gate_row_bytes
    )
    _flip(m, offset)
    os.utime(m, ns=(st.st_atime_ns, st.st_mtime_ns))
    name = fmt.base_ffn_down_name(1) if what == "base_down" else fmt.base_ffn_gate_name(1)
    with pytest.raises(SidecarIntegrityError, match=name):
        if what == "base_down":
            llm.reset()
            llm.eval(prompt)  # prefill: dense splits read the down view
        else:
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])  # decode: the streamed gate
    llm.close()


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_K_M"])
def test_whole_layers_check_each_flash_read_before_its_result_is_used(
    tiny_model_factory, tmp_path, forced_plan, weight_type
):
    """deterministic=True under a budget reads whole layers from flash (the layer stream, csrc/offload/
    layer_stream.h) and checks every row of each read before anything computed from it is used: K-quant
    rows by the products that multiply them (each block once multiplied, backend/matmul_rows.h
    CheckedWeight), Q8_0 rows (which ggml-cpu multiplies) before the layer is computed. A row rewritten
    in place (its modification time put back) fails every evaluation that reads it, naming the tensor
    and the row: the slot is dropped. (Four layers, two slots: every layer is read again for each
    token.)"""
    from synth import FAST_CONVERT

    m = tmp_path / "m.gguf"
    n_embd = 96 if weight_type == "Q8_0" else 256
    shutil.copy(tiny_model_factory(weight_type=weight_type, n_embd=n_embd, n_ff=2 * n_embd, n_layer=4), m)
    s = convert(m, progress=False, sparsity=0.5, measure_quality=False, **FAST_CONVERT)
    lay = validate_pair(m, s).layers[1]
    forced_plan(make_plan(s, 0, prefetch_layers=1, stream_gate=True))
    kw = dict(model_path=str(m), sidecar_path=str(s), ram_budget_mb=64, deterministic=True, **KW)
    llm = llamaflash.Llama(**kw)
    prompt = llm.tokenize(b"hello there")
    llm.eval(prompt)
    stats = llm.flash_stats()
    off = stats["offload"]
    assert off["whole_layers"] and off["hot_slots"] == 0 and off["misses"] + off["prefetched"] > 0
    assert stats["integrity"]["read_verified_bytes"] > 0 and stats["numerics"]["lossless"]
    # K-quant rows are checked while they are multiplied, Q8_0 rows before
    by_products = stats["integrity"]["read_verified_by_products_bytes"]
    assert by_products == (0 if weight_type == "Q8_0" else stats["integrity"]["read_verified_bytes"])
    assert (off["verify_seconds"] > 0) == (weight_type == "Q8_0")
    st = os.stat(m)
    _flip(m, lay.base_up_offset + 100 * lay.up_row_bytes + 9)
    os.utime(m, ns=(st.st_atime_ns, st.st_mtime_ns))
    for _ in range(2):
        llm.reset()
        with pytest.raises(SidecarIntegrityError, match=fmt.base_ffn_up_name(1)) as e:
            llm.eval(prompt)
        assert "row 100 " in str(e.value)
    llm.close()
