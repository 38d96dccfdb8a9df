"""kquant_gemm (csrc/kernels/kquant_gemm.h): every output has the bits of ggml-cpu's vec_dot.

Reference: ggml-cpu's own vec_dot, one call per output, on the same Q8_K activations. Weights are
ggml's quantization of random rows; activations are random with outliers, as hidden states have.
Every kernel this CPU can run is checked itself, beside the one kquant_gemm picks.
"""

from __future__ import annotations

import numpy as np
import pytest

from llamaflash import _native_testing as T
from llamaflash.bench import moe_direct

TYPES = {"Q4_K": 12, "Q6_K": 14}
#: (ne0, weight rows, columns): one superblock; tiles with a remainder (8- and 16-column tiles); a row
#: block and a half; a long row (ffn_down of a 1.5B model)
SHAPES = [(256, 3, 1), (512, 7, 9), (1536, 97, 17), (8960, 16, 63), (2048, 5, 4), (768, 130, 3), (1024, 9, 33)]


def _case(rng: np.random.Generator, type_name: str, ne0: int, rows: int, cols: int):
    w = moe_direct.quantize_rows(rng.standard_normal((rows, ne0), dtype=np.float32), type_name)
    x = rng.standard_normal((cols, ne0), dtype=np.float32)
    x[:, rng.integers(0, ne0, 3)] *= 60.0  # outlier channels
    x[:, : ne0 // 4] *= 0.01  # small values: Q8_K scales per superblock differ
    return w, x


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_every_kernel_has_vec_dots_bits(type_name):
    tid = TYPES[type_name]
    isas = T.kquant_gemm_isas(tid)
    rng = np.random.default_rng(7)
    for ne0, rows, cols in SHAPES:
        w, x = _case(rng, type_name, ne0, rows, cols)
        want = T.kquant_gemm(w, tid, ne0, x, reference=True)
        assert want.shape == (cols, rows) and np.abs(want).max() > 0
        np.testing.assert_array_equal(_bits(T.kquant_gemm(w, tid, ne0, x)), _bits(want))
        for isa in isas:
            np.testing.assert_array_equal(_bits(T.kquant_gemm(w, tid, ne0, x, isa=isa)), _bits(want), err_msg=isa)


@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_a_column_has_the_same_bits_in_any_batch(type_name):
    tid = TYPES[type_name]
    rng = np.random.default_rng(3)
    w, x = _case(rng, type_name, 1024, 33, 40)
    whole = T.kquant_gemm(w, tid, 1024, x)
    for n in (1, 2, 5, 8, 9, 16, 17, 33):
        part = T.kquant_gemm(w, tid, 1024, x[:n])
        np.testing.assert_array_equal(_bits(part), _bits(whole[:n]))


def test_the_kernel_serves_where_the_cpu_has_avx2():
    import llama_cpp  # noqa: F401  (loads ggml-cpu)

    if not T.kquant_gemm_isas(TYPES["Q4_K"]):
        pytest.skip("no AVX2 on this CPU: kquant_gemm runs vec_dot")
    assert T.kquant_gemm_supported(TYPES["Q4_K"]) and T.kquant_gemm_supported(TYPES["Q6_K"])
    assert not T.kquant_gemm_supported(13)  # Q5_K: no kernel, vec_dot


def test_bad_input_is_refused():
    w = np.zeros((2, 144), np.uint8)
    with pytest.raises(ValueError, match="multiple of 256"):
        T.kquant_gemm(w, 12, 100, np.zeros((1, 100), np.float32))
    with pytest.raises(ValueError, match="weights must be"):
        T.kquant_gemm(w, 12, 512, np.zeros((1, 512), np.float32))
    with pytest.raises(ValueError, match="no vec_dot with Q8_K"):
        T.kquant_gemm(w, 0, 256, np.zeros((1, 256), np.float32))


@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_a_row_check_sees_every_row_once_after_it_is_multiplied_and_changes_no_bit(type_name):
    """kquant_gemm's RowBlockHook (how a layer read from flash is checked as it is multiplied,
    backend/matmul_rows.h CheckedWeight): called once per block of at most 64 rows, in order, covering
    every row; the outputs are those without it; a row whose bytes differ from its checksum is found."""
    from llamaflash import _native

    tid = TYPES[type_name]
    rng = np.random.default_rng(11)
    w, x = _case(rng, type_name, 512, 150, 9)
    crc = _native.crc32c_rows(w, w.shape[1])
    for cols in (1, 2, 7, 9):
        for isa in ["auto"] + T.kquant_gemm_isas(tid):
            out, bad, blocks = T.kquant_gemm(w, tid, 512, x[:cols], isa=isa, crc=crc)
            np.testing.assert_array_equal(_bits(out), _bits(T.kquant_gemm(w, tid, 512, x[:cols], isa=isa)))
            assert bad == -1 and blocks == [(0, 64), (64, 64), (128, 22)], (cols, isa)
    changed = crc.copy()
    changed[[100, 140]] ^= 1  # as if rows 100 and 140 had been read wrong
    assert T.kquant_gemm(w, tid, 512, x, crc=changed)[1] == 100
