// down_t_axpy.cpp: experiment, not production code. It measures the sparse kernel's down_t
// accumulation (acc += sum_r h_r * dequant(row_r), Q8_0 rows of n_embd 1536, Qwen2.5-1.5B's shape)
// on one thread. It is the evidence behind "VNNI does not pay while rows come from DRAM" in the
// closing notes.
//   mode 0  the production AVX-512 float path (csrc/sparse_axpy.cpp)
//   mode 1  an integer candidate: h*d quantized to int8 per group of 4 rows and block of 32;
//           vpermt2b interleaves 4 rows' bytes, then vpdpbusd (needs AVX512-VNNI and VBMI)
//   mode 2  touch only: the same rows loaded and nothing computed (the memory side alone)
// Rows: a fraction `a` of 8960 rows, chosen at random, selected per layer; 8 layers in rotation,
// 117 MB, so the rows come from DRAM (hot=0). hot=1 reuses one layer (L3), hot=2 reuses 64 rows
// (L2: compute alone). Env: CS rows per call (32), PF software prefetch of a call's rows (1),
// AHEAD=1 prefetches the next call's rows before this call computes.
// Build and run (from the repo root, ggml headers as CMakeLists.txt fetches them):
//   g++ -O2 -std=c++17 -Icsrc -I$HOME/.cache/llamaflash/ggml-headers-0.3.36/include \
//       bench/experiments/down_t_axpy.cpp csrc/sparse_axpy.cpp -L$LIB -lggml-base -Wl,-rpath,$LIB -o /tmp/axpy
//   (LIB = the llama_cpp/lib folder of the venv)
//   for m in 0 1 2; do for hot in 0 2; do /tmp/axpy 0.7 $m $hot; done; done
// Measured 2026-11-22 (AMD EPYC Zen 4, ns per row, a = 0.7): L2-resident float 75, int8 59, touch 18;
// from DRAM float 180-245, int8 180-225, touch 95-128. The integer path saves compute, but from DRAM
// both run at the same speed: one core's reads of scattered rows are the limit.
#include "sparse_axpy.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512dq,f16c,fma")))

using namespace llamaflash;

