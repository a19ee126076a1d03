/* contextdeque fused relocate + rank-m patch on CPU.
 *
 * A call runs a list of jobs (one job = one cache tensor [H, T, D] of one layer) in one OpenMP
 * region; work item = (job, tile of tokens), all heads. Per item and head:
 *   S[t][:] = U_tile[t][:] @ W_h      (patched jobs only: register-blocked rank-m product, fp32
 *                                      FMA, into per-thread scratch that stays in L1/L2)
 *   then one pass per row: x = fp32(content row) + S[t]; rotate the rope pairs of x (fp32);
 *   round once to the destination dtype; store the row at its destination (contiguous or slot).
 * Memory sees one read of the content and one write of the destination. Unpatched jobs run
 * token-major (each token's cos/sin row serves every head); unpatched, unrotated rows of one
 * dtype are plain copies.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#if defined(__AVX512F__)
#define VW 16
#define G 6
#else
#define VW 8
#define G 2
#endif
#define CW (4 * VW) /* channel chunk of the register block: 4 vectors */
#define TB 48       /* tokens per work item with a patch (S, U scratch rows) */
#define TB0 192     /* tokens per work item without one: longer sequential streams per head */

#define INL static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));

INL vf vld(const float *p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
INL void vst(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

/* ---- dtype conversion: scalar (generic path) and one vector of VW lanes (fast path) ---- */
INL float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; __builtin_memcpy(&f, &u, 4); return f;
}
INL uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u; __builtin_memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? ((u >> 16) | 0x40u) : r);
}
INL int64_t esize(int dt) { return dt == DT_F32 ? 4 : 2; }

INL vf vld_cvt(const char *p, int dt) {
    if (dt == DT_F32) return vld((const float *)p);
    if (dt == DT_BF16) {
        vu16 h; __builtin_memcpy(&h, p, sizeof h);
        return (vf)(__builtin_convertvector(h, vu32) << 16);
    }
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && VW == 8
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf v; const _Float16 *s = (const _Float16 *)p;
    for (int i = 0; i < VW; i++) v[i] = (float)s[i];
    return v;
#endif
}

#if defined(__AVX512F__)
/* nonzero if any lane is a nonzero fp32 subnormal */
INL int any_subnormal(vf x) {
#if defined(__AVX512DQ__)
    return _mm512_fpclass_ps_mask((__m512)x, 0x20) != 0;
#else
    vu32 a = ((vu32)x & 0x7fffffffu) - 1u;
    return _mm512_cmplt_epu32_mask((__m512i)a, _mm512_set1_epi32(0x007fffff)) != 0;
#endif
}
#endif

INL void vst_cvt(char *p, vf x, int dt) {
    if (dt == DT_F32) { vst((float *)p, x); return; }
    if (dt == DT_BF16) {
        vu32 u = (vu32)x;
#if defined(__AVX512BF16__) && VW == 16
        /* The instruction rounds to nearest even like the bit trick below, but treats fp32
         * subnormal inputs as zero: use it only when no lane is a nonzero subnormal. */
        if (__builtin_expect(!any_subnormal(x), 1)) {
            __m256bh h = _mm512_cvtneps_pbh((__m512)x);
            __builtin_memcpy(p, &h, sizeof h);
            return;
        }
#endif
        vu32 r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        vu32 nan = (vu32)((u & 0x7fffffffu) > 0x7f800000u);
        r = (r & ~nan) | (((u >> 16) | 0x40u) & nan);
        vu16 h = __builtin_convertvector(r, vu16);
        __builtin_memcpy(p, &h, sizeof h);
        return;
    }
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__) && VW == 8
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    _Float16 *d = (_Float16 *)p;
    for (int i = 0; i < VW; i++) d[i] = (_Float16)x[i];
#endif
}

/* Streaming (non-temporal) stores skip the read-for-ownership of destination lines: worth it
 * when a call writes far more than the caches hold (the caller decides: `nt`). */
INL int stream_ok(const void *p, int64_t bytes, int nt) {
    return nt && ((uintptr_t)p & 63) == 0 && (bytes & 63) == 0;
}

