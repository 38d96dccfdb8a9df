"""The sparse FFN decode kernel (csrc/lanes/sparse_ffn.h) against a NumPy reference.

Reference: weights dequantized with ``gguf.quants.dequantize``; x replaced by the activations the
kernel's row dots actually multiply with (``_native_testing.activation_roundtrip``: x quantized to the
weight type's vec_dot_type by ggml-cpu and decoded: Q8_0 / Q8_1 / Q8_K / F16 / F32), so the only
differences left are float rounding (the kernel sums in f32 in another order; the reference uses
float64). Tolerance: max |y - y_ref| <= RTOL * max |y_ref| with RTOL = 1e-5, except
  * gelu: 1e-3 (ggml's GEGLU rounds act(g) to f16; a g within float rounding of an f16 rounding
    boundary can round the other way in the f64 reference, an f16 ulp on that neuron);
  * Q4_1 / Q5_1 (vec_dot_type Q8_1): 2e-3 (the Q8_1 block sum used for the min term is stored as
    f16, so ggml's dot is not exactly the dot with the decoded activations).
Thresholds for the selection tests are placed in the middle of a wide gap between consecutive
|act(g)| values, so float rounding cannot move a neuron across them; the kernel's active mask must
then equal the reference's set exactly.
"""

from __future__ import annotations

import math
import shutil

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from llamaflash import _native
from llamaflash import _native_testing as N
from llamaflash.converters import convert
from llamaflash.files.sidecar import validate_pair

T = gguf.GGMLQuantizationType
BEST_ISA = N.sparse_ffn_best_isa()
ISAS = {"scalar": ["scalar"], "avx2": ["scalar", "avx2"], "avx512": ["scalar", "avx2", "avx512"]}[BEST_ISA]


# --------------------------------------------------------------------------------------------
# layer construction and reference


