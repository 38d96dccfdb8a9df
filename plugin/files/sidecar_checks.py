"""Typed, checked access to a sidecar's metadata and tensors, for :mod:`llamaflash.files.sidecar`.

Everything a sidecar declares is untrusted until checked here: every failure raises
:class:`~llamaflash.errors.SidecarFormatError` naming the file, the key or tensor, what is wrong
and the way out (re-create the sidecar, or copy it again). The GGUF structure itself (running
tensor offsets, no overlap, data inside the file, sizes from shapes and types) is checked by
:mod:`llamaflash.files.gguf_header` before anything here runs.

Value rules (``docs/SIDECAR.md``, "Validation"):

* ``n_embd`` and every ``n_ff`` are at least 1;
* ``ffn_order`` is a permutation of ``0 .. n_ff-1``, and the identity in a format-2 file whose
  ``llamaflash.bundle_order`` is ``base``;
* thresholds (per layer and of the threshold table) are finite and >= 0; with a threshold table,
  each layer's row does not decrease with the level and the layer's threshold lies between the
  row's entries at the levels around the sparsity target; the sparsity reached lies in [0, 1];
  the FFN relative errors are finite and >= 0;
* the retired selection and predictor arrays and tensors of older files are not read, so not
  checked (``sidecar_format.KEY_SELECTION``);
* ``ffn_freq`` entries are fractions in [0, 1], ``ffn_mag`` entries finite and >= 0.

Without a threshold table a threshold has no upper bound the stored statistics define (it is a
quantile of |act(gate·x)| over calibration inputs, which the file does not hold): only finiteness
and sign are checked then.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NoReturn

import numpy as np

from llamaflash.errors import SidecarFormatError
from llamaflash.files import ggml_types
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_header import UNSIGNED_TYPES, MetadataValue, TensorInfo, ValueType


class Fields:
    """Typed access to a sidecar's metadata, failing with :class:`SidecarFormatError`
    (``"{path}: malformed sidecar: {problem}. {hint}"``)."""

    def __init__(self, metadata: dict[str, MetadataValue], path: Path, hint: str) -> None:
        self._metadata = metadata
        self.path = path
        self._hint = hint

    def fail(self, problem: str) -> NoReturn:
        raise SidecarFormatError(f"{self.path}: malformed sidecar: {problem}. {self._hint}")

    def _get(self, key: str) -> MetadataValue:
        f = self._metadata.get(key)
        if f is None:
            self.fail(f"metadata key '{key}' is missing")
        return f

    def optional_string(self, key: str) -> str | None:
        return self.string(key) if key in self._metadata else None

    def string(self, key: str) -> str:
        f = self._get(key)
        if f.type != ValueType.STRING:
            self.fail(f"metadata key '{key}' is not a string")
        return f.value

    def uint(self, key: str) -> int:
        f = self._get(key)
        if f.type not in UNSIGNED_TYPES:
            self.fail(f"metadata key '{key}' is not an unsigned integer")
        return int(f.value)

    def positive_uint(self, key: str) -> int:
        value = self.uint(key)
        if value < 1:
            self.fail(f"metadata key '{key}' is {value}, expected at least 1")
        return value

    def has(self, key: str) -> bool:
        return key in self._metadata

    def real(self, key: str) -> float:
        f = self._get(key)
        if f.type not in (ValueType.FLOAT32, ValueType.FLOAT64):
            self.fail(f"metadata key '{key}' is not a float")
        return float(f.value)

    def float_array(self, key: str, length: int | None = None) -> list[float]:
        f = self._get(key)
        if f.type != ValueType.ARRAY or f.element_type not in (ValueType.FLOAT32, ValueType.FLOAT64):
            self.fail(f"metadata key '{key}' is not an array of floats")
        values = [float(v) for v in f.value]
        if length is not None and len(values) != length:
            self.fail(f"metadata key '{key}' has {len(values)} entries, expected {length}")
        return values

    def uint_array(self, key: str, length: int | None = None) -> list[int]:
        f = self._get(key)
        if f.type != ValueType.ARRAY or f.element_type not in UNSIGNED_TYPES:
            self.fail(f"metadata key '{key}' is not an array of unsigned integers")
        values = [int(v) for v in f.value]
        if length is not None and len(values) != length:
            self.fail(f"metadata key '{key}' has {len(values)} entries, expected {length}")
        return values


def block_bytes(ggml_type: int) -> int:
    """Bytes of one block of ``ggml_type``."""
    return ggml_types.ggml_type(ggml_type).block_bytes


def tensor(
    fields: Fields, tensors: dict[str, TensorInfo], name: str, ggml_type: int, shape: tuple[int, ...]
) -> TensorInfo:
    """The tensor ``name``, checked for type, ggml shape and alignment (the header reader has
    checked its offset, size and that its data lies inside the file)."""
    t = tensors.get(name)
    if t is None:
        fields.fail(f"tensor '{name}' is missing")
    if t.ggml_type != ggml_type:
        fields.fail(f"tensor '{name}' has ggml type {t.ggml_type}, expected {ggml_type}")
    if t.shape != shape:
        fields.fail(f"tensor '{name}' has ggml shape {list(t.shape)}, expected {list(shape)}")
    if t.offset % fmt.SIDECAR_ALIGNMENT:
        fields.fail(f"tensor '{name}' data at offset {t.offset} is not {fmt.SIDECAR_ALIGNMENT}-aligned")
    return t


def check_order(fields: Fields, t: TensorInfo, layer: int, n_ff: int, identity: bool) -> None:
    """Read ``ffn_order`` (tensor ``t``) and check it: a permutation of ``0 .. n_ff-1``, and the
    identity when ``identity`` (a base-order format-2 file)."""
    values = np.fromfile(fields.path, dtype="<i4", count=n_ff, offset=t.offset)
    if len(values) != n_ff:  # the file shrank since its header was read
        fields.fail(f"tensor '{t.name}': only {len(values)} of its {n_ff} entries could be read")
    if not np.array_equal(np.sort(values), np.arange(n_ff)):
        fields.fail(f"layer {layer}: '{t.name}' is not a permutation of 0..{n_ff - 1}")
    if identity and not np.array_equal(values, np.arange(n_ff)):
        k = int(np.flatnonzero(values != np.arange(n_ff))[0])
        fields.fail(
            f"layer {layer}: '{t.name}' must be the identity in a file whose "
            f"'{fmt.KEY_BUNDLE_ORDER}' is '{fmt.BUNDLE_ORDER_BASE}', but entry {k} is {values[k]}"
        )


def _nonnegative(v: float) -> bool:
    return math.isfinite(v) and v >= 0.0


def _fraction(v: float) -> bool:
    return 0.0 <= v <= 1.0  # False for NaN


#: Per-layer float keys of format 2 and the rule each value obeys.
_LAYER_FLOAT_RULES = (
    (fmt.KEY_THRESHOLDS, _nonnegative, "a finite number >= 0"),
    (fmt.KEY_FFN_REL_ERROR, _nonnegative, "a finite number >= 0"),
    (fmt.KEY_SPARSITY_REACHED, _fraction, "a fraction in [0, 1]"),
)


def check_layer_floats(fields: Fields, layer: int, meta: dict) -> None:
    """The format-2 per-layer floats of ``layer`` (``meta``: key → this layer's value)."""
    for key, rule, what in _LAYER_FLOAT_RULES:
        if not rule(meta[key]):
            fields.fail(f"layer {layer}: '{key}' is {meta[key]}, expected {what}")


def check_threshold_levels(fields: Fields, levels: list[float]) -> None:
    """The optional threshold levels: at least one, increasing, each in (0, 1)."""
    if not levels or any(not 0.0 < v < 1.0 for v in levels) or any(b <= a for a, b in zip(levels, levels[1:])):
        fields.fail(f"'{fmt.KEY_THRESHOLD_LEVELS}' must be increasing levels in (0, 1): {levels}")


def check_threshold_table(
    fields: Fields,
    layer_ids: list[int],
    levels: list[float],
    table: list[float],
    thresholds: list[float],
    target: float,
) -> None:
    """The threshold table against itself and the layers' thresholds.

    Entries are finite and >= 0. Each layer's row is non-decreasing: the threshold at level s is
    the s-quantile of the same calibration sample, and a quantile function does not decrease.
    Each layer's operating threshold lies between the row's thresholds at the levels nearest to
    the sparsity target, below and above it (equal to the entry when the target is a level; from
    0 when the target is below the first level; unbounded above beyond the last level).
    """
    bad = [i for i, v in enumerate(table) if not _nonnegative(v)]
    if bad:
        fields.fail(f"'{fmt.KEY_THRESHOLD_TABLE}' entry {bad[0]} is {table[bad[0]]}, expected a finite threshold >= 0")
    n = len(levels)
    below = [i for i, v in enumerate(levels) if v <= target]
    above = [i for i, v in enumerate(levels) if v >= target]
    for row, layer in enumerate(layer_ids):
        entries = table[row * n : (row + 1) * n]
        if any(b < a for a, b in zip(entries, entries[1:])):
            fields.fail(
                f"layer {layer}: its '{fmt.KEY_THRESHOLD_TABLE}' row {entries} decreases; the "
                "threshold of a higher sparsity level cannot be lower"
            )
        low = entries[below[-1]] if below else 0.0
        high = entries[above[0]] if above else math.inf
        if not low <= thresholds[row] <= high:
            fields.fail(
                f"layer {layer}: threshold {thresholds[row]} is outside [{low}, {high}], the "
                f"thresholds its '{fmt.KEY_THRESHOLD_TABLE}' row holds around the sparsity target "
                f"{target}"
            )


def check_statistics(fields: Fields, layer: int, freq: TensorInfo, mag: TensorInfo, n_ff: int) -> None:
    """Read ``ffn_freq`` and ``ffn_mag`` of ``layer`` and check their values."""
    f = np.fromfile(fields.path, dtype="<f4", count=n_ff, offset=freq.offset)
    m = np.fromfile(fields.path, dtype="<f4", count=n_ff, offset=mag.offset)
    if len(f) != n_ff or len(m) != n_ff:
        fields.fail(f"layer {layer}: '{freq.name}' or '{mag.name}' could not be read whole")
    bad = np.flatnonzero(~((f >= 0.0) & (f <= 1.0)))
    if len(bad):
        fields.fail(f"tensor '{freq.name}' entry {int(bad[0])} is {f[bad[0]]}, expected a fraction in [0, 1]")
    bad = np.flatnonzero(~(np.isfinite(m) & (m >= 0.0)))
    if len(bad):
        fields.fail(f"tensor '{mag.name}' entry {int(bad[0])} is {m[bad[0]]}, expected a finite number >= 0")