INL void copy_bytes(char *restrict dst, const char *restrict src, int64_t bytes, int nt) {
#if defined(__AVX512F__)
    if (stream_ok(dst, bytes, nt)) {
        for (int64_t i = 0; i < bytes; i += 64)
            _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
        return;
    }
#else
    (void)nt;
#endif
    memcpy(dst, src, (size_t)bytes);
}

#if defined(__AVX512F__)
INL int any_subnormal4(vf a, vf b, vf c, vf d) {
#if defined(__AVX512DQ__)
    return (_mm512_fpclass_ps_mask((__m512)a, 0x20) | _mm512_fpclass_ps_mask((__m512)b, 0x20) |
            _mm512_fpclass_ps_mask((__m512)c, 0x20) | _mm512_fpclass_ps_mask((__m512)d, 0x20)) != 0;
#else
    return any_subnormal(a) || any_subnormal(b) || any_subnormal(c) || any_subnormal(d);
#endif
}

/* one 64-byte line, streaming when asked and aligned */
INL void st_line(char *p, __m512i line, int nt) {
    if (nt && ((uintptr_t)p & 63) == 0) _mm512_stream_si512((void *)p, line);
    else _mm512_storeu_si512((void *)p, line);
}
#endif

/* Round two vectors (2*VW consecutive channels) to dtype dt and store them at p; a full 64-byte
 * line goes out in one store (streaming when asked and aligned). */
INL void vst2_cvt(char *p, vf y0, vf y1, int dt, int nt) {
#if defined(__AVX512F__)
    __m512i line;
    if (dt == DT_F32) { /* each vector is a line already */
        st_line(p, _mm512_castps_si512((__m512)y0), nt);
        st_line(p + VW * 4, _mm512_castps_si512((__m512)y1), nt);
        return;
    } else if (dt == DT_F16) {
        __m256i h0 = _mm512_cvtps_ph((__m512)y0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i h1 = _mm512_cvtps_ph((__m512)y1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        line = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
    } else {
#if defined(__AVX512BF16__)
        /* the instruction rounds to nearest even like the bit trick, but treats subnormal inputs
         * as zero: use it only when no lane is a nonzero subnormal */
        if (__builtin_expect(any_subnormal(y0) || any_subnormal(y1), 0)) {
            vst_cvt(p, y0, dt);
            vst_cvt(p + VW * 2, y1, dt);
            return;
        }
        line = (__m512i)_mm512_cvtne2ps_pbh((__m512)y1, (__m512)y0);
#else
        vst_cvt(p, y0, dt);
        vst_cvt(p + VW * 2, y1, dt);
        return;
#endif
    }
    st_line(p, line, nt);
#else
    (void)nt;
    vst_cvt(p, y0, dt);
    vst_cvt(p + VW * esize(dt), y1, dt);
#endif
}

INL void load_row(float *restrict dst, const char *restrict src, int64_t n, int dt) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = dt == DT_F32 ? ((const float *)src)[i]
               : dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)src)[i])
                               : (float)((const _Float16 *)src)[i];
}

INL void store_row(char *restrict dst, const float *restrict src, int64_t n, int dt) {
    for (int64_t i = 0; i < n; i++) {
        if (dt == DT_F32) ((float *)dst)[i] = src[i];
        else if (dt == DT_BF16) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
        else ((_Float16 *)dst)[i] = (_Float16)src[i];
    }
}