def _row_bytes(t: T, n: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[t]
    return n // block * size


def _q(a, t: T) -> np.ndarray:
    """float32 [rows, n] -> uint8 [rows, row_bytes] in ggml type t (K-quants by ggml's quantizer:
    gguf-py has none for them)."""
    if t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        return np.ascontiguousarray(_native.quantize_rows(int(t), np.ascontiguousarray(a, np.float32))).view(np.uint8)
    return np.ascontiguousarray(quantize(a, t)).view(np.uint8)


def _dq(b: np.ndarray, t: T) -> np.ndarray:
    """uint8 [rows, row_bytes] of ggml type t -> float64 [rows, n]."""
    b = np.ascontiguousarray(b)
    if t == T.F16:
        return b.view(np.float16).astype(np.float64)
    if t == T.F32:
        return b.view(np.float32).astype(np.float64)
    return dequantize(b, t).astype(np.float64)


class Layer:
    """One layer in sidecar bundle order, built from float matrices (rows = neurons)."""

    def __init__(self, gate, up, down_t, gate_type, up_type, down_t_type, activation, stride=None):
        self.n_ff, self.n_embd = gate.shape
        self.gate_type, self.up_type, self.down_t_type = gate_type, up_type, down_t_type
        self.activation = activation
        gq, uq, dq = _q(gate, gate_type), _q(up, up_type), _q(down_t, down_t_type)
        self.gate_row_bytes, self.up_row_bytes = gq.shape[1], uq.shape[1]
        if stride is None:  # the sidecar's rule: whole blocks of both types
            lcm = math.lcm(gguf.GGML_QUANT_SIZES[gate_type][1], gguf.GGML_QUANT_SIZES[up_type][1])
            stride = -(-(gq.shape[1] + uq.shape[1]) // lcm) * lcm
        self.bundle_stride = stride
        self.bundles = np.zeros((self.n_ff, stride), np.uint8)
        self.bundles[:, : gq.shape[1]] = gq
        self.bundles[:, gq.shape[1] : gq.shape[1] + uq.shape[1]] = uq
        self.down_t = np.ascontiguousarray(dq)
        self.down_t_row_bytes = dq.shape[1]
        self.G, self.U, self.D = _dq(gq, gate_type), _dq(uq, up_type), _dq(dq, down_t_type)

    @classmethod
    def from_bytes(
        cls, bundles, stride, gate_type, up_type, gate_row_bytes, up_row_bytes, down_t, down_t_type, n_embd, activation
    ):
        self = cls.__new__(cls)
        self.n_ff, self.n_embd = bundles.shape[0], n_embd
        self.gate_type, self.up_type, self.down_t_type = T(gate_type), T(up_type), T(down_t_type)
        self.activation = activation
        self.bundles, self.bundle_stride = bundles, stride
        self.gate_row_bytes, self.up_row_bytes = gate_row_bytes, up_row_bytes
        self.down_t, self.down_t_row_bytes = down_t, down_t.shape[1]
        self.G = _dq(bundles[:, :gate_row_bytes], self.gate_type)
        self.U = _dq(bundles[:, gate_row_bytes : gate_row_bytes + up_row_bytes], self.up_type)
        self.D = _dq(down_t, self.down_t_type)
        return self

    def run(self, x, threshold=0.0, n_threads=1, **kw):
        """The kernel's phases in the order the sparse lane runs them for these arguments (by cluster
        with gate_values and no up_values, else by range)."""
        return N.sparse_ffn_forward(
            self.bundles,
            self.bundle_stride,
            int(self.gate_type),
            int(self.up_type),
            self.gate_row_bytes,
            self.up_row_bytes,
            self.down_t,
            int(self.down_t_type),
            self.down_t_row_bytes,
            self.n_embd,
            self.n_ff,
            self.activation,
            x,
            threshold,
            n_threads,
            **kw,
        )

    def act_g_u(self, x):
        """Per token (g, act(g), u) as the kernel's dots see them, float64 [n_tokens, n_ff]."""
        xg = np.stack([N.activation_roundtrip(int(self.gate_type), r) for r in x]).astype(np.float64)
        xu = np.stack([N.activation_roundtrip(int(self.up_type), r) for r in x]).astype(np.float64)
        g, u = xg @ self.G.T, xu @ self.U.T
        return g, act_ref(self.activation, g), u

    def reference(self, x, selected):
        """y over the neurons in the boolean mask `selected` [n_tokens, n_ff]."""
        _, a, u = self.act_g_u(x)
        return (np.where(selected, a * u, 0.0)) @ self.D


def act_ref(name, g):
    if name == "silu":
        return g / (1.0 + np.exp(-g))
    if name == "relu":
        return np.maximum(g, 0.0)
    # ggml's GEGLU on CPU: f16 table of the tanh-approximation gelu, indexed by f16(g)
    v = g.astype(np.float16).astype(np.float32)
    c = np.float32(0.79788456080286535587989211986876)
    r = np.float32(0.5) * v * (np.float32(1) + np.tanh(c * v * (np.float32(1) + np.float32(0.044715) * v * v)))
    r = r.astype(np.float16).astype(np.float64)
    return np.where(g <= -10, 0.0, np.where(g >= 10, g, r))


def tol(layer):
    t = 1e-5
    if layer.activation == "gelu":
        t = 1e-3
    if layer.gate_type in (T.Q4_1, T.Q5_1) or layer.up_type in (T.Q4_1, T.Q5_1):
        t = max(t, 2e-3)
    return t


def assert_close(y, y_ref, rtol):
    scale = max(float(np.abs(y_ref).max()), 1e-30)
    err = float(np.abs(y.astype(np.float64) - y_ref).max()) / scale
    assert err <= rtol, f"max error {err:.3g} of max |y_ref| (tolerance {rtol})"


def random_layer(rng, n_embd, n_ff, gate_type, up_type, down_t_type, activation, relu_bias=0.0):
    gate = rng.standard_normal((n_ff, n_embd)).astype(np.float32) / np.sqrt(n_embd)
    if relu_bias:
        gate += np.float32(relu_bias) / n_embd  # shift half of the neurons negative for relu
    up = rng.standard_normal((n_ff, n_embd)).astype(np.float32) / np.sqrt(n_embd)
    down_t = rng.standard_normal((n_ff, n_embd)).astype(np.float32) / np.sqrt(n_ff)
    return Layer(gate, up, down_t, gate_type, up_type, down_t_type, activation)


def ggml_dense(gate, gate_type, up, up_type, down, down_type, n_embd, n_ff, activation, x, n_threads=1):
    """y of ggml's own dense FFN graph on the CPU backend (csrc/testing/ffn_dense_ref.h)."""
    graph = N.DenseFfnGraph(
        gate,
        int(gate_type),
        up,
        int(up_type),
        down,
        int(down_type),
        n_embd,
        n_ff,
        activation,
        n_tokens=x.shape[0],
        n_threads=n_threads,
    )
    y, seconds = graph.run(x)
    assert len(seconds) == 1 and seconds[0] > 0
    return y


def gap_threshold(values, keep_fraction):
    """A threshold between two consecutive sorted |act| values near the quantile, in the widest
    gap nearby, so that rounding cannot move a neuron across it."""
    v = np.sort(np.abs(values).ravel())
    k = int(len(v) * (1 - keep_fraction))
    lo, hi = max(k - 20, 1), min(k + 20, len(v) - 1)
    gaps = v[lo:hi] - v[lo - 1 : hi - 1]
    j = lo + int(np.argmax(gaps))
    assert v[j] - v[j - 1] > 1e-4 * v[-1], "no usable gap"
    return float((v[j] + v[j - 1]) / 2)


# (gate, up, down_t, activation, n_embd, n_ff)
VARIANTS = [
    (T.Q8_0, T.Q8_0, T.Q8_0, "silu", 128, 96),
    (T.Q4_0, T.Q4_0, T.F16, "silu", 96, 160),
    (T.Q4_0, T.Q8_0, T.Q8_0, "silu", 64, 128),  # mixed gate/up types: padded bundle stride
    (T.Q4_1, T.Q4_1, T.Q8_0, "gelu", 64, 100),  # vec_dot_type Q8_1
    (T.Q5_0, T.Q5_0, T.Q8_0, "relu", 96, 128),
    (T.F16, T.F16, T.F16, "gelu", 48, 64),  # n_embd % 32 != 0 -> F16 down_t with a SIMD tail
    (T.F32, T.F32, T.F16, "silu", 100, 70),
    (T.Q8_0, T.Q8_0, T.Q4_0, "silu", 64, 96),  # 4-bit down_t (converter --down-t-type q4_0/q4_1)
    (T.Q4_1, T.Q4_1, T.Q4_1, "gelu", 96, 64),
    (T.Q8_0, T.Q8_0, T.Q4_K, "silu", 256, 96),  # K-quant down_t (--down-t-type q4_k / base)
    (T.Q4_0, T.Q4_0, T.Q6_K, "silu", 512, 64),
    (T.Q4_K, T.Q2_K, T.Q2_K, "silu", 256, 96),  # the draft copy's up and down_t (--draft-type auto)
]


@pytest.mark.parametrize("gate_type,up_type,down_t_type,activation,n_embd,n_ff", VARIANTS)
def test_threshold_zero_matches_dense_formula(gate_type, up_type, down_t_type, activation, n_embd, n_ff):
    rng = np.random.default_rng(1)
    layer = random_layer(rng, n_embd, n_ff, gate_type, up_type, down_t_type, activation)
    x = rng.standard_normal((3, n_embd)).astype(np.float32)
    y, counts, mask = layer.run(x, 0.0, return_mask=True)
    _, a, _ = layer.act_g_u(x)
    assert_close(y, layer.reference(x, np.ones_like(a, bool)), tol(layer))  # the dense formula
    if activation != "relu":
        assert counts.tolist() == [n_ff] * 3
    assert mask.sum(axis=1).tolist() == counts.tolist()
    y_all, counts_all = layer.run(x, -1.0)  # negative threshold: every neuron
    assert_close(y_all, layer.reference(x, np.ones_like(a, bool)), tol(layer))
    assert counts_all.tolist() == [n_ff] * 3


@pytest.mark.parametrize("gate_type,down_t_type", [(T.Q8_0, T.Q8_0), (T.Q4_0, T.F16)])
def test_relu_skipping_zeros_is_exact(gate_type, down_t_type):
    rng = np.random.default_rng(2)
    layer = random_layer(rng, 128, 256, gate_type, gate_type, down_t_type, "relu")
    x = rng.standard_normal((4, 128)).astype(np.float32)
    y_sparse, counts, mask = layer.run(x, 0.0, return_mask=True)
    y_dense, counts_dense = layer.run(x, -1.0)
    g, _, _ = layer.act_g_u(x)
    assert counts_dense.tolist() == [256] * 4
    assert 0.3 * 256 < counts.min() and counts.max() < 0.7 * 256  # about half the neurons are zero
    clear = np.abs(g) > 1e-6 * np.abs(g).max()  # sign of g beyond float rounding
    np.testing.assert_array_equal(mask.astype(bool)[clear], (g > 0)[clear])
    assert mask.sum(axis=1).tolist() == counts.tolist()
    assert_close(y_sparse, y_dense.astype(np.float64), 1e-6)  # skipped neurons contribute exact zeros
    assert_close(y_sparse, layer.reference(x, np.ones_like(g, bool)), 1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
@pytest.mark.parametrize("keep", [0.5, 0.3, 0.1])
def test_threshold_selects_exactly_the_active_set(activation, keep):
    rng = np.random.default_rng(3)
    layer = random_layer(rng, 128, 512, T.Q4_0, T.Q4_0, T.Q8_0, activation)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    _, a, _ = layer.act_g_u(x)
    thr = gap_threshold(a, keep)
    y, counts, mask = layer.run(x, thr, return_mask=True)
    expected = np.abs(a) > thr
    np.testing.assert_array_equal(mask.astype(bool), expected)
    assert counts.tolist() == expected.sum(axis=1).tolist()
    assert abs(counts[0] - keep * 512) <= 21
    assert_close(y, layer.reference(x, expected), tol(layer))


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_thresholds_around_the_negative_peak(activation):
    """Above max |act(g < 0)| (silu 0.2785, gelu 0.1700) the kernel rejects small g without evaluating
    act; the selection must stay exactly |act(g)| > threshold on both sides of that switch."""
    rng = np.random.default_rng(11)
    layer = random_layer(rng, 128, 1024, T.Q8_0, T.Q8_0, T.Q8_0, activation)
    x = (rng.standard_normal((2, 128)) * 1.5).astype(np.float32)
    _, a, _ = layer.act_g_u(x)
    for thr in (0.05, 0.15, 0.17, 0.1718, 0.25, 0.2785, 0.2813, 0.29, 0.5, 1.0, 2.5):
        y, counts, mask = layer.run(x, thr, return_mask=True)
        expected = np.abs(a) > thr
        clear = np.abs(np.abs(a) - thr) > 1e-5 * max(thr, 1e-3)  # not within rounding of thr
        np.testing.assert_array_equal(mask.astype(bool)[clear], expected[clear])
        assert counts.tolist() == mask.sum(axis=1).tolist()
        assert_close(y, layer.reference(x, mask.astype(bool)), tol(layer))


@pytest.mark.parametrize("down_t_type", [T.Q8_0, T.F16, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K, T.Q2_K])
def test_threads_isas_and_clusters_agree(down_t_type):
    rng = np.random.default_rng(5)
    layer = random_layer(rng, 256, 1000, T.Q4_0, T.Q4_0, down_t_type, "silu")
    x = rng.standard_normal((2, 256)).astype(np.float32)
    _, a, _ = layer.act_g_u(x)
    thr = gap_threshold(a, 0.3)
    y1, c1, m1 = layer.run(x, thr, n_threads=1, return_mask=True)
    y1_again, _ = layer.run(x, thr, n_threads=1)
    np.testing.assert_array_equal(y1, y1_again)  # deterministic
    for n_threads in (2, 3):
        y2, c2, m2 = layer.run(x, thr, n_threads=n_threads, return_mask=True)
        np.testing.assert_array_equal(c1, c2)
        np.testing.assert_array_equal(m1, m2)
        assert_close(y2, y1.astype(np.float64), 1e-6)
        y2_again, _ = layer.run(x, thr, n_threads=n_threads)
        np.testing.assert_array_equal(y2, y2_again)
    # ISAs differ by FMA rounding; Q2_K's d·sc·q − dmin·m cancels the most (2-bit quants, a min per
    # 16 values), so its rounding differences are the largest relative to y
    isa_tol = 3e-6 if down_t_type == T.Q2_K else 1e-6
    for isa in ISAS:
        y_isa, c_isa = layer.run(x, thr, isa=isa)
        np.testing.assert_array_equal(c_isa, c1)
        assert_close(y_isa, y1.astype(np.float64), isa_tol)
    for cluster_size in (1, 7, 64, 256):
        y_c, c_c = layer.run(x, thr, n_threads=2, cluster_size=cluster_size)
        np.testing.assert_array_equal(c_c, c1)
        assert_close(y_c, y1.astype(np.float64), 1e-6)
    assert_close(y1, layer.reference(x, np.abs(a) > thr), 1e-5)


@pytest.mark.parametrize("activation", ["silu", "relu"])
def test_precomputed_gate_values(activation):
    """With gate_values the kernel reads no gate rows: selection and h come from the given g, and the
    sum runs by cluster (what the sparse lane does with g from ggml)."""
    rng = np.random.default_rng(13)
    layer = random_layer(rng, 128, 300, T.Q4_0, T.Q4_0, T.Q8_0, activation)
    x = rng.standard_normal((2, 128)).astype(np.float32)
    g, a, _ = layer.act_g_u(x)
    g32 = g.astype(np.float32)
    thr = gap_threshold(a, 0.4)
    y, counts, mask = layer.run(x, thr, gate_values=g32, return_mask=True)
    np.testing.assert_array_equal(mask.astype(bool), np.abs(a) > thr)
    assert_close(y, layer.reference(x, np.abs(a) > thr), 1e-5)
    y_own, counts_own = layer.run(x, thr)
    np.testing.assert_array_equal(counts, counts_own)
    assert_close(y, y_own.astype(np.float64), 1e-5)
    # the gate rows are really not read: garbage in them changes nothing
    spoiled = Layer.__new__(Layer)
    spoiled.__dict__.update(layer.__dict__)
    spoiled.bundles = layer.bundles.copy()
    spoiled.bundles[:, : layer.gate_row_bytes] = 0x77
    y1, _ = layer.run(x, thr, gate_values=g32)
    y2, _ = spoiled.run(x, thr, gate_values=g32)
    np.testing.assert_array_equal(y1, y2)


def test_precomputed_up_values():
    """With gate_values and up_values (the sparse lane with u from ggml's GEMV) the kernel reads only
    down_t rows, summing by range: garbage in the bundles changes nothing."""
    rng = np.random.default_rng(14)
    layer = random_layer(rng, 128, 300, T.Q8_0, T.Q8_0, T.Q8_0, "silu")
    x = rng.standard_normal((2, 128)).astype(np.float32)
    g, a, u = layer.act_g_u(x)
    thr = gap_threshold(a, 0.4)
    values = dict(gate_values=g.astype(np.float32), up_values=u.astype(np.float32))
    y, counts, mask = layer.run(x, thr, return_mask=True, **values)
    np.testing.assert_array_equal(mask.astype(bool), np.abs(a) > thr)
    assert_close(y, layer.reference(x, np.abs(a) > thr), 1e-5)
    spoiled = Layer.__new__(Layer)
    spoiled.__dict__.update(layer.__dict__)
    spoiled.bundles = np.full_like(layer.bundles, 0x77)
    np.testing.assert_array_equal(spoiled.run(x, thr, **values)[0], y)


def test_cluster_order_ignores_threads_and_batch():
    """By cluster (gate values given), y is summed in cluster order: a token's result is the same bits
    whatever the thread count and whichever tokens share its batch (what lets a speculative verify
    batch reproduce single-token decoding)."""
    rng = np.random.default_rng(12)
    layer = random_layer(rng, 128, 700, T.Q4_0, T.Q4_0, T.Q8_0, "silu")
    x = rng.standard_normal((3, 128)).astype(np.float32)
    g, a, _ = layer.act_g_u(x)
    g32 = g.astype(np.float32)
    thr = gap_threshold(a, 0.3)
    y1, c1, m1 = layer.run(x, thr, n_threads=1, gate_values=g32, return_mask=True)
    for n_threads in (2, 3):
        y, c, m = layer.run(x, thr, n_threads=n_threads, gate_values=g32, return_mask=True)
        np.testing.assert_array_equal(y, y1)
        np.testing.assert_array_equal(c, c1)
        np.testing.assert_array_equal(m, m1)
    for t in range(3):
        yt, ct = layer.run(x[t : t + 1], thr, n_threads=2, gate_values=g32[t : t + 1])
        np.testing.assert_array_equal(yt[0], y1[t])
        assert ct[0] == c1[t]


@pytest.mark.parametrize("by_cluster", [False, True])
def test_batch_equals_token_by_token(by_cluster):
    """A batch runs cluster by cluster with every token in turn (one read of each row of the union);
    each token's result is bit-identical to that token computed alone."""
    rng = np.random.default_rng(6)
    layer = random_layer(rng, 64, 128, T.Q8_0, T.Q8_0, T.Q8_0, "silu")
    x = rng.standard_normal((5, 64)).astype(np.float32)
    g = layer.act_g_u(x)[0].astype(np.float32) if by_cluster else None
    y, counts = layer.run(x, 0.05, n_threads=2, cluster_size=8, gate_values=g)
    for t in range(5):
        gt = None if g is None else g[t : t + 1]
        yt, ct = layer.run(x[t : t + 1], 0.05, n_threads=2, cluster_size=8, gate_values=gt)
        np.testing.assert_array_equal(yt[0], y[t])
        assert ct[0] == counts[t]


def test_kernel_object_reuses_scratch():
    rng = np.random.default_rng(7)
    layer = random_layer(rng, 64, 128, T.Q4_0, T.Q4_0, T.Q8_0, "silu")
    k = N.SparseFfnKernel(
        layer.bundles,
        layer.bundle_stride,
        int(layer.gate_type),
        int(layer.up_type),
        layer.gate_row_bytes,
        layer.up_row_bytes,
        layer.down_t,
        int(layer.down_t_type),
        layer.down_t_row_bytes,
        64,
        128,
        "silu",
    )
    x = rng.standard_normal((4, 64)).astype(np.float32)
    y_small, _ = k.forward(x[:1], 0.0, n_threads=1)
    y_big, _ = k.forward(x, 0.0, n_threads=2)  # grows the scratch
    y_small_again, _ = k.forward(x[:1], 0.0, n_threads=1)
    np.testing.assert_array_equal(y_small, y_small_again)
    assert_close(y_big[:1], y_small.astype(np.float64), 1e-6)
    times = k.time(x[:1], 0.0, n_iter=3)
    assert len(times) == 3 and all(t > 0 for t in times)


def test_activation_matches_ggml_semantics():
    g = np.concatenate([np.linspace(-12, 12, 2001), [-10.0, 10.0, 0.0, -0.0]]).astype(np.float32)
    for name in ("silu", "gelu", "relu"):
        # atol: where tanh ~ -1, 1 + tanh(.) differs between libm's tanhf and NumPy's float32 tanh
        np.testing.assert_allclose(
            N.sparse_ffn_activation(name, g), act_ref(name, g.astype(np.float64)), rtol=2e-6, atol=1e-5
        )


def test_bad_arguments_are_refused():
    rng = np.random.default_rng(8)
    layer = random_layer(rng, 64, 32, T.Q8_0, T.Q8_0, T.Q8_0, "silu")
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="activation"):
        N.sparse_ffn_forward(
            layer.bundles,
            layer.bundle_stride,
            8,
            8,
            layer.gate_row_bytes,
            layer.up_row_bytes,
            layer.down_t,
            8,
            layer.down_t_row_bytes,
            64,
            32,
            "swish",
            x,
        )
    with pytest.raises(ValueError, match="row"):
        N.sparse_ffn_forward(
            layer.bundles,
            layer.bundle_stride,
            8,
            8,
            layer.gate_row_bytes + 1,
            layer.up_row_bytes,
            layer.down_t,
            8,
            layer.down_t_row_bytes,
            64,
            32,
            "silu",
            x,
        )
    with pytest.raises(ValueError, match="bundles"):
        N.sparse_ffn_forward(
            layer.bundles[:10],
            layer.bundle_stride,
            8,
            8,
            layer.gate_row_bytes,
            layer.up_row_bytes,
            layer.down_t,
            8,
            layer.down_t_row_bytes,
            64,
            32,
            "silu",
            x,
        )
    with pytest.raises(ValueError, match="gate_values"):
        layer.run(x, 0.0, gate_values=np.zeros((1, 31), np.float32))
    with pytest.raises(ValueError, match="n_embd"):
        layer.run(np.zeros((1, 65), np.float32))
    with pytest.raises(ValueError, match="cluster_size"):
        layer.run(x, cluster_size=0)


# --------------------------------------------------------------------------------------------
# K-quants: layers of a converted tiny model, read at the offsets the sidecar reader reports


def _sidecar_layers(tiny_model_factory, tmp_path, weight_type, n_embd, n_ff, down_t="q8_0"):
    src = tiny_model_factory(weight_type=weight_type, n_embd=n_embd, n_ff=n_ff)
    model = tmp_path / src.name
    shutil.copy(src, model)
    sidecar = convert(model, progress=False, profile=False, down_t_type=down_t)  # bundle-only: all the kernel reads
    info = validate_pair(model, sidecar)
    side = np.fromfile(sidecar, np.uint8)
    base = np.fromfile(model, np.uint8)
    out = []
    for lay in info.layers:
        bundles = side[lay.bundle_offset : lay.bundle_offset + lay.n_ff * lay.bundle_stride].reshape(lay.n_ff, -1)
        down_t = side[lay.down_t_offset : lay.down_t_offset + lay.n_ff * lay.down_t_row_bytes].reshape(lay.n_ff, -1)
        layer = Layer.from_bytes(
            bundles,
            lay.bundle_stride,
            lay.gate_type,
            lay.up_type,
            lay.gate_row_bytes,
            lay.up_row_bytes,
            down_t,
            lay.down_t_type,
            lay.n_embd,
            info.activation,
        )
        rows = lay.n_ff * _row_bytes(T(lay.gate_type), lay.n_embd)
        base_w = dict(
            gate=base[lay.base_gate_offset : lay.base_gate_offset + rows],
            gate_type=lay.gate_type,
            up=base[lay.base_up_offset : lay.base_up_offset + lay.n_ff * _row_bytes(T(lay.up_type), lay.n_embd)],
            up_type=lay.up_type,
            down=base[lay.base_down_offset : lay.base_down_offset + lay.n_embd * lay.base_down_row_bytes],
            down_type=lay.base_down_type,
        )
        out.append((layer, base_w))
    return out


# down_t choice, its stored type, and the bound on the relative L2 error of y from the sidecar's
# requantization of down (measured here: Q8_0 0.6%, Q4_K 7.2-7.7% on these Gaussian weights)
DOWN_T_CHOICES = [("q8_0", T.Q8_0, 1e-2), ("auto", T.Q4_K, 9e-2)]


@pytest.mark.parametrize("down_t,down_t_type,requant_rtol", DOWN_T_CHOICES)
@pytest.mark.parametrize("weight_type,n_embd,n_ff", [("Q4_K_M", 256, 512), ("Q6_K", 256, 768)])
def test_kquant_sidecar_layers(
    tiny_model_factory, tmp_path, weight_type, n_embd, n_ff, down_t, down_t_type, requant_rtol
):
    layers = _sidecar_layers(tiny_model_factory, tmp_path, weight_type, n_embd, n_ff, down_t)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, n_embd)).astype(np.float32)
    for layer, base_w in layers:
        assert layer.gate_type in (T.Q4_K, T.Q6_K) and layer.down_t_type == down_t_type
        _, a, _ = layer.act_g_u(x)
        y, counts = layer.run(x, 0.0, n_threads=2)
        assert counts.tolist() == [n_ff] * 2
        assert_close(y, layer.reference(x, np.ones_like(a, bool)), 1e-5)
        thr = gap_threshold(a, 0.3)
        y, counts, mask = layer.run(x, thr, n_threads=2, return_mask=True)
        np.testing.assert_array_equal(mask.astype(bool), np.abs(a) > thr)
        assert_close(y, layer.reference(x, np.abs(a) > thr), 1e-5)

        # against the base model's own down matrix (exact h, float64): the only difference is the
        # sidecar's requantization of down (DOWN_T_CHOICES)
        y_dense, _ = layer.run(x, -1.0)
        _, a, u = layer.act_g_u(x)
        down = _dq(base_w["down"].reshape(n_embd, -1), T(base_w["down_type"]))  # [n_embd, n_ff]
        y_exact = (a * u) @ down.T
        assert np.linalg.norm(y_dense - y_exact) / np.linalg.norm(y_exact) < requant_rtol
        # and against ggml's own dense FFN graph on the base weights, which also quantizes h to Q8_K
        # for its down matmul (measured ~1.5% from y_exact)
        y_ggml = ggml_dense(
            base_w["gate"],
            base_w["gate_type"],
            base_w["up"],
            base_w["up_type"],
            base_w["down"],
            base_w["down_type"],
            n_embd,
            n_ff,
            layer.activation,
            x,
            n_threads=2,
        )
        assert np.linalg.norm(y_dense - y_ggml) / np.linalg.norm(y_ggml) < 2e-2 + requant_rtol

        # hybrid: g from ggml's (repacked) dense gate GEMV, up/down_t sparse in the kernel
        gate_graph = N.DenseFfnGraph(
            base_w["gate"],
            base_w["gate_type"],
            None,
            0,
            None,
            0,
            n_embd,
            n_ff,
            layer.activation,
            n_tokens=2,
            n_threads=2,
            gate_only=True,
        )
        g_ggml, _ = gate_graph.run(x)
        g, _, _ = layer.act_g_u(x)
        assert np.abs(g_ggml - g).max() <= 1e-5 * np.abs(g).max()  # same g (bundle order = base order here)
        y_h, _, mask_h = layer.run(x, thr, gate_values=g_ggml, return_mask=True)
        np.testing.assert_array_equal(mask_h.astype(bool), np.abs(a) > thr)
        assert_close(y_h, layer.reference(x, np.abs(a) > thr), 1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
@pytest.mark.parametrize("down_type,rtol", [(T.F32, 2e-5), (T.F16, 2e-3)])
def test_dense_mode_matches_ggml_graph(activation, down_type, rtol):
    """threshold < 0 against ggml's own graph (MUL_MAT, {SWI,GE,RE}GLU_SPLIT, MUL_MAT) on the same
    weights. F32 down: ggml multiplies h unrounded, so only float rounding differs (and ggml's SIMD
    silu); F16 down: ggml's down matmul rounds h to f16 (2^-11 relative per element). down_t F32 also
    exercises the kernel's generic dequantize-then-axpy path."""
    rng = np.random.default_rng(10)
    n_embd, n_ff = 128, 256
    gate = (rng.standard_normal((n_ff, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    up = (rng.standard_normal((n_ff, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    down_t = (rng.standard_normal((n_ff, n_embd)) / np.sqrt(n_ff)).astype(np.float32)
    layer = Layer(gate, up, down_t, T.Q8_0, T.Q8_0, down_type, activation)
    down = _q(np.ascontiguousarray(layer.D.T.astype(np.float32)), down_type)  # base down: n_embd rows of n_ff
    x = (rng.standard_normal((3, n_embd)) * 2).astype(np.float32)
    y, _ = layer.run(x, -1.0)
    g_bytes = layer.bundles[:, : layer.gate_row_bytes].copy()
    u_bytes = layer.bundles[:, layer.gate_row_bytes : layer.gate_row_bytes + layer.up_row_bytes].copy()
    y_ggml = ggml_dense(g_bytes, T.Q8_0, u_bytes, T.Q8_0, down, down_type, n_embd, n_ff, activation, x)
    assert_close(y, y_ggml.astype(np.float64), rtol)
