"""A quick deterministic fuzz run of the readers: a few hundred corrupted copies of a synthetic
model's sidecar and base file, each read the way ``Llama()`` reads them before llama.cpp starts
(``validate_pair`` for a sidecar, which includes ``read_sidecar`` as ``llamaflash inspect`` runs
it; ``read_base_model`` for a base file).

Every case must end in one of two ways, within a deadline (no hang):

* a ``LlamaflashError`` (the readers' deliberate, user-facing errors), or
* a result identical to the clean file's in everything that decides where and how the engine
  reads weights: format, activation, n_embd, base identity, bundle order, and per layer every
  offset, size, type, stride, width, selection and predictor rank (base file: every served
  layer's gate/up/down location, type and shape, n_layer, n_embd, architecture).

Any other exception (numpy, struct, KeyError, MemoryError...) is a failure. The per-layer float
values (thresholds, measured sparsity, predictor thresholds and quality, FFN errors) are left out
of the comparison: a flip inside one of them that keeps it within its checked range (finite,
non-negative, a fraction, bracketed by the threshold table) is a value corruption, like a flip in
the tensor data. Data-byte flips are not part of this run: the bytes of weights and statistics
are structurally valid whatever their value, so only checksums of the data (not written by this
format version) could catch them.

The readers are pure Python (no native code runs before llama.cpp starts), so a crash of the
process is not possible here and every case runs in-process, under a SIGALRM deadline.

Cases (seeded, so every run is the same): header bit flips at random positions before the data
section; truncations at random sizes (header and data); targeted edits of every sidecar tensor's
info (offset moved by one alignment unit, pointed at another tensor, row count doubled, type
changed); order edits (two entries swapped, a duplicate entry, a full shuffle); huge or zero
counts (block count, array lengths, tensor and key counts).
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from llamaflash import sidecar_format as fmt
from llamaflash.errors import LlamaflashError
from llamaflash.gguf_header import read_gguf_header
from llamaflash.gguf_model import read_base_model
from llamaflash.sidecar import read_sidecar, validate_pair
from test_strict_validation import clean_pair, deadline, edit_tensor_info, relative_offsets  # noqa: F401

SEED = 0
CASE_DEADLINE_S = 10
#: LayerLayout fields holding measured or calibrated values, not structure (see module docstring).
VALUE_FIELDS = frozenset({"threshold", "sparsity", "pred_threshold", "pred_recall", "pred_precision",
                          "ffn_rel_error", "threshold_table"})


def sidecar_summary(model: Path, sidecar: Path) -> tuple:
    info = validate_pair(model, sidecar)
    layers = tuple(tuple(sorted((k, v) for k, v in lay.to_dict().items() if k not in VALUE_FIELDS))
                   for lay in info.layers)
    order = info.sparsity.bundle_order if info.sparsity else None
    return info.format_version, info.activation, info.n_embd, info.base_identity, order, layers


def base_summary(model: Path) -> tuple:
    info = read_base_model(model)
    layers = tuple((f.layer, f.gate, f.up, f.down) for f in info.ffn_layers)
    return info.architecture, info.n_layer, info.n_embd, info.activation, layers


class Fuzzer:
    """Runs cases against one clean file: ``data`` (the clean bytes) is mutated, written to ``target``,
    and ``read(target)`` must raise a LlamaflashError or equal the clean summary."""

    def __init__(self, clean: Path, target: Path, read) -> None:
        self.clean, self.data = clean, clean.read_bytes()
        self.target, self.read = target, read
        self.target.write_bytes(self.data)
        self.data_offset = read_gguf_header(target).data_offset
        self.expected = read(target)
        self.failures: list[str] = []
        self.refused = self.accepted = 0

    def run(self, label: str, data: bytes | None = None, edit=None) -> None:
        self.target.write_bytes(self.data if data is None else data)
        try:
            with deadline(CASE_DEADLINE_S):
                if edit is not None:
                    edit(self.target)
                result = self.read(self.target)
        except LlamaflashError:
            self.refused += 1
            return
        except BaseException as exc:  # noqa: BLE001 - every other outcome is a failure
            self.failures.append(f"{label}: {type(exc).__name__}: {exc}")
            return
        if result != self.expected:
            self.failures.append(f"{label}: accepted with a different structure")
        else:
            self.accepted += 1

    def header_flips(self, n: int, rng: np.random.Generator) -> None:
        data_offset = self.data_offset
        for pos, bit in zip(rng.integers(0, data_offset, n), rng.integers(0, 8, n)):
            mutated = bytearray(self.data)
            mutated[pos] ^= 1 << int(bit)
            self.run(f"flip byte {pos} bit {bit}", bytes(mutated))

    def truncations(self, n: int, rng: np.random.Generator) -> None:
        data_offset = self.data_offset
        sizes = {0, 3, 4, 8, 24, data_offset - 1, data_offset, len(self.data) - 1}
        sizes |= {int(s) for s in rng.integers(0, data_offset, n // 2)}
        sizes |= {int(s) for s in rng.integers(data_offset, len(self.data), n - n // 2)}
        for size in sorted(sizes):
            self.run(f"truncate to {size}", self.data[:size])

    def report(self) -> str:
        return f"{self.refused} refused, {self.accepted} accepted unchanged, {len(self.failures)} failures"


@pytest.fixture
def sidecar_fuzzer(clean_pair, tmp_path) -> Fuzzer:
    model, sidecar = clean_pair
    return Fuzzer(sidecar, tmp_path / sidecar.name, lambda path: sidecar_summary(model, path))


@pytest.fixture
def base_fuzzer(clean_pair, tmp_path) -> Fuzzer:
    model, _ = clean_pair
    return Fuzzer(model, tmp_path / model.name, base_summary)


def assert_clean(fuzzer: Fuzzer, min_cases: int) -> None:
    print(fuzzer.report())  # shown with pytest -s
    assert not fuzzer.failures, "\n".join(fuzzer.failures[:20]) + "\n" + fuzzer.report()
    assert fuzzer.refused + fuzzer.accepted >= min_cases, fuzzer.report()
    assert fuzzer.refused > 0  # the run reached the checks at all


def test_sidecar_header_flips_and_truncations(sidecar_fuzzer):
    rng = np.random.default_rng(SEED)
    sidecar_fuzzer.header_flips(200, rng)
    sidecar_fuzzer.truncations(40, rng)
    assert_clean(sidecar_fuzzer, 230)


def test_sidecar_targeted_edits(sidecar_fuzzer):
    f = sidecar_fuzzer
    offsets = relative_offsets(f.clean)
    header = read_gguf_header(f.clean)
    names = sorted(offsets)
    for i, name in enumerate(names):
        t = next(t for t in header.tensors if t.name == name)
        other = names[(i + 1) % len(names)]
        f.run(f"{name} offset +4096", edit=lambda p, n=name: edit_tensor_info(p, n, offset=offsets[n] + 4096))
        f.run(f"{name} offset -4096", edit=lambda p, n=name: edit_tensor_info(p, n, offset=max(0, offsets[n] - 4096)))
        f.run(f"{name} aliases {other}", edit=lambda p, n=name, o=other: edit_tensor_info(p, n, offset=offsets[o]))
        doubled = [t.shape[0]] + [2 * d for d in t.shape[1:]] if len(t.shape) > 1 else [2 * t.shape[0]]
        f.run(f"{name} doubled", edit=lambda p, n=name, d=doubled: edit_tensor_info(p, n, dims=d))
        for new_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I8, 255):
            f.run(f"{name} type {int(new_type)}",
                  edit=lambda p, n=name, ty=int(new_type): edit_tensor_info(p, n, ggml_type=ty))

    info = read_sidecar(f.clean)
    for lay in info.layers:
        n = lay.n_ff
        for label, order in (("swap", np.r_[1, 0, 2:n]), ("duplicate", np.r_[0, 0, 2:n]),
                             ("shuffle", np.random.default_rng(lay.layer).permutation(n))):
            mutated = bytearray(f.data)
            mutated[lay.order_offset:lay.order_offset + 4 * n] = order.astype("<i4").tobytes()
            f.run(f"layer {lay.layer} order {label}", bytes(mutated))

    # counts: the u64 tensor and key counts of the header, each made huge
    for pos in (8, 16):
        for value in (1 << 63, 0xFFFFFFFF, 0):
            mutated = bytearray(f.data)
            mutated[pos:pos + 8] = struct.pack("<Q", value)
            f.run(f"count at {pos} = {value}", bytes(mutated))
    assert_clean(f, 80)


def test_base_header_flips_truncations_and_counts(base_fuzzer):
    f = base_fuzzer
    rng = np.random.default_rng(SEED + 1)
    f.header_flips(120, rng)
    f.truncations(20, rng)
    reader = gguf.GGUFReader(f.clean)
    field = reader.fields["llama.block_count"]
    pos = int(field.offset) + sum(int(p.nbytes) for p in field.parts[:field.data[0]])
    del reader, field
    value = struct.unpack_from("<I", f.data, pos)[0]
    for new in (0xFFFFFFFF, value ^ 0xFF000000, value + 1, 0, 1):
        mutated = bytearray(f.data)
        mutated[pos:pos + 4] = struct.pack("<I", new)
        f.run(f"block_count = {new}", bytes(mutated))
    assert_clean(f, 140)