/* ---- rank-m product: S[tb][DP] = U[tb][m] @ W[m][DP] (W rows ws apart); DP is a multiple of VW ---- */
static void rank_product(float *restrict S, const float *restrict U, const float *restrict W,
                         int64_t tb, int64_t m, int64_t DP, int64_t ws) {
    int64_t c0 = 0;
    for (; c0 + CW <= DP; c0 += CW) {
        int64_t t = 0;
        for (; t + G <= tb; t += G) {
            vf acc[G][4];
#pragma GCC unroll 8
            for (int g = 0; g < G; g++)
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) acc[g][q] = (vf){0};
            for (int64_t j = 0; j < m; j++) {
                const float *wr = W + j * ws + c0;
                vf w0 = vld(wr), w1 = vld(wr + VW), w2 = vld(wr + 2 * VW), w3 = vld(wr + 3 * VW);
#pragma GCC unroll 8
                for (int g = 0; g < G; g++) {
                    vf ub = (vf){0} + U[(t + g) * m + j];
                    acc[g][0] += ub * w0; acc[g][1] += ub * w1;
                    acc[g][2] += ub * w2; acc[g][3] += ub * w3;
                }
            }
#pragma GCC unroll 8
            for (int g = 0; g < G; g++)
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) vst(S + (t + g) * DP + c0 + q * VW, acc[g][q]);
        }
        for (; t < tb; t++) {
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t j = 0; j < m; j++) {
                const float *wr = W + j * ws + c0;
                vf ub = (vf){0} + U[t * m + j];
                a0 += ub * vld(wr); a1 += ub * vld(wr + VW);
                a2 += ub * vld(wr + 2 * VW); a3 += ub * vld(wr + 3 * VW);
            }
            float *s = S + t * DP + c0;
            vst(s, a0); vst(s + VW, a1); vst(s + 2 * VW, a2); vst(s + 3 * VW, a3);
        }
    }
    for (; c0 < DP; c0 += VW) {
        for (int64_t t = 0; t < tb; t++) {
            vf a = {0};
            for (int64_t j = 0; j < m; j++) a += ((vf){0} + U[t * m + j]) * vld(W + j * ws + c0);
            vst(S + t * DP + c0, a);
        }
    }
}

#if defined(__AVX512BF16__) && VW == 16
#define HAVE_DPBF16 1
/* bf16 factors: S[tb][DP] = U2[tb][m2] @ W2[m2][DP], where U2[t][q] holds the bf16 pair
 * (u[t][2q], u[t][2q+1]) and W2[q][c] the pair (w[2q][c], w[2q+1][c]): one vdpbf16ps does two of
 * the m products per lane (exact bf16 products, fp32 sums; subnormal bf16 inputs count as zero),
 * twice the rate of the fp32 FMA path. Same register blocking as rank_product. */
static void rank_product_bf16(float *restrict S, const uint32_t *restrict U2, const uint32_t *restrict W2,
                              int64_t tb, int64_t m2, int64_t DP) {
    int64_t c0 = 0;
    for (; c0 + CW <= DP; c0 += CW) {
        int64_t t = 0;
        for (; t + G <= tb; t += G) {
            __m512 acc[G][4];
#pragma GCC unroll 8
            for (int g = 0; g < G; g++)
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) acc[g][q] = _mm512_setzero_ps();
            for (int64_t j = 0; j < m2; j++) {
                const uint32_t *wr = W2 + j * DP + c0;
                __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr), w1 = (__m512bh)_mm512_loadu_si512(wr + VW);
                __m512bh w2 = (__m512bh)_mm512_loadu_si512(wr + 2 * VW), w3 = (__m512bh)_mm512_loadu_si512(wr + 3 * VW);
#pragma GCC unroll 8
                for (int g = 0; g < G; g++) {
                    __m512bh ub = (__m512bh)_mm512_set1_epi32((int)U2[(t + g) * m2 + j]);
                    acc[g][0] = _mm512_dpbf16_ps(acc[g][0], ub, w0);
                    acc[g][1] = _mm512_dpbf16_ps(acc[g][1], ub, w1);
                    acc[g][2] = _mm512_dpbf16_ps(acc[g][2], ub, w2);
                    acc[g][3] = _mm512_dpbf16_ps(acc[g][3], ub, w3);
                }
            }
#pragma GCC unroll 8
            for (int g = 0; g < G; g++)
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) _mm512_storeu_ps(S + (t + g) * DP + c0 + q * VW, acc[g][q]);
        }
        for (; t < tb; t++) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t j = 0; j < m2; j++) {
                const uint32_t *wr = W2 + j * DP + c0;
                __m512bh ub = (__m512bh)_mm512_set1_epi32((int)U2[t * m2 + j]);
                a0 = _mm512_dpbf16_ps(a0, ub, (__m512bh)_mm512_loadu_si512(wr));
                a1 = _mm512_dpbf16_ps(a1, ub, (__m512bh)_mm512_loadu_si512(wr + VW));
                a2 = _mm512_dpbf16_ps(a2, ub, (__m512bh)_mm512_loadu_si512(wr + 2 * VW));
                a3 = _mm512_dpbf16_ps(a3, ub, (__m512bh)_mm512_loadu_si512(wr + 3 * VW));
            }
            float *s = S + t * DP + c0;
            _mm512_storeu_ps(s, a0); _mm512_storeu_ps(s + VW, a1);
            _mm512_storeu_ps(s + 2 * VW, a2); _mm512_storeu_ps(s + 3 * VW, a3);
        }
    }
    for (; c0 < DP; c0 += VW) {
        for (int64_t t = 0; t < tb; t++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t j = 0; j < m2; j++)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi32((int)U2[t * m2 + j]),
                                     (__m512bh)_mm512_loadu_si512(W2 + j * DP + c0));
            _mm512_storeu_ps(S + t * DP + c0, a);
        }
    }
}

