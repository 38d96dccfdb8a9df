// kquant_gemm_x86.cpp — the x86 kernels of kquant_gemm (kquant_gemm.h): Q4_K and Q6_K times Q8_K, for
// AVX2 and for AVX-512 with VNNI, each compiled for its ISA with a target attribute.
//
// Every kernel walks blocks of kRowBlock weight rows, for each block tiles of up to kGemmCols columns
// (the AVX-512 kernels: kQ4KTileCols, kQ6KTileCols), and for each tile the block's rows: a superblock's weights are unpacked once per (row, tile) and used
// for each column of the tile (the tile's activations stay in cache while the block's rows pass). Per
// output it forms the integer lane totals of ggml-cpu's AVX2 vec_dot (ggml-cpu/arch/x86/quants.c) and
// then applies the same float operations in the same order (kquant_gemm.h), so every output has
// vec_dot's bits:
//  - the AVX2 kernels run vec_dot's own instructions, the weight side hoisted out of the column loop;
//  - the AVX-512 kernels take weight rows in pairs, so that each column's loads serve two rows, and
//    multiply-add with vpdpwssd. The Q6_K kernel holds a 32-byte chunk's two sub-blocks in one 64-byte
//    register (lanes 0..7: the first, 8..15: the second) and adds the two halves (exact integers),
//    which gives vec_dot's 8 lane totals; the Q4_K kernel holds one sub-block of both rows in one
//    register (lanes 0..7: row r, 8..15: row r + 1), so its sums are both rows' lane totals at once,
//    and runs both rows' float steps in one register, lane by lane vec_dot's. With at most kReadAheadMaxCols columns they ask for each row
//    pair's bytes 4 KiB ahead (row_prefetch.h), which changes no result.
#include "kernels/kquant_gemm_kernels.h"

#include "kernels/kquant_gemm.h"
#include "kernels/row_prefetch.h"

