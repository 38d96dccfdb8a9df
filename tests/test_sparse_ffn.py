"""The sparse FFN decode kernel (csrc/lanes/sparse_ffn.h) on random layers against its NumPy reference
(tests/sparse_ffn_reference.py, which describes the reference and the tolerances): the dense formula
at threshold zero, exact selection of the active set (thresholds in a wide gap between consecutive
|act(g)| values, so the kernel's active mask must equal the reference's set exactly), agreement across
thread counts, ISAs and cluster sizes, precomputed gate and up values, batches against single tokens,
the kernel object, the activations and the arguments refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from sparse_ffn_reference import Layer, T, act_ref, assert_close, gap_threshold, random_layer, tol

from llamaflash import _native_testing as N

BEST_ISA = N.sparse_ffn_best_isa()
ISAS = {"scalar": ["scalar"], "avx2": ["scalar", "avx2"], "avx512": ["scalar", "avx2", "avx512"]}[BEST_ISA]


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


@pytest.mark.parametrize(
    "up_type, down_t_type",
    [(T.Q4_K, T.Q4_K), (T.Q6_K, T.Q4_K), (T.Q4_K, T.Q6_K), (T.Q4_K, T.Q8_0), (T.Q4_0, T.Q4_K)],
)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("up_apart", [False, True])
def test_cluster_batch_equals_token_by_token_kquants(up_type, down_t_type, isa, up_apart):
    """Several tokens by cluster take the batched path (u by kquant_gemm over the union of the tokens'
    rows where it computes the up type itself, the down_t rows of the union added to every token with
    h = 0 where a token does not select a row): each token's y is the bits it gets alone, at any batch
    size and thread count, also with tokens selecting nothing in a cluster and a threshold that keeps
    every neuron. up_apart: the up rows in a row-major matrix of their own (the base model's ffn_up, as
    the lane reads them), which kquant_gemm takes; inside the bundles, vec_dot per selected row."""
    rng = np.random.default_rng(21)
    layer = random_layer(rng, 512, 300, T.Q4_K, up_type, down_t_type, "silu")
    up = layer.bundles[:, layer.gate_row_bytes : layer.gate_row_bytes + layer.up_row_bytes]
    kw = {"up_rows": np.ascontiguousarray(up)} if up_apart else {}
    x = rng.standard_normal((9, 512)).astype(np.float32)
    x[:, rng.integers(0, 512, 3)] *= 30.0  # outlier channels, as hidden states have
    g, a, _ = layer.act_g_u(x)
    g32 = g.astype(np.float32)
    g32[4, :64] = 0.0  # token 4 selects nothing in the first clusters
    for thr in (gap_threshold(a, 0.3), gap_threshold(a, 0.05), -1.0):
        alone = [layer.run(x[t : t + 1], thr, gate_values=g32[t : t + 1], isa=isa, **kw) for t in range(9)]
        for n_tokens in (2, 5, 9):
            for n_threads in (1, 2):
                y, counts = layer.run(x[:n_tokens], thr, n_threads=n_threads, gate_values=g32[:n_tokens], isa=isa, **kw)
                for t in range(n_tokens):
                    np.testing.assert_array_equal(y[t], alone[t][0][0], err_msg=f"thr {thr} T {n_tokens} token {t}")
                    assert counts[t] == alone[t][1][0]
        if thr >= 0:
            assert_close(alone[0][0], layer.reference(x[:1], np.abs(a[:1]) > thr), 1e-5)


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