/* W2[q][c] = (w[2q][c], w[2q+1][c]) for c < D (zero beyond, and for a missing odd row) */
static void pack_w_bf16(uint32_t *restrict W2, const uint16_t *restrict w, int64_t w_sr, int64_t m,
                        int64_t D, int64_t DP) {
    for (int64_t q = 0; q < (m + 1) / 2; q++) {
        const uint16_t *r0 = w + 2 * q * w_sr, *r1 = 2 * q + 1 < m ? r0 + w_sr : 0;
        uint32_t *o = W2 + q * DP;
        int64_t c = 0;
        for (; c + VW <= D; c += VW) {
            __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r0 + c)));
            __m512i hi = r1 ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r1 + c))), 16)
                            : _mm512_setzero_si512();
            _mm512_storeu_si512(o + c, _mm512_or_si512(lo, hi));
        }
        for (; c < DP; c++) o[c] = c < D ? (uint32_t)r0[c] | (r1 ? (uint32_t)r1[c] << 16 : 0u) : 0u;
    }
}
#else
#define HAVE_DPBF16 0
#endif

/* ---- job parameters (one block of P_COUNT int64 per job; kept in sync with native.py) ---- */
enum {
    P_CONTENT, P_C_SH, P_C_ST, P_H, P_T, P_D, P_DT_IN,
    P_U, P_U_ST, P_M, P_DT_U, P_W, P_W_SR, P_DT_W,
    P_COS, P_SIN, P_CS_ST, P_ROPE_START, P_HALF, P_INTERLEAVED,
    P_OUT, P_O_SH, P_O_ST, P_DT_OUT,
    P_SLOTS, P_BLOCK_SIZE, P_O_SBLK, P_O_SOFF, P_NUM_SLOTS,
    P_COUNT
};

int cd_param_count(void) { return P_COUNT; }
int cd_vector_width(void) { return VW; }

INL int64_t padded(int64_t d) { return (d + VW - 1) / VW * VW; }
#define PAR_MIN_WORK 65536.0
INL int64_t tile_of(const int64_t *p) { return p[P_U] && p[P_M] > 0 ? TB : TB0; }

#if VW == 16
#define DUP_IDX {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7}
#define SWAP_IDX {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}
#define SIGN_ALT {-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1}
#else
#define DUP_IDX {0, 0, 1, 1, 2, 2, 3, 3}
#define SWAP_IDX {1, 0, 3, 2, 5, 4, 7, 6}
#define SIGN_ALT {-1, 1, -1, 1, -1, 1, -1, 1}
#endif

/* x = content row + S row (S may be NULL), for VW channels at c */
INL vf row_in(const char *src, const float *srow, int64_t c, int dt) {
    vf x = vld_cvt(src + c * esize(dt), dt);
    return srow ? x + vld(srow + c) : x;
}

/* One row, vector path: every segment (pass-through, rope pairs) is a multiple of VW channels.
 * Stores go straight to the destination, two vectors at a time where the segment allows (one
 * 64-byte line for 16-bit dtypes). */
