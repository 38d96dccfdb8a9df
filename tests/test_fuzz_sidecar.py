"""A quick deterministic fuzz run of the readers: a few hundred corrupted copies of a synthetic
model's sidecar and base file, each read the way ``Llama()`` reads them before llama.cpp starts
(``validate_pair`` for a sidecar, which includes ``read_sidecar`` as ``llamaflash inspect`` runs
it; ``read_base_model`` for a base file).

Every case must end in one of two ways, within a deadline (no hang):

* a ``LlamaflashError`` (the readers' deliberate, user-facing errors), or
* a result identical to the clean file's in everything that decides where and how the engine
  reads weights: format, activation, n_embd, base identity, bundle order, and per layer every
  offset, size, type, stride and width (base file: every served
  layer's gate/up/down location, type and shape, n_layer, n_embd, architecture).

Any other exception (numpy, struct, KeyError, MemoryError...) is a failure. The per-layer float
values (thresholds, measured sparsity, FFN errors) are left out
of the comparison: a flip inside one of them that keeps it within its checked range (finite,
non-negative, a fraction, bracketed by the threshold table) is a value corruption, like a flip in
the tensor data. Data-byte flips are run too: the bytes of weights and statistics are structurally
valid whatever their value, so the readers refuse such a flip only where they check data (the neuron
order must be a permutation). The rows the engine computes with are covered by the sidecar's row
checksums instead: every flip inside them (sidecar bundles and down_t, the checksum tables, the base
model's FFN gate/up/down) must be caught by the integrity check (``integrity_summary``: what
``llamaflash verify`` and loading the pair run), and a few are loaded through ``Llama()`` in memory,
which must refuse them with SidecarIntegrityError.

The readers are pure Python (no native code runs before llama.cpp starts), so a crash of the
process is not possible here and every case runs in-process, under a SIGALRM deadline.

Cases (seeded, so every run is the same): header bit flips at random positions before the data
section; truncations at random sizes (header and data); targeted edits of every sidecar tensor's
info (offset moved by one alignment unit, pointed at another tensor, row count doubled, type
changed); order edits (two entries swapped, a duplicate entry, a full shuffle); huge or zero
counts (block count, array lengths, tensor and key counts). The generators live in
``fuzz_cases.py``, shared with the long run in subprocesses (``scripts/fuzz_long.py``).
"""

from __future__ import annotations

from pathlib import Path

import fuzz_cases as cases
import numpy as np
import pytest
from fuzz_cases import Case, base_summary, deadline, sidecar_summary

from llamaflash.errors import LlamaflashError
from llamaflash.files.gguf_header import read_gguf_header

SEED = 0
CASE_DEADLINE_S = 10


class Fuzzer:
    """Runs cases against one clean file: each case's bytes are written to ``target`` (then its
    edit applied), and ``read(target)`` must raise a LlamaflashError or equal the clean summary."""

    def __init__(self, clean: Path, target: Path, read) -> None:
        self.clean, self.data = clean, clean.read_bytes()
        self.target, self.read = target, read
        self.target.write_bytes(self.data)
        self.data_offset = read_gguf_header(target).data_offset
        self.expected = read(target)
        self.failures: list[str] = []
        self.refused = self.accepted = 0

    def run(self, case: Case) -> None:
        self.target.write_bytes(case.apply(self.data))
        try:
            with deadline(CASE_DEADLINE_S):
                if case.edit is not None:
                    case.edit(self.target)
                result = self.read(self.target)
        except LlamaflashError:
            self.refused += 1
            return
        except BaseException as exc:  # noqa: BLE001 - every other outcome is a failure
            self.failures.append(f"{case.label}: {type(exc).__name__}: {exc}")
            return
        if result != self.expected:
            self.failures.append(f"{case.label}: accepted with a different structure")
        else:
            self.accepted += 1

    def run_all(self, generated) -> None:
        for case in generated:
            self.run(case)

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
    f, rng = sidecar_fuzzer, np.random.default_rng(SEED)
    f.run_all(cases.header_flips(f.data, f.data_offset, 200, rng))
    f.run_all(cases.truncations(f.data, f.data_offset, 40, rng))
    assert_clean(f, 230)