#if LLAMAFLASH_GEMM_X86
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace llamaflash {
namespace gemm {

namespace {

constexpr int kQK = 256;                // values per superblock
constexpr size_t kQ4_KBytes = 144;      // d, dmin (fp16), scales[12], qs[128]
constexpr size_t kQ6_KBytes = 210;      // ql[128], qh[64], scales[16] (int8), d (fp16)
constexpr size_t kQ8_KBytes = 292;      // d (f32), qs[256] (int8), bsums[16] (int16)
constexpr size_t kQ8_KBsums = 4 + kQK;  // offset of bsums in a Q8_K block
// Weight rows multiplied by one tile of columns before the next tile: the tile's activations
// (kGemmCols × ne0 / 256 Q8_K blocks) stay in L1 / L2 while the block's rows stream past them.
constexpr int64_t kRowBlock = kGemmRowBlock;
// Up to this many columns the AVX-512 kernels read the weights ahead (row_prefetch.h): with so few
// columns per unpacked block they wait on the memory stream. Measured single-threaded over 113-165 MB
// of expert rows (out of cache): Q6_K 0.62-0.73× the time at 2 and 3 columns, Q4_K 0.88× at 2 and
// 0.94-1.09× at 3; from 7 columns no consistent gain.
constexpr int64_t kReadAheadMaxCols = 3;

inline uint16_t load_u16(const uint8_t * p) {
    uint16_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline float load_f32(const uint8_t * p) {
    float v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// Q4_K's 12 scale bytes → 8 six-bit scales (bytes 0..7 of the result) and 8 mins (bytes 8..15), as
// ggml's vec_dot unpacks them (utmp).
inline void q4_k_scales_mins(const uint8_t * packed, uint32_t utmp[4]) {
    constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    std::memcpy(utmp, packed, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
}

#define LF_AVX2   __attribute__((target("avx2,fma,f16c")))
#define LF_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

// ggml's hsum_float_8: ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)).
LF_AVX2 inline float hsum_float_8(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

// (m0+m2) + (m1+m3), as vec_dot_q4_K reduces acc_m.
LF_AVX2 inline float hsum_float_4(__m128 m) {
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// The minimum's term of a Q4_K superblock for one Q8_K block: madd(mins, hadd(bsums)) (4 int32 lanes).
LF_AVX2 inline __m128i q4_k_min_products(__m128i mins16, const uint8_t * y) {
    const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y + kQ8_KBsums));
    const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
    return _mm_madd_epi16(mins16, q8s);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Q4_K

LF_AVX2 void q4_k_avx2(int64_t ne0, const void * w, size_t w_row_bytes, int64_t n_rows, const void * q,
                       size_t q_col_bytes, int64_t n_cols, float * out, size_t out_col_stride,
                       const RowBlockHook * hook) {
    const int64_t nb = ne0 / kQK;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int64_t r0 = 0; r0 < n_rows; r0 += kRowBlock) {
        for (int64_t c0 = 0; c0 < n_cols; c0 += kGemmCols) {
            for (int64_t r = r0; r < std::min(n_rows, r0 + kRowBlock); ++r) {
                const uint8_t * x = static_cast<const uint8_t *>(w) + static_cast<size_t>(r) * w_row_bytes;
                const int nc = static_cast<int>(std::min<int64_t>(kGemmCols, n_cols - c0));
                const uint8_t * qc = static_cast<const uint8_t *>(q) + static_cast<size_t>(c0) * q_col_bytes;
                __m256 acc[kGemmCols];
                __m128 acc_m[kGemmCols];
                for (int c = 0; c < nc; ++c) {
                    acc[c] = _mm256_setzero_ps();
                    acc_m[c] = _mm_setzero_ps();
                }
                for (int64_t i = 0; i < nb; ++i) {
                    const uint8_t * xb = x + static_cast<size_t>(i) * kQ4_KBytes;
                    const float xd = _cvtsh_ss(load_u16(xb)), xdmin = _cvtsh_ss(load_u16(xb + 2));
                    uint32_t utmp[4];
                    q4_k_scales_mins(xb + 4, utmp);
                    const __m256i mins_and_scales =
                        _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
                    const __m128i mins16 = _mm256_extracti128_si256(mins_and_scales, 1);
                    uint8_t sc[8];
                    std::memcpy(sc, utmp, 8);
                    // the weight side of vec_dot's inner loop: nibbles and per-sub-block scales
                    __m256i lo[4], hi[4], sl[4], sh[4];
                    for (int j = 0; j < 4; ++j) {
                        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(xb + 16 + 32 * j));
                        lo[j] = _mm256_and_si256(bits, m4);
                        hi[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                        sl[j] = _mm256_set1_epi16(sc[2 * j]);
                        sh[j] = _mm256_set1_epi16(sc[2 * j + 1]);
                    }
                    for (int c = 0; c < nc; ++c) {
                        const uint8_t * y =
                            qc + static_cast<size_t>(c) * q_col_bytes + static_cast<size_t>(i) * kQ8_KBytes;
                        const float yd = load_f32(y);
                        const __m128i prod = q4_k_min_products(mins16, y);
                        acc_m[c] = _mm_fmadd_ps(_mm_set1_ps(-yd * xdmin), _mm_cvtepi32_ps(prod), acc_m[c]);
                        __m256i sumi = _mm256_setzero_si256();
                        for (int j = 0; j < 4; ++j) {
                            const __m256i q8l = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y + 4 + 64 * j));
                            const __m256i q8h =
                                _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y + 4 + 64 * j + 32));
                            const __m256i p16l = _mm256_madd_epi16(sl[j], _mm256_maddubs_epi16(lo[j], q8l));
                            const __m256i p16h = _mm256_madd_epi16(sh[j], _mm256_maddubs_epi16(hi[j], q8h));
                            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
                        }
                        acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(yd * xd), _mm256_cvtepi32_ps(sumi), acc[c]);
                    }
                }
                for (int c = 0; c < nc; ++c) {
                    out[static_cast<size_t>(c0 + c) * out_col_stride + r] =
                        hsum_float_8(acc[c]) + hsum_float_4(acc_m[c]);
                }
            }
        }
        if (hook != nullptr) (*hook)(r0, std::min(kRowBlock, n_rows - r0));  // rows now in cache
    }
}

// One Q4_K superblock of a pair of weight rows unpacked for the AVX-512 kernel: sub-block k of both
// rows in one register, wq[k] = [row 0's 32 values | row 1's 32 values] (chunk k/2's low nibbles for
// even k, high for odd), ws[k] = their scales as int16 [sc0[k] × 16 | sc1[k] × 16]; the mins as int16
// [row 0's 8 | row 1's 8]; xd = [d0 × 8 | d1 × 8], xdmin = [dmin0 × 4 | dmin1 × 4]. Multiplied by a
// column's sub-block k in both halves, vpmaddubsw + vpdpwssd add each row's products to the lanes vec_dot
// adds them to (lane l of a half: values 4l..4l+3 of every sub-block), so the sums over k are vec_dot's 8
// lane totals of each row, with no fold of halves.
struct Q4KPair512 {
    __m512i wq[8], ws[8];
    __m256i mins16;
    __m512 xd;
    __m256 xdmin;
};

LF_AVX512 inline __attribute__((always_inline)) void unpack_q4_k_pair_512(const uint8_t * x0, const uint8_t * x1,
                                                                          Q4KPair512 & p) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    // d and dmin of each row: the two fp16 values converted together
    const __m128 dd0 =
        _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u16(x0) | (uint32_t{load_u16(x0 + 2)} << 16))));
    const __m128 dd1 =
        _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u16(x1) | (uint32_t{load_u16(x1 + 2)} << 16))));
    p.xd = _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(_mm_cvtss_f32(dd0)))),
                           _mm256_castps_pd(_mm256_set1_ps(_mm_cvtss_f32(dd1))), 1));
    p.xdmin = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(dd0)))),
                                   _mm_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(dd1))), 1);
    uint32_t u0[4], u1[4];
    q4_k_scales_mins(x0 + 4, u0);
    q4_k_scales_mins(x1 + 4, u1);
    p.mins16 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, u0[3], u0[2]))),
                                       _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, u1[3], u1[2])), 1);
    // scales as int16: row 0's in words 0..7, row 1's in words 16..23; each sub-block's pair spread by
    // one permutation
    const __m512i sc16 = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_castsi128_si256(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, u0[1], u0[0])))),
        _mm256_castsi128_si256(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, u1[1], u1[0]))), 1);
    for (int j = 0; j < 4; ++j) {
        // chunk j of both rows: low nibbles = sub-block 2j, high nibbles = sub-block 2j + 1
        const __m512i bits = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(x0 + 16 + 32 * j))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x1 + 16 + 32 * j)), 1);
        p.wq[2 * j] = _mm512_and_si512(bits, m4);
        p.wq[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(bits, 4), m4);
        for (int h = 0; h < 2; ++h) {
            const int k = 2 * j + h;
            const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<int16_t>(k))),
                                                   _mm256_set1_epi16(static_cast<int16_t>(16 + k)), 1);
            p.ws[k] = _mm512_permutexvar_epi16(idx, sc16);
        }
    }
}