namespace {
struct GroupParams { int32_t mult, off; float scl; };
// params for one group of 4 rows over nb blocks
TGT void prep(const uint16_t * dh_rows, int64_t dstride, const float * h, int64_t nb, int32_t * mult, int32_t * off, float * scl) {
    const __m512i lane = _mm512_setr_epi32(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15);
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const __mmask16 k = nb - b0 >= 16 ? 0xffff : (__mmask16)((1u << (nb - b0)) - 1);
        const __m512i idx = _mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32((int)b0)), _mm512_set1_epi32(34));
        __m512 s[4];
        __m512 S = _mm512_setzero_ps();
        for (int r = 0; r < 4; ++r) {
            __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, dh_rows + r * dstride + b0));
            s[r] = _mm512_mul_ps(d, _mm512_set1_ps(h[r]));
            S = _mm512_max_ps(S, _mm512_abs_ps(s[r]));
        }
        const __mmask16 nz = _mm512_cmp_ps_mask(S, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 inv = _mm512_maskz_div_ps(nz, _mm512_set1_ps(127.0f), S);
        __m512i packed = _mm512_setzero_si512(), sum = _mm512_setzero_si512();
        for (int r = 0; r < 4; ++r) {
            __m512i m = _mm512_cvtps_epi32(_mm512_mul_ps(s[r], inv));
            sum = _mm512_add_epi32(sum, m);
            packed = _mm512_or_si512(packed, _mm512_slli_epi32(_mm512_and_si512(m, _mm512_set1_epi32(255)), 8 * r));
        }
        _mm512_mask_storeu_epi32(mult + b0, k, packed);
        _mm512_mask_storeu_epi32(off + b0, k, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-128)));
        _mm512_mask_storeu_ps(scl + b0, k, _mm512_mul_ps(S, _mm512_set1_ps(1.0f / 127.0f)));
    }
}
TGT void axpy_vnni(float * acc, const uint8_t * const * rows_in, const float * h_in, int n, int64_t n_embd) {
    const int64_t nb = n_embd / 32;
    constexpr int kG = 8;
    thread_local std::vector<int32_t> buf;
    if ((int64_t)buf.size() < 3 * kG * nb) buf.resize(3 * kG * nb);
    alignas(64) static const uint8_t idx_lo[64] = {
#define I4(j) (uint8_t)(j), (uint8_t)(32 + (j)), (uint8_t)(64 + (j)), (uint8_t)(96 + (j))
        I4(0),I4(1),I4(2),I4(3),I4(4),I4(5),I4(6),I4(7),I4(8),I4(9),I4(10),I4(11),I4(12),I4(13),I4(14),I4(15)};
    alignas(64) static const uint8_t idx_hi[64] = {
        I4(16),I4(17),I4(18),I4(19),I4(20),I4(21),I4(22),I4(23),I4(24),I4(25),I4(26),I4(27),I4(28),I4(29),I4(30),I4(31)};
#undef I4
    const __m512i vlo = _mm512_load_si512(idx_lo), vhi = _mm512_load_si512(idx_hi);
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int r0 = 0; r0 < n; r0 += 4 * kG) {
        const int ng = std::min(kG, (n - r0 + 3) / 4);
        const uint8_t * rows[4 * kG];
        float h[4 * kG];
        for (int i = 0; i < 4 * ng; ++i) {
            const int r = r0 + i;
            rows[i] = r < n ? rows_in[r] : rows_in[r0];
            h[i] = r < n ? h_in[r] : 0.0f;
        }
        int32_t * mult = buf.data(); int32_t * off = mult + kG * nb; float * scl = reinterpret_cast<float *>(off + kG * nb);
        thread_local std::vector<uint16_t> dhb;
        if ((int64_t)dhb.size() < 4 * kG * nb) dhb.resize(4 * kG * nb);
        for (int i = 0; i < 4 * ng; ++i) {
            const uint8_t * p = rows[i]; uint16_t * d = dhb.data() + i * nb;
            for (int64_t b = 0; b < nb; ++b) std::memcpy(d + b, p + b * 34, 2);
        }
        for (int g = 0; g < ng; ++g) prep(dhb.data() + 4 * g * nb, nb, h + 4 * g, nb, mult + g * nb, off + g * nb, scl + g * nb);
        for (int64_t b = 0; b < nb; ++b) {
            __m512 y0 = _mm512_loadu_ps(acc + 32 * b), y1 = _mm512_loadu_ps(acc + 32 * b + 16);
            const size_t o = b * 34 + 2;
            for (int g = 0; g < ng; ++g) {
                const uint8_t * const * rg = rows + 4 * g;
                __m512i A = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(rg[0] + o))),
                                               _mm256_loadu_si256((const __m256i *)(rg[1] + o)), 1);
                __m512i B = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(rg[2] + o))),
                                               _mm256_loadu_si256((const __m256i *)(rg[3] + o)), 1);
                A = _mm512_xor_si512(A, bias); B = _mm512_xor_si512(B, bias);
                const __m512i P0 = _mm512_permutex2var_epi8(A, vlo, B), P1 = _mm512_permutex2var_epi8(A, vhi, B);
                const __m512i m = _mm512_set1_epi32(mult[g * nb + b]), of = _mm512_set1_epi32(off[g * nb + b]);
                const __m512 sc = _mm512_set1_ps(scl[g * nb + b]);
                y0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(of, P0, m)), sc, y0);
                y1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(of, P1, m)), sc, y1);
            }
            _mm512_storeu_ps(acc + 32 * b, y0); _mm512_storeu_ps(acc + 32 * b + 16, y1);
        }
    }
}
}  // namespace

__attribute__((target("avx512f"))) static void touch(float* acc, const uint8_t* const* rows, const float* h, int n, int64_t n_embd) {
    __m512i x = _mm512_setzero_si512();
    const int64_t rb = n_embd / 32 * 34;
    for (int r = 0; r < n; ++r) for (int64_t o = 0; o + 64 <= rb; o += 64) x = _mm512_xor_si512(x, _mm512_loadu_si512(rows[r] + o));
    acc[0] += (float)_mm512_reduce_add_epi32(x);
}