def test_sidecar_targeted_edits(sidecar_fuzzer):
    f = sidecar_fuzzer
    f.run_all(cases.tensor_info_edits(f.clean))
    f.run_all(cases.order_edits(f.clean))
    f.run_all(cases.count_edits())
    assert_clean(f, 80)


def test_base_header_flips_truncations_and_counts(base_fuzzer):
    f, rng = base_fuzzer, np.random.default_rng(SEED + 1)
    f.run_all(cases.header_flips(f.data, f.data_offset, 120, rng))
    f.run_all(cases.truncations(f.data, f.data_offset, 20, rng))
    f.run_all(cases.block_count_edits(f.clean, f.data))
    assert_clean(f, 140)


def test_sidecar_data_flips_are_refused_or_leave_the_structure(sidecar_fuzzer):
    f, rng = sidecar_fuzzer, np.random.default_rng(SEED + 2)
    f.run_all(cases.data_flips(f.data, f.data_offset, 300, rng))
    print(f.report())
    assert not f.failures, "\n".join(f.failures[:20])
    assert f.refused + f.accepted == 300


def test_data_flips_in_checked_rows_are_caught_by_the_checksums(clean_pair, tmp_path):
    """0 silent acceptances: every flip inside a checksummed row is an integrity error."""
    model, sidecar = clean_pair
    ranges = cases.checked_ranges(model, sidecar)
    rng = np.random.default_rng(SEED + 3)
    side_copy, base_copy = tmp_path / sidecar.name, tmp_path / model.name
    base_copy.write_bytes(model.read_bytes())
    f = Fuzzer(sidecar, side_copy, lambda path: cases.integrity_summary(base_copy, path))
    f.run_all(cases.checked_flips(f.data, ranges["sidecar"], 150, rng))
    f.run_all(cases.data_flips(f.data, f.data_offset, 100, rng, ranges["sidecar"]))  # anywhere: some unchecked
    side_copy.write_bytes(sidecar.read_bytes())
    g = Fuzzer(model, base_copy, lambda path: cases.integrity_summary(path, side_copy))
    g.run_all(cases.checked_flips(g.data, ranges["base"], 100, rng))
    print(f.report(), "|", g.report())
    for fuzzer in (f, g):
        assert not fuzzer.failures, "\n".join(fuzzer.failures[:20])
    assert g.refused == 100 and f.refused >= 150  # every checked flip; unchecked ones may pass


@pytest.mark.parametrize("target", ["sidecar", "base"])
def test_checked_data_flips_through_llama_are_refused(clean_pair, tmp_path, target):
    """In memory (the sparse lane reads bundles, down_t, base up; the dense lane base down): a flip in
    any checked row that lane reads is refused at load, before a token is computed."""
    import llamaflash
    from llamaflash.errors import SidecarIntegrityError

    model, sidecar = clean_pair
    m, s = tmp_path / model.name, tmp_path / sidecar.name
    info = cases.validate_pair(model, sidecar)
    lay = info.layers[-1]
    rows = {
        "sidecar": [
            (lay.bundle_offset, lay.n_ff * lay.bundle_stride),
            (lay.down_t_offset, lay.n_ff * lay.down_t_row_bytes),
        ],
        "base": [
            (lay.base_up_offset, lay.n_ff * lay.up_row_bytes),
            (lay.base_down_offset, lay.n_embd * lay.base_down_row_bytes),
        ],
    }[target]
    rng = np.random.default_rng(SEED + 4)
    for start, length in rows:
        for _ in range(3):
            pos, bit = start + int(rng.integers(0, length)), int(rng.integers(0, 8))
            m.write_bytes(model.read_bytes())
            s.write_bytes(sidecar.read_bytes())
            path = s if target == "sidecar" else m
            data = bytearray(path.read_bytes())
            data[pos] ^= 1 << bit
            path.write_bytes(bytes(data))
            with pytest.raises(SidecarIntegrityError, match="row"):
                llamaflash.Llama(model_path=str(m), sidecar_path=str(s), flash_mode="sparse", n_ctx=64, verbose=False)