// Tables [tile][superblock], TileCols columns each, for n_cols columns, in a buffer the calling thread
// keeps (one per table type): Fill{}(table, c, y) writes column c of a superblock's table from that
// column's Q8_K block y, or zeros where y is nullptr (columns past n_cols).
template <class Table, int TileCols, class Fill>
LF_AVX512 const Table * column_tables(const uint8_t * q, size_t q_col_bytes, int64_t n_cols, int64_t nb) {
    thread_local std::vector<Table> tables;
    const int64_t n_tiles = (n_cols + TileCols - 1) / TileCols;
    if (tables.size() < static_cast<size_t>(n_tiles * nb)) {
        tables.resize(static_cast<size_t>(n_tiles * nb));
    }
    for (int64_t tile = 0; tile < n_tiles; ++tile) {
        for (int64_t i = 0; i < nb; ++i) {
            Table & t = tables[static_cast<size_t>(tile * nb + i)];
            for (int c = 0; c < TileCols; ++c) {
                const int64_t col = tile * TileCols + c;
                Fill{}(t, c,
                       col < n_cols ? q + static_cast<size_t>(col) * q_col_bytes + static_cast<size_t>(i) * kQ8_KBytes
                                    : nullptr);
            }
        }
    }
    return tables.data();
}

// The column side of one superblock for a tile of kQ4KTileCols columns, built once per call and read by
// every row pair: hadd(bsums) (the 8 int16 sums vec_dot forms per superblock), q8.d and -q8.d per
// column. With them a row's q8.d·d for the tile's columns is one vector product (IEEE products are
// rounded lane by lane: the scalar product's bits), each column's value read back by a broadcast load.
struct Q8KColumns {
    __m128i q8s[kQ4KTileCols];
    alignas(32) float yd[kQ4KTileCols];
    alignas(32) float nyd[kQ4KTileCols];
};

