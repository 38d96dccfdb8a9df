"""The sparse FFN decode kernel (csrc/lanes/sparse_ffn.h) against ggml and real sidecar bytes: the layers
of converted tiny K-quant models (Q4_K_M, Q6_K; down_t Q8_0 or the converter's auto choice), read at
the offsets the sidecar reader reports, against the NumPy reference, the base model's own down matrix,
ggml's dense FFN graph and a hybrid with ggml's gate GEMV; and the kernel's dense mode against ggml's
graph on the same weights. Reference and tolerances: tests/sparse_ffn_reference.py.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from sparse_ffn_reference import Layer, T, _dq, _q, _row_bytes, assert_close, gap_threshold, ggml_dense

from llamaflash import _native_testing as N
from llamaflash.converters import convert
from llamaflash.files.sidecar import validate_pair


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