INL void row_vector(const char *src, const float *srow, char *dst, int64_t D, int64_t rs, int64_t half,
                    int inter, const float *cs, const float *sn, int dt_in, int dt_out, int nt) {
    const int64_t eo = esize(dt_out), re = rs + 2 * half;
    for (int seg = 0; seg < 2; seg++) { /* pass-through channels [0, rs) and [re, D) */
        const int64_t a = seg ? re : 0, b = seg ? D : rs;
        int64_t c = a;
        for (; c + 2 * VW <= b; c += 2 * VW)
            vst2_cvt(dst + c * eo, row_in(src, srow, c, dt_in), row_in(src, srow, c + VW, dt_in), dt_out, nt);
        for (; c < b; c += VW) vst_cvt(dst + c * eo, row_in(src, srow, c, dt_in), dt_out);
    }
    if (half && !inter) {
        int64_t p = 0;
        for (; p + 2 * VW <= half; p += 2 * VW) {
            vf a0 = row_in(src, srow, rs + p, dt_in), a1 = row_in(src, srow, rs + p + VW, dt_in);
            vf b0 = row_in(src, srow, rs + half + p, dt_in), b1 = row_in(src, srow, rs + half + p + VW, dt_in);
            vf c0 = vld(cs + p), c1 = vld(cs + p + VW), s0 = vld(sn + p), s1 = vld(sn + p + VW);
            vf y0 = a0 * c0 - b0 * s0, y1 = a1 * c1 - b1 * s1, z0 = b0 * c0 + a0 * s0, z1 = b1 * c1 + a1 * s1;
#if defined(__AVX512BF16__) && VW == 16
            if (dt_out == DT_BF16 && !any_subnormal4(y0, y1, z0, z1)) { /* one check for 64 values */
                st_line(dst + (rs + p) * 2, (__m512i)_mm512_cvtne2ps_pbh((__m512)y1, (__m512)y0), nt);
                st_line(dst + (rs + half + p) * 2, (__m512i)_mm512_cvtne2ps_pbh((__m512)z1, (__m512)z0), nt);
                continue;
            }
#endif
            vst2_cvt(dst + (rs + p) * eo, y0, y1, dt_out, nt);
            vst2_cvt(dst + (rs + half + p) * eo, z0, z1, dt_out, nt);
        }
        for (; p < half; p += VW) {
            vf a = row_in(src, srow, rs + p, dt_in), b = row_in(src, srow, rs + half + p, dt_in);
            vf c = vld(cs + p), s = vld(sn + p);
            vst_cvt(dst + (rs + p) * eo, a * c - b * s, dt_out);
            vst_cvt(dst + (rs + half + p) * eo, b * c + a * s, dt_out);
        }
    } else if (half) {
        const vi dup = DUP_IDX, swp = SWAP_IDX;
        const vf sign = SIGN_ALT;
        for (int64_t c = 0; c < 2 * half; c += VW) {
            vf x = row_in(src, srow, rs + c, dt_in);
            vf ch = {0}, sh = {0};
            __builtin_memcpy(&ch, cs + c / 2, VW / 2 * 4);
            __builtin_memcpy(&sh, sn + c / 2, VW / 2 * 4);
            vf cc = __builtin_shuffle(ch, dup), ss = __builtin_shuffle(sh, dup) * sign;
            vst_cvt(dst + (rs + c) * eo, x * cc + __builtin_shuffle(x, swp) * ss, dt_out);
        }
    }
}

/* One row, generic path (any D / rope slice), through a row buffer X[D]. */
INL void row_generic(const char *src, const float *srow, char *dst, float *X, int64_t D, int64_t rs,
                     int64_t half, int inter, const float *cs, const float *sn, int dt_in, int dt_out) {
    load_row(X, src, D, dt_in);
    if (srow)
        for (int64_t c = 0; c < D; c++) X[c] += srow[c];
    if (half && !inter) {
        float *restrict a = X + rs;
        float *restrict b = X + rs + half;
        for (int64_t p = 0; p < half; p++) {
            float x1 = a[p], x2 = b[p];
            a[p] = x1 * cs[p] - x2 * sn[p];
            b[p] = x2 * cs[p] + x1 * sn[p];
        }
    } else if (half) {
        float *x = X + rs;
        for (int64_t p = 0; p < half; p++) {
            float x1 = x[2 * p], x2 = x[2 * p + 1];
            x[2 * p] = x1 * cs[p] - x2 * sn[p];
            x[2 * p + 1] = x2 * cs[p] + x1 * sn[p];
        }
    }
    store_row(dst, X, D, dt_out);
}