struct Q8KColumnsFill {
    LF_AVX512 void operator()(Q8KColumns & t, int c, const uint8_t * y) const {
        if (y == nullptr) {
            t.q8s[c] = _mm_setzero_si128();
            t.yd[c] = t.nyd[c] = 0.0f;
            return;
        }
        const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y + kQ8_KBsums));
        t.q8s[c] = _mm_hadd_epi16(_mm256_castsi256_si128(q8sums), _mm256_extracti128_si256(q8sums, 1));
        t.yd[c] = load_f32(y);
        t.nyd[c] = -t.yd[c];
    }
};

// Rows in pairs: each column's Q8_K loads serve both rows, and both rows' float steps run in one
// register (acc: lanes 0..7 row r, 8..15 row r + 1; accm: lanes 0..3 and 4..7), lane by lane the
// operations vec_dot applies to each. (Four rows at a time spill the unpacked blocks out of the 32
// registers: measured slower.) Per (row pair, column, superblock): the integer totals by
// vpmaddubsw + vpdpwssd over each sub-block of both rows at once (Q4KPair512) in two chains, added
// (exact integers, so the split changes no bit); q8.d·d and -q8.d·dmin of both rows by one product each.
LF_AVX512 void q4_k_avx512vnni(int64_t ne0, const void * w, size_t w_row_bytes, int64_t n_rows, const void * q,
                               size_t q_col_bytes, int64_t n_cols, float * out, size_t out_col_stride,
                               const RowBlockHook * hook) {
    const int64_t nb = ne0 / kQK;
    const Q8KColumns * const tables = column_tables<Q8KColumns, kQ4KTileCols, Q8KColumnsFill>(
        static_cast<const uint8_t *>(q), q_col_bytes, n_cols, nb);
    const uint8_t * const w_end = static_cast<const uint8_t *>(w) + static_cast<size_t>(n_rows) * w_row_bytes;
    const bool read_ahead = n_cols <= kReadAheadMaxCols;  // one tile: each row pair read once
    for (int64_t r0 = 0; r0 < n_rows; r0 += kRowBlock) {
        const int64_t r_end = std::min(n_rows, r0 + kRowBlock);
        for (int64_t c0 = 0; c0 < n_cols; c0 += kQ4KTileCols) {
            const int nc = static_cast<int>(std::min<int64_t>(kQ4KTileCols, n_cols - c0));
            const uint8_t * qc = static_cast<const uint8_t *>(q) + static_cast<size_t>(c0) * q_col_bytes;
            const Q8KColumns * tile = tables + (c0 / kQ4KTileCols) * nb;
            for (int64_t r = r0; r < r_end; r += 2) {
                const bool pair = r + 1 < r_end;  // else row r twice, the second result dropped
                const uint8_t * x0 = static_cast<const uint8_t *>(w) + static_cast<size_t>(r) * w_row_bytes;
                const uint8_t * x1 = pair ? x0 + w_row_bytes : x0;
                if (read_ahead) prefetch_row_ahead(x0, 2 * w_row_bytes, w_end);
                __m512 acc[kQ4KTileCols];
                __m256 accm[kQ4KTileCols];
                for (int c = 0; c < nc; ++c) {
                    acc[c] = _mm512_setzero_ps();
                    accm[c] = _mm256_setzero_ps();
                }
                for (int64_t i = 0; i < nb; ++i) {
                    Q4KPair512 b;
                    unpack_q4_k_pair_512(x0 + static_cast<size_t>(i) * kQ4_KBytes,
                                         x1 + static_cast<size_t>(i) * kQ4_KBytes, b);
                    const Q8KColumns & t = tile[i];
                    for (int c = 0; c < nc; ++c) {
                        const uint8_t * y =
                            qc + static_cast<size_t>(c) * q_col_bytes + static_cast<size_t>(i) * kQ8_KBytes;
                        // the minimum's term: (-q8.d·dmin) · madd(mins, hadd(bsums)), both rows
                        const __m256i q8s = _mm256_broadcastsi128_si256(t.q8s[c]);
                        const __m256 dm = _mm256_mul_ps(b.xdmin, _mm256_set1_ps(t.nyd[c]));
                        accm[c] = _mm256_fmadd_ps(dm, _mm256_cvtepi32_ps(_mm256_madd_epi16(b.mins16, q8s)), accm[c]);
                        // the column's sub-block k in both halves, against both rows' sub-block k
                        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                        for (int k = 0; k < 8; k += 2) {
                            const __m512i ya = _mm512_broadcast_i64x4(
                                _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y + 4 + 32 * k)));
                            const __m512i yb = _mm512_broadcast_i64x4(
                                _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y + 4 + 32 * (k + 1))));
                            s0 = _mm512_dpwssd_epi32(s0, _mm512_maddubs_epi16(b.wq[k], ya), b.ws[k]);
                            s1 = _mm512_dpwssd_epi32(s1, _mm512_maddubs_epi16(b.wq[k + 1], yb), b.ws[k + 1]);
                        }
                        // q8.d·d of each row (the scalar product's bits, lane by lane)
                        const __m512 dx = _mm512_mul_ps(b.xd, _mm512_set1_ps(t.yd[c]));
                        acc[c] = _mm512_fmadd_ps(dx, _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc[c]);
                    }
                }
                for (int c = 0; c < nc; ++c) {
                    float * o = out + static_cast<size_t>(c0 + c) * out_col_stride + r;
                    o[0] = hsum_float_8(_mm512_castps512_ps256(acc[c])) + hsum_float_4(_mm256_castps256_ps128(accm[c]));
                    if (pair) {
                        o[1] = hsum_float_8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[c]), 1))) +
                               hsum_float_4(_mm256_extractf128_ps(accm[c], 1));
                    }
                }
            }
        }
        if (hook != nullptr) (*hook)(r0, std::min(kRowBlock, n_rows - r0));  // rows now in cache
    }
}

