"""The NumPy reference of the sparse FFN decode kernel (csrc/lanes/sparse_ffn.h) and the layers it is
tested on (tests/test_sparse_ffn.py, tests/test_sparse_ffn_ggml.py).

:class:`Layer`: one layer in sidecar bundle order (gate and up rows bundled per neuron, down_t rows),
built from float matrices (rows = neurons) or read from a sidecar's bytes; ``run`` calls the kernel
(``_native_testing.sparse_ffn_forward``), ``reference`` computes y over a given active set.

Reference: weights dequantized with ``gguf.quants.dequantize``; x replaced by the activations the
kernel's row dots actually multiply with (``_native_testing.activation_roundtrip``: x quantized to the
weight type's vec_dot_type by ggml-cpu and decoded: Q8_0 / Q8_1 / Q8_K / F16 / F32), so the only
differences left are float rounding (the kernel sums in f32 in another order; the reference uses
float64). Tolerance (:func:`tol`): max |y - y_ref| <= RTOL * max |y_ref| with RTOL = 1e-5, except
  * gelu: 1e-3 (ggml's GEGLU rounds act(g) to f16; a g within float rounding of an f16 rounding
    boundary can round the other way in the f64 reference, an f16 ulp on that neuron);
  * Q4_1 / Q5_1 (vec_dot_type Q8_1): 2e-3 (the Q8_1 block sum used for the min term is stored as
    f16, so ggml's dot is not exactly the dot with the decoded activations).
Thresholds for the selection tests (:func:`gap_threshold`) are placed in the middle of a wide gap
between consecutive |act(g)| values, so float rounding cannot move a neuron across them; the kernel's
active mask must then equal the reference's set exactly. :func:`ggml_dense`: ggml's own dense FFN
graph on the CPU backend, for comparisons with ggml.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

from llamaflash import _native
from llamaflash import _native_testing as N

T = gguf.GGMLQuantizationType


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