/* One work item: one tile of tokens, all heads (so the tile's cos/sin rows and u rows are read
 * from memory once and reused from L1 by every head). Always inlined into copies with constant
 * dtypes (see below): rows are short (64..512 channels) and run ~T*H times per job, so the
 * per-row code must carry no dtype branches. */
/* The per-row work is small, so the row passes are written as a few loops whose bodies see
 * constant shapes in the common cases (loop-invariant branches and spills would dominate). */
#define ROW_DISPATCH(LOOP)                                                                          \
    if (copy_rows) {                                                                               \
        LOOP(copy_bytes(dst, src, D * ei, nt))                                                     \
    } else if (full && D == 64) {                                                                  \
        LOOP(row_vector(src, srow, dst, 64, 0, 32, 0, cs, sn, dt_in, dt_out, nt))                  \
    } else if (full && D == 128) {                                                                 \
        LOOP(row_vector(src, srow, dst, 128, 0, 64, 0, cs, sn, dt_in, dt_out, nt))                 \
    } else if (vec && !half && D == 64) {                                                          \
        LOOP(row_vector(src, srow, dst, 64, 0, 0, 0, cs, sn, dt_in, dt_out, nt))                   \
    } else if (vec && !half && D == 128) {                                                         \
        LOOP(row_vector(src, srow, dst, 128, 0, 0, 0, cs, sn, dt_in, dt_out, nt))                  \
    } else if (vec) {                                                                              \
        LOOP(row_vector(src, srow, dst, D, rs, half, inter, cs, sn, dt_in, dt_out, nt))            \
    } else {                                                                                       \
        LOOP(row_generic(src, srow, dst, X, D, rs, half, inter, cs, sn, dt_in, dt_out))            \
    }

/* destination row of token t0 + t, head h (NULL for a padding slot) */
#define DEST_ROW(t, h)                                                                              \
    (slots ? ((slots[t0 + (t)] < 0 || slots[t0 + (t)] >= p[P_NUM_SLOTS])                            \
                  ? (char *)0                                                                      \
                  : out + ((slots[t0 + (t)] / p[P_BLOCK_SIZE]) * p[P_O_SBLK] +                     \
                           (slots[t0 + (t)] % p[P_BLOCK_SIZE]) * p[P_O_SOFF] + (h) * o_sh) * eo)   \
           : out + ((h) * o_sh + (t0 + (t)) * o_st) * eo)

/* head-major: one head's rows of the tile, with the patch product S of that head */
#define LOOP_HEAD(BODY)                                                                             \
    for (int64_t t = 0; t < tb; t++) {                                                             \
        char *dst = DEST_ROW(t, h);                                                                \
        if (!dst) continue; /* padding slot: skipped */                                            \
        const char *src = content + (h * c_sh + (t0 + t) * c_st) * ei;                             \
        const float *srow = S + t * DP;                                                            \
        const float *cs = cosp + (t0 + t) * cs_st, *sn = sinp + (t0 + t) * cs_st;                  \
        (void)srow; (void)cs; (void)sn;                                                            \
        BODY;                                                                                      \
    }

/* token-major: every head of one token, so the token's cos/sin row is read from memory once */
#define LOOP_TOKEN(BODY)                                                                            \
    for (int64_t t = 0; t < tb; t++) {                                                             \
        const float *cs = cosp + (t0 + t) * cs_st, *sn = sinp + (t0 + t) * cs_st;                  \
        const float *srow = 0;                                                                     \
        (void)srow; (void)cs; (void)sn;                                                            \
        for (int64_t h = 0; h < H; h++) {                                                          \
            char *dst = DEST_ROW(t, h);                                                            \
            if (!dst) continue; /* padding slot: skipped */                                        \
            const char *src = content + (h * c_sh + (t0 + t) * c_st) * ei;                         \
            BODY;                                                                                  \
        }                                                                                          \
    }