// ---------------------------------------------------------------------------------------------
// Q6_K: a value is (6-bit q - 32) · scale; vec_dot sums q · scale and subtracts 32 · Σ scale · bsums.

LF_AVX2 void q6_k_avx2(int64_t ne0, const void * w, size_t w_row_bytes, int64_t n_rows, const void * q,
                       size_t q_col_bytes, int64_t n_cols, float * out, size_t out_col_stride,
                       const RowBlockHook * hook) {
    const int64_t nb = ne0 / kQK;
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    for (int64_t r0 = 0; r0 < n_rows; r0 += kRowBlock) {
        for (int64_t c0 = 0; c0 < n_cols; c0 += kGemmCols) {
            for (int64_t r = r0; r < std::min(n_rows, r0 + kRowBlock); ++r) {
                const uint8_t * x = static_cast<const uint8_t *>(w) + static_cast<size_t>(r) * w_row_bytes;
                const int nc = static_cast<int>(std::min<int64_t>(kGemmCols, n_cols - c0));
                const uint8_t * qc = static_cast<const uint8_t *>(q) + static_cast<size_t>(c0) * q_col_bytes;
                __m256 acc[kGemmCols];
                for (int c = 0; c < nc; ++c) {
                    acc[c] = _mm256_setzero_ps();
                }
                for (int64_t i = 0; i < nb; ++i) {
                    const uint8_t * xb = x + static_cast<size_t>(i) * kQ6_KBytes;
                    const uint8_t * ql = xb;
                    const uint8_t * qh = xb + 128;
                    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i *>(xb + 192));
                    const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
                    const float xd = _cvtsh_ss(load_u16(xb + 208));
                    // value groups g = 4j + (0..3) of 32 values each, and their int16 scales
                    __m256i wq[8], ws[8];
                    for (int j = 0; j < 2; ++j) {
                        const __m256i bits1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(ql + 64 * j));
                        const __m256i bits2 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(ql + 64 * j + 32));
                        const __m256i bitsh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qh + 32 * j));
                        const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(bitsh, m3), 4);
                        const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(bitsh, _mm256_set1_epi8(12)), 2);
                        const __m256i h2 = _mm256_and_si256(bitsh, _mm256_set1_epi8(48));
                        const __m256i h3 = _mm256_srli_epi16(_mm256_and_si256(bitsh, _mm256_set1_epi8(-64)), 2);
                        wq[4 * j + 0] = _mm256_or_si256(_mm256_and_si256(bits1, m15), h0);
                        wq[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(bits2, m15), h1);
                        wq[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits1, 4), m15), h2);
                        wq[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits2, 4), m15), h3);
                        for (int g = 0; g < 4; ++g) {
                            const int is = 4 * j + g;  // scales 2·is (values 0..15 of the group), 2·is + 1
                            const __m128i pair =
                                _mm_unpacklo_epi64(_mm_set1_epi8(static_cast<char>(xb[192 + 2 * is])),
                                                   _mm_set1_epi8(static_cast<char>(xb[192 + 2 * is + 1])));
                            ws[is] = _mm256_cvtepi8_epi16(pair);
                        }
                    }
                    for (int c = 0; c < nc; ++c) {
                        const uint8_t * y =
                            qc + static_cast<size_t>(c) * q_col_bytes + static_cast<size_t>(i) * kQ8_KBytes;
                        const float yd = load_f32(y);
                        const __m256i q8sums = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y + kQ8_KBsums));
                        const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
                        __m256i sumi = _mm256_setzero_si256();
                        for (int g = 0; g < 8; ++g) {
                            const __m256i q8 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y + 4 + 32 * g));
                            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(ws[g], _mm256_maddubs_epi16(wq[g], q8)));
                        }
                        sumi = _mm256_sub_epi32(sumi, q8sclsub);
                        acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(yd * xd), _mm256_cvtepi32_ps(sumi), acc[c]);
                    }
                }
                for (int c = 0; c < nc; ++c) {
                    out[static_cast<size_t>(c0 + c) * out_col_stride + r] = hsum_float_8(acc[c]);
                }
            }
        }
        if (hook != nullptr) (*hook)(r0, std::min(kRowBlock, n_rows - r0));  // rows now in cache
    }
}