int main(int argc, char** argv) {
    const int n_ff = 8960, n_embd = 1536, nl = 8;
    const double a = argc > 1 ? atof(argv[1]) : 0.7;
    const int mode = argc > 2 ? atoi(argv[2]) : 0;  // 0 current, 1 candidate
    const int hot = argc > 3 ? atoi(argv[3]) : 0;
    const size_t rb = n_embd / 32 * 34;
    std::vector<uint8_t> w((size_t)nl * n_ff * rb);
    std::mt19937 rng(1);
    for (size_t i = 0; i < w.size(); i += 34) {
        uint16_t d = ggml_fp32_to_fp16(0.001f * (1 + rng() % 100));
        memcpy(&w[i], &d, 2);
        for (int j = 0; j < 32; ++j) w[i + 2 + j] = (uint8_t)(rng() % 255 - 127);
    }
    std::vector<float> acc(n_embd, 0.f), acc2(n_embd, 0.f);
    AxpyFn f = mode == 0 ? pick_axpy(GGML_TYPE_Q8_0, SparseIsa::avx512) : mode == 1 ? axpy_vnni : touch;
    std::vector<std::vector<int>> sel(nl);
    for (int l = 0; l < nl; ++l) for (int i = 0; i < n_ff; ++i) if (std::uniform_real_distribution<>(0,1)(rng) < a) sel[l].push_back(i);
    std::vector<float> h(n_ff);
    for (auto & v : h) v = std::uniform_real_distribution<float>(-1, 1)(rng);
    const int CS = getenv("CS") ? atoi(getenv("CS")) : 32; const int PF = getenv("PF") ? atoi(getenv("PF")) : 1; const uint8_t* rows[256]; float hs[256];
    double best = 1e9; size_t bytes = 0;
    for (int rep = 0; rep < 30; ++rep) {
        auto t0 = std::chrono::steady_clock::now();
        bytes = 0;
        for (int l = 0; l < nl; ++l) {
            const int L = hot ? 0 : l;
            const uint8_t* base = w.data() + (size_t)L * n_ff * rb;
            const int L2only = hot == 2;
            const auto & s = sel[L];
            const int AHEAD = getenv("AHEAD") ? atoi(getenv("AHEAD")) : 0;
            auto rowp = [&](size_t k) { return base + (size_t)(L2only ? s[k] % 64 : s[k]) * rb; };
            if (AHEAD) for (size_t k = 0; k < std::min(s.size(), (size_t)CS); ++k) for (size_t o = 0; o < rb; o += 64) __builtin_prefetch(rowp(k) + o, 0, 2);
            for (size_t k0 = 0; k0 < s.size(); k0 += CS) {
                int m = 0;
                for (size_t k = k0; k < std::min(s.size(), k0 + CS); ++k) {
                    rows[m] = rowp(k); hs[m] = h[s[k]];
                    if (!AHEAD && PF) for (size_t o = 0; o < rb; o += 64) __builtin_prefetch(rows[m] + o, 0, 2);
                    if (AHEAD && k + CS < s.size()) for (size_t o = 0; o < rb; o += 64) __builtin_prefetch(rowp(k + CS) + o, 0, 2);
                    ++m;
                }
                f(acc.data(), rows, hs, m, n_embd);
                bytes += m * rb;
            }
        }
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, dt);
    }
    // check vs reference
    std::fill(acc.begin(), acc.end(), 0.f); std::fill(acc2.begin(), acc2.end(), 0.f);
    {
        const auto & s = sel[0]; int m = 0;
        for (size_t k = 0; k < 32 && k < s.size(); ++k) { rows[m] = w.data() + (size_t)s[k]*rb; hs[m] = h[s[k]]; ++m; }
        pick_axpy(GGML_TYPE_Q8_0, SparseIsa::scalar)(acc.data(), rows, hs, m, n_embd);
        f(acc2.data(), rows, hs, m, n_embd);
        double num = 0, den = 0; for (int j = 0; j < n_embd; ++j) { num += (acc[j]-acc2[j])*(acc[j]-acc2[j]); den += acc[j]*acc[j]; }
        printf("rel err %.2e  ", sqrt(num/den));
    }
    printf("a=%.2f mode=%d hot=%d: %.2f ms per %d layers, %.1f GB/s, %.1f ns/row\n", a, mode, hot, best*1e3, nl, bytes/best/1e9, best*1e9/(bytes/rb));
}