/* One work item: one tile of tokens of one job, all heads. Always inlined into copies with
 * constant dtypes (see below), so the per-row code has no dtype branches. */
INL void process_item(const int64_t *p, int64_t t0, int64_t tb, int dt_in, int dt_out,
                      float *S, float *U, float *W, float *X, int nt) {
    const int64_t H = p[P_H], D = p[P_D], DP = padded(D);
    const char *content = (const char *)(intptr_t)p[P_CONTENT];
    const int64_t ei = esize(dt_in), eo = esize(dt_out), c_sh = p[P_C_SH], c_st = p[P_C_ST];
    const char *u = (const char *)(intptr_t)p[P_U];
    const int64_t m = u ? p[P_M] : 0;
    const float *cosp = (const float *)(intptr_t)p[P_COS];
    const float *sinp = (const float *)(intptr_t)p[P_SIN];
    const int64_t half = cosp ? p[P_HALF] : 0, rs = p[P_ROPE_START], cs_st = p[P_CS_ST];
    const int inter = (int)p[P_INTERLEAVED];
    const int vec = D % VW == 0 && rs % VW == 0 && (inter ? (2 * half) % VW == 0 : half % VW == 0);
    const int full = vec && !inter && rs == 0 && 2 * half == D;
    char *out = (char *)(intptr_t)p[P_OUT];
    const int64_t *slots = (const int64_t *)(intptr_t)p[P_SLOTS];
    const int64_t o_sh = p[P_O_SH], o_st = p[P_O_ST];
    /* rank 0, no rotation, same dtype: rows are copied as they are (the fp32 round trip is exact) */
    const int copy_rows = m == 0 && half == 0 && dt_in == dt_out;

    if (m == 0) {
        if (copy_rows && !slots && c_st == D && o_st == D) { /* each head's tile is one block */
            for (int64_t h = 0; h < H; h++)
                copy_bytes(out + (h * o_sh + t0 * o_st) * eo, content + (h * c_sh + t0 * c_st) * ei, tb * D * ei, nt);
            return;
        }
        ROW_DISPATCH(LOOP_TOKEN)
        return;
    }

    const int dt_u = (int)p[P_DT_U], dt_w = (int)p[P_DT_W];
    const int64_t u_st = p[P_U_ST];
    const char *w = (const char *)(intptr_t)p[P_W];
#if HAVE_DPBF16
    if (dt_u == DT_BF16 && dt_w == DT_BF16) {
        const int64_t m2 = (m + 1) / 2;
        uint32_t *U2 = (uint32_t *)U, *W2 = (uint32_t *)W;
        for (int64_t t = 0; t < tb; t++) { /* a bf16 row is already its pairs in memory */
            uint16_t *row = (uint16_t *)(U2 + t * m2);
            memcpy(row, u + (t0 + t) * u_st * 2, (size_t)m * 2);
            if (m & 1) row[m] = 0;
        }
        for (int64_t h = 0; h < H; h++) {
            pack_w_bf16(W2, (const uint16_t *)w + h * D, p[P_W_SR], m, D, DP);
            rank_product_bf16(S, U2, W2, tb, m2, DP);
            ROW_DISPATCH(LOOP_HEAD)
        }
        return;
    }
#endif
    for (int64_t t = 0; t < tb; t++) load_row(U + t * m, u + (t0 + t) * u_st * esize(dt_u), m, dt_u);
    for (int64_t h = 0; h < H; h++) {
        if (dt_w == DT_F32 && D == DP) { /* use w in place: rows w_sr apart */
            rank_product(S, U, (const float *)w + h * D, tb, m, DP, p[P_W_SR]);
        } else { /* this head's slice of w as fp32, zero-padded to DP */
            for (int64_t j = 0; j < m; j++) {
                load_row(W + j * DP, w + (j * p[P_W_SR] + h * D) * esize(dt_w), D, dt_w);
                for (int64_t c = D; c < DP; c++) W[j * DP + c] = 0.f;
            }
            rank_product(S, U, W, tb, m, DP, DP);
        }
        ROW_DISPATCH(LOOP_HEAD)
    }
}