// One Q6_K superblock unpacked for the AVX-512 kernel. Half j, pair p (register 2j + p): value groups
// 4j + 2p and 4j + 2p + 1 (32 values each), groups 0/1 from ql's low nibbles, 2/3 from its high ones;
// qh's bit pairs 0,1 / 2,3 / 4,5 / 6,7 are the high bits of groups 0 / 1 / 2 / 3. Scales as int16, 8
// lanes each: [sc[8j + 4p] sc[8j + 4p + 1] sc[8j + 4p + 2] sc[8j + 4p + 3]].
struct Q6KBlock512 {
    __m512i wq[4], ws[4];
    __m256i scales16;  // the 16 scales as int16, for the 32 · Σ scale · bsums term
    float xd;
};

LF_AVX512 inline __attribute__((always_inline)) void unpack_q6_k_512(const uint8_t * xb, Q6KBlock512 & b) {
    const __m512i m3 = _mm512_set1_epi8(3), m15 = _mm512_set1_epi8(15);
    const uint8_t * ql = xb;
    const uint8_t * qh = xb + 128;
    b.scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(xb + 192)));
    b.xd = _cvtsh_ss(load_u16(xb + 208));
    const __m512i sc512 = _mm512_castsi256_si512(b.scales16);
    for (int j = 0; j < 2; ++j) {
        const __m512i bits = _mm512_loadu_si512(ql + 64 * j);
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qh + 32 * j));
        const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
        const __m512i h23 =
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(h, 4)), _mm256_srli_epi16(h, 6), 1);
        b.wq[2 * j] = _mm512_or_si512(_mm512_and_si512(bits, m15), _mm512_slli_epi16(_mm512_and_si512(h01, m3), 4));
        b.wq[2 * j + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bits, 4), m15),
                                          _mm512_slli_epi16(_mm512_and_si512(h23, m3), 4));
        for (int p = 0; p < 2; ++p) {
            const int16_t s0 = static_cast<int16_t>(8 * j + 4 * p);
            const __m512i idx = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_setr_m128i(_mm_set1_epi16(s0), _mm_set1_epi16(s0 + 1))),
                _mm256_setr_m128i(_mm_set1_epi16(s0 + 2), _mm_set1_epi16(s0 + 3)), 1);
            b.ws[2 * j + p] = _mm512_permutexvar_epi16(idx, sc512);
        }
    }
}

// The column side of one superblock for a tile of kQ6KTileCols columns, built once per call: each
// column's 16 bsums and q8.d.
struct Q6KColumns {
    __m256i bsums[kQ6KTileCols];
    alignas(32) float yd[kQ6KTileCols];
};

struct Q6KColumnsFill {
    LF_AVX512 void operator()(Q6KColumns & t, int c, const uint8_t * y) const {
        t.bsums[c] = y != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y + kQ8_KBsums))
                                  : _mm256_setzero_si256();
        t.yd[c] = y != nullptr ? load_f32(y) : 0.0f;
    }
};

// Rows in pairs, as the Q4_K kernel: both rows' integer totals folded, less 32 · Σ scale · bsums, in one
// register (lanes 0..7 row r, 8..15 row r + 1), then one conversion and one multiply-add for both.
LF_AVX512 void q6_k_avx512vnni(int64_t ne0, const void * w, size_t w_row_bytes, int64_t n_rows, const void * q,
                               size_t q_col_bytes, int64_t n_cols, float * out, size_t out_col_stride,
                               const RowBlockHook * hook) {
    const int64_t nb = ne0 / kQK;
    const Q6KColumns * const tables = column_tables<Q6KColumns, kQ6KTileCols, Q6KColumnsFill>(
        static_cast<const uint8_t *>(q), q_col_bytes, n_cols, nb);
    const uint8_t * const w_end = static_cast<const uint8_t *>(w) + static_cast<size_t>(n_rows) * w_row_bytes;
    const bool read_ahead = n_cols <= kReadAheadMaxCols;  // one tile: each row pair read once
    for (int64_t r0 = 0; r0 < n_rows; r0 += kRowBlock) {
        const int64_t r_end = std::min(n_rows, r0 + kRowBlock);
        for (int64_t c0 = 0; c0 < n_cols; c0 += kQ6KTileCols) {
            const int nc = static_cast<int>(std::min<int64_t>(kQ6KTileCols, n_cols - c0));
            const uint8_t * qc = static_cast<const uint8_t *>(q) + static_cast<size_t>(c0) * q_col_bytes;
            const Q6KColumns * tile = tables + (c0 / kQ6KTileCols) * nb;
            for (int64_t r = r0; r < r_end; r += 2) {
                const bool pair = r + 1 < r_end;  // else row r twice, the second result dropped
                const uint8_t * x0 = static_cast<const uint8_t *>(w) + static_cast<size_t>(r) * w_row_bytes;
                const uint8_t * x1 = pair ? x0 + w_row_bytes : x0;
                if (read_ahead) prefetch_row_ahead(x0, 2 * w_row_bytes, w_end);
                __m512 acc[kQ6KTileCols];
                for (int c = 0; c < nc; ++c) {
                    acc[c] = _mm512_setzero_ps();
                }
                for (int64_t i = 0; i < nb; ++i) {
                    Q6KBlock512 b0, b1;
                    unpack_q6_k_512(x0 + static_cast<size_t>(i) * kQ6_KBytes, b0);
                    unpack_q6_k_512(x1 + static_cast<size_t>(i) * kQ6_KBytes, b1);
                    const __m512i scales16 = _mm512_inserti64x4(_mm512_castsi256_si512(b0.scales16), b1.scales16, 1);
                    const Q6KColumns & t = tile[i];
                    alignas(32) float dx0[kQ6KTileCols], dx1[kQ6KTileCols];
                    for (int g = 0; g < nc; g += 8) {
                        const __m256 yd = _mm256_load_ps(t.yd + g);
                        _mm256_store_ps(dx0 + g, _mm256_mul_ps(yd, _mm256_set1_ps(b0.xd)));
                        _mm256_store_ps(dx1 + g, _mm256_mul_ps(yd, _mm256_set1_ps(b1.xd)));
                    }
                    for (int c = 0; c < nc; ++c) {
                        const uint8_t * y =
                            qc + static_cast<size_t>(c) * q_col_bytes + static_cast<size_t>(i) * kQ8_KBytes;
                        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                        __m512i u0 = _mm512_setzero_si512(), u1 = _mm512_setzero_si512();
                        for (int k = 0; k < 4; k += 2) {
                            const __m512i q8 = _mm512_loadu_si512(y + 4 + 64 * k);
                            const __m512i q8n = _mm512_loadu_si512(y + 4 + 64 * (k + 1));
                            s0 = _mm512_dpwssd_epi32(s0, _mm512_maddubs_epi16(b0.wq[k], q8), b0.ws[k]);
                            s1 = _mm512_dpwssd_epi32(s1, _mm512_maddubs_epi16(b1.wq[k], q8), b1.ws[k]);
                            u0 = _mm512_dpwssd_epi32(u0, _mm512_maddubs_epi16(b0.wq[k + 1], q8n), b0.ws[k + 1]);
                            u1 = _mm512_dpwssd_epi32(u1, _mm512_maddubs_epi16(b1.wq[k + 1], q8n), b1.ws[k + 1]);
                        }
                        s0 = _mm512_add_epi32(s0, u0);
                        s1 = _mm512_add_epi32(s1, u1);
                        // 32 · Σ scale · bsums of both rows: the column's bsums in both halves
                        const __m512i sub =
                            _mm512_slli_epi32(_mm512_madd_epi16(_mm512_broadcast_i64x4(t.bsums[c]), scales16), 5);
                        const __m512i sumi = _mm512_sub_epi32(
                            _mm512_add_epi32(_mm512_shuffle_i64x2(s0, s1, 0x44), _mm512_shuffle_i64x2(s0, s1, 0xEE)),
                            sub);
                        const __m512 dx = _mm512_castpd_ps(
                            _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(dx0[c]))),
                                               _mm256_castps_pd(_mm256_set1_ps(dx1[c])), 1));
                        acc[c] = _mm512_fmadd_ps(dx, _mm512_cvtepi32_ps(sumi), acc[c]);
                    }
                }
                for (int c = 0; c < nc; ++c) {
                    float * o = out + static_cast<size_t>(c0 + c) * out_col_stride + r;
                    o[0] = hsum_float_8(_mm512_castps512_ps256(acc[c]));
                    if (pair) {
                        o[1] = hsum_float_8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[c]), 1)));
                    }
                }
            }
        }
        if (hook != nullptr) (*hook)(r0, std::min(kRowBlock, n_rows - r0));  // rows now in cache
    }
}

}  // namespace gemm
}  // namespace llamaflash

#endif  // LLAMAFLASH_GEMM_X86