#undef LOOP_HEAD
#undef LOOP_TOKEN
#undef DEST_ROW
#undef ROW_DISPATCH

#define ITEM_ARGS const int64_t *p, int64_t t0, int64_t tb, float *S, float *U, float *W, float *X, int nt
static void item_f32(ITEM_ARGS) { process_item(p, t0, tb, DT_F32, DT_F32, S, U, W, X, nt); }
static void item_bf16(ITEM_ARGS) { process_item(p, t0, tb, DT_BF16, DT_BF16, S, U, W, X, nt); }
static void item_f16(ITEM_ARGS) { process_item(p, t0, tb, DT_F16, DT_F16, S, U, W, X, nt); }
static void item_mixed(ITEM_ARGS) { process_item(p, t0, tb, (int)p[P_DT_IN], (int)p[P_DT_OUT], S, U, W, X, nt); }

/* Runs njobs jobs (params: njobs blocks of P_COUNT int64) on up to nthreads threads; `stream`:
 * write destinations with non-temporal stores where aligned (for writes far larger than cache).
 * Returns 0 on success, 1 if scratch could not be allocated (then rows may be unwritten). */
int cd_apply_many(const int64_t *params, int64_t njobs, int64_t nthreads, int64_t stream) {
    const int nt = stream != 0;
    int64_t total = 0, max_dp = VW, max_m = 1;
    int64_t *first = (int64_t *)malloc((size_t)(njobs + 1) * sizeof(int64_t));
    if (!first) return 1;
    for (int64_t j = 0; j < njobs; j++) {
        const int64_t *p = params + j * P_COUNT;
        first[j] = total;
        total += (p[P_T] + tile_of(p) - 1) / tile_of(p);
        if (padded(p[P_D]) > max_dp) max_dp = padded(p[P_D]);
        if (p[P_U] && p[P_M] > max_m) max_m = p[P_M];
    }
    first[njobs] = total;
    double work = 0; /* ~ fp32 element-operations; below PAR_MIN_WORK one thread is faster than
                      * waking a team (a fork/join costs microseconds, on busy VMs much more) */
    for (int64_t j = 0; j < njobs; j++) {
        const int64_t *p = params + j * P_COUNT;
        work += (double)p[P_H] * p[P_T] * p[P_D] * (1.0 + (p[P_U] ? p[P_M] : 0) / 16.0);
    }
    if (work < PAR_MIN_WORK) nthreads = 1;
    if (nthreads > total) nthreads = total;
    if (nthreads < 1) nthreads = 1;
    const size_t floats = (size_t)(TB * max_dp + TB * max_m + max_m * max_dp + max_dp);
    int failed = 0;

#pragma omp parallel num_threads((int)nthreads) reduction(| : failed)
    {
        float *buf = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (!buf) failed = 1;
        float *S = buf, *U = S + TB * max_dp, *W = U + TB * max_m, *X = W + max_m * max_dp;
        int64_t job = 0;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < total; it++) {
            if (!buf) continue;
            while (it >= first[job + 1]) job++;
            while (it < first[job]) job--;
            const int64_t *p = params + job * P_COUNT;
            const int64_t T = p[P_T], tile = tile_of(p), t0 = (it - first[job]) * tile;
            const int64_t tb = (T - t0) < tile ? (T - t0) : tile;
            const int64_t di = p[P_DT_IN], dout = p[P_DT_OUT];
            if (di != dout) item_mixed(p, t0, tb, S, U, W, X, nt);
            else if (di == DT_F32) item_f32(p, t0, tb, S, U, W, X, nt);
            else if (di == DT_BF16) item_bf16(p, t0, tb, S, U, W, X, nt);
            else item_f16(p, t0, tb, S, U, W, X, nt);
        }
#if defined(__AVX512F__)
        if (nt) _mm_sfence(); /* order this thread's streaming stores before the region ends */
#endif
        free(buf);
    }
    free(first);
    return failed;
}
