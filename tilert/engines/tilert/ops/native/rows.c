/* Row-invariant float32 decode kernels for the CPU engine (tilert/engines/tilert/ops/native.py builds and loads
 * this file; tilert/engines/tilert/ops/cpu.py calls it).
 *
 * The one rule: every output row is computed by the same sequence of floating-point operations whatever the
 * number of rows, the row's index, or the other rows' values. Each dot product is one fixed chain (8-lane FMA
 * accumulation over k in order, a fixed horizontal sum, a scalar tail); rows never share an accumulator; there
 * is no threading and no blocking over k that depends on a shape other than k itself. So a decode step over
 * the rows of several sequences gives each row exactly the bits it gets alone, and the weights are read once
 * for all rows (weight-stationary: the point of this file; CPU BLAS is not batch-invariant across row counts).
 *
 * Built with -ffp-contract=off: the compiler may not fuse the scalar tails differently in different places.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TL_VEC 1
#endif

#ifdef TL_VEC
static inline float tl_hsum(__m256 acc) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

/* dot(a, b) over k: the one chain every row and every output uses (tl_dot8 runs eight of them side by side,
 * each exactly this chain). */
static inline float tl_dot(const float *a, const float *b, int64_t k) {
    int64_t i = 0;
    float s;
#ifdef TL_VEC
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    s = tl_hsum(acc);
#else
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; i + 8 <= k; i += 8)
        for (int l = 0; l < 8; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    float h[4];
    for (int l = 0; l < 4; l++) h[l] = acc[l] + acc[l + 4];
    s = (h[0] + h[2]) + (h[1] + h[3]);
#endif
    for (; i < k; i++) s = fmaf(a[i], b[i], s);
    return s;
}

/* out[j] = tl_dot(a, b + j * bs, k) for j < 8: independent chains interleaved (an FMA's latency hidden). */
static inline void tl_dot8(const float *a, const float *b, int64_t bs, int64_t k, float *out, int64_t os) {
#ifdef TL_VEC
    __m256 c[8];
    for (int j = 0; j < 8; j++) c[j] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 av = _mm256_loadu_ps(a + i);
        for (int j = 0; j < 8; j++) c[j] = _mm256_fmadd_ps(av, _mm256_loadu_ps(b + j * bs + i), c[j]);
    }
    for (int j = 0; j < 8; j++) {
        float s = tl_hsum(c[j]);
        for (int64_t t = i; t < k; t++) s = fmaf(a[t], b[j * bs + t], s);
        out[j * os] = s;
    }
#else
    for (int j = 0; j < 8; j++) out[j * os] = tl_dot(a, b + j * bs, k);
#endif
}

/* y[g, r, j] = sum_k x[g, r, k] * w[g, j, k] for g < G, r < n, j < N (element strides given; k contiguous).
 * Weight rows are visited once, in blocks of 8 that stay in L1 while every row reads them. */
void tl_linear(int64_t G, int64_t n, int64_t N, int64_t K, const float *x, int64_t xg, int64_t xr, const float *w,
               int64_t wg, int64_t wj, float *y, int64_t yg, int64_t yr) {
    for (int64_t g = 0; g < G; g++) {
        const float *xb = x + g * xg, *wb = w + g * wg;
        float *yb = y + g * yg;
        int64_t j0 = 0;
        for (; j0 + 8 <= N; j0 += 8)
            for (int64_t r = 0; r < n; r++) tl_dot8(xb + r * xr, wb + j0 * wj, wj, K, yb + r * yr + j0, 1);
        for (int64_t r = 0; r < n; r++)
            for (int64_t j = j0; j < N; j++) yb[r * yr + j] = tl_dot(xb + r * xr, wb + j * wj, K);
    }
}

/* out[:N] = init[:N] + sum_k xv[k] * w[k, :N] (w's rows of N contiguous, wk apart; init NULL: zeros; init may be
 * out): the sum over k in order, lane by lane, 32 lanes held in registers over every k. */
static void tl_row_kn(const float *xv, const float *w, int64_t wk, int64_t K, int64_t N, const float *init,
                      float *out) {
    int64_t j = 0;
#ifdef TL_VEC
    for (; j + 32 <= N; j += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        if (init) {
            a0 = _mm256_loadu_ps(init + j);
            a1 = _mm256_loadu_ps(init + j + 8);
            a2 = _mm256_loadu_ps(init + j + 16);
            a3 = _mm256_loadu_ps(init + j + 24);
        }
        for (int64_t k = 0; k < K; k++) {
            __m256 xk = _mm256_set1_ps(xv[k]);
            const float *wr = w + k * wk + j;
            a0 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(wr), a0);
            a1 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(wr + 8), a1);
            a2 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(wr + 16), a2);
            a3 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(wr + 24), a3);
        }
        _mm256_storeu_ps(out + j, a0);
        _mm256_storeu_ps(out + j + 8, a1);
        _mm256_storeu_ps(out + j + 16, a2);
        _mm256_storeu_ps(out + j + 24, a3);
    }
#endif
    for (; j < N; j++) {
        float s = init ? init[j] : 0.0f;
        for (int64_t k = 0; k < K; k++) s = fmaf(xv[k], w[k * wk + j], s);
        out[j] = s;
    }
}

/* y[g, r, :N] = sum_k x[g, r, k] * w[g, k, :N] (w's rows of N contiguous). */
void tl_linear_kn(int64_t G, int64_t n, int64_t N, int64_t K, const float *x, int64_t xg, int64_t xr,
                  const float *w, int64_t wg, int64_t wk, float *y, int64_t yg, int64_t yr) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t r = 0; r < n; r++)
            tl_row_kn(x + g * xg + r * xr, w + g * wg, wk, K, N, NULL, y + g * yg + r * yr);
}

/* Absorbed MLA decode for n queries, query i over cache rows lo..pos[i] with lo = min(start, pos[i] + 1), start =
 * start[i] (nstart == n), start[0] (nstart == 1) or 0 (start NULL):
 * s[h, t] = scale * q[i, h, :D] . kv[t, :D], p = softmax_t(s), out[i, h, :L] = sum_t p[h, t] * kv[t, :L].
 * One pass over the rows in blocks of 8 (an online softmax: a block's rows are read once, for the scores of
 * every head and for the output). q [n, H, D] contiguous, kv [S, D] contiguous, out [n, H, L] contiguous.
 * Every index is checked before any work: returns -2 for a position or start outside 0..S-1, 1 when a query has
 * no row (lo > pos: the caller decides), -1 when out of memory, 0 when done. */
int tl_mla_attend(int64_t n, int64_t H, int64_t D, int64_t L, const float *q, const float *kv, int64_t S,
                  const int64_t *pos, const int64_t *start, int64_t nstart, float scale, float *out) {
    for (int64_t i = 0; i < n; i++) {
        int64_t s0 = start ? start[nstart > 1 ? i : 0] : 0;
        if (pos[i] < 0 || pos[i] >= S || s0 < 0) return -2;
        if (s0 > pos[i]) return 1;
    }
    float *st = (float *)malloc((size_t)(H * 10) * sizeof(float)); /* per head: 8 scores, max, sum */
    if (!st) return -1;
    for (int64_t i = 0; i < n; i++) {
        const float *qi = q + i * H * D;
        float *oi = out + i * H * L;
        memset(oi, 0, (size_t)(H * L) * sizeof(float));
        for (int64_t h = 0; h < H; h++) {
            st[h * 10 + 8] = -INFINITY;
            st[h * 10 + 9] = 0.0f;
        }
        int64_t hi = pos[i] + 1;
        for (int64_t t0 = start ? start[nstart > 1 ? i : 0] : 0; t0 < hi; t0 += 8) {
            int64_t nb = hi - t0 < 8 ? hi - t0 : 8;
            const float *blk = kv + t0 * D;
            for (int64_t h = 0; h < H; h++) {
                float *sh = st + h * 10, bm = -INFINITY;
                if (nb == 8) tl_dot8(qi + h * D, blk, D, D, sh, 1);
                else
                    for (int64_t j = 0; j < nb; j++) sh[j] = tl_dot(qi + h * D, blk + j * D, D);
                for (int64_t j = 0; j < nb; j++) {
                    sh[j] *= scale;
                    if (sh[j] > bm) bm = sh[j];
                }
                float m = sh[8], mn = bm > m ? bm : m, sum = 0.0f;
                for (int64_t j = 0; j < nb; j++) {
                    sh[j] = expf(sh[j] - mn);
                    sum += sh[j];
                }
                if (mn != m) {  /* a new maximum: what was summed so far shrinks by exp(m - mn) */
                    float c = expf(m - mn);
                    float *o = oi + h * L;
                    for (int64_t l = 0; l < L; l++) o[l] *= c;
                    sh[9] *= c;
                }
                sh[8] = mn;
                sh[9] += sum;
            }
            /* out_h += sum_j p[h, j] * row_j over the block's rows in order (tl_row_kn from out_h: a slice of out_h
             * held in registers over the block's rows, loaded and stored once per block, not once per row). */
            for (int64_t h = 0; h < H; h++) tl_row_kn(st + h * 10, blk, D, nb, L, oi + h * L, oi + h * L);
        }
        for (int64_t h = 0; h < H; h++) {
            float inv = 1.0f / st[h * 10 + 9];
            float *o = oi + h * L;
            for (int64_t l = 0; l < L; l++) o[l] *= inv;
        }
    }
    free(st);
    return 0;
}

/* One row's RMSNorm: out = (x * (1 / sqrt(mean(x^2) + eps))) * w; the sum of squares one fixed chain. */
static void tl_rms_row(const float *xv, const float *w, int64_t D, float eps, float *out) {
    float inv = 1.0f / sqrtf(tl_dot(xv, xv, D) / (float)D + eps);
    for (int64_t i = 0; i < D; i++) out[i] = (xv[i] * inv) * w[i];
}

/* RMSNorm of each row of x [n, D] (rows xr apart) into y [n, D]. */
void tl_rms_norm(int64_t n, int64_t D, const float *x, int64_t xr, const float *w, float eps, float *y) {
    for (int64_t r = 0; r < n; r++) tl_rms_row(x + r * xr, w, D, eps, y + r * D);
}

/* RoPE of one slice x [2 * half] (rotate-half convention) with this row's cos / sin [half]. */
static void tl_rope(const float *x, const float *cs, const float *sn, int64_t half, float *out) {
    for (int64_t j = 0; j < half; j++) {
        float x1 = x[j], x2 = x[half + j];
        out[j] = x1 * cs[j] - x2 * sn[j];
        out[half + j] = x2 * cs[j] + x1 * sn[j];
    }
}

/* MLA's preparation for n tokens at cache rows rows[i] (dense MLA, no indexer), as reference.mla_prep:
 * a [n, >= kv_offset + L + R] (rows as apart) = [q_a | c_kv | k_pe | ...], b [n, >= H * (P + R)] (rows bs apart)
 * = per head [q_nope | q_pe]; w_uk head h = kv_b rows h * (P + V) .. + P, each of L; cos / sin [rows, R / 2].
 * Writes q_full [n, H, L + R] = [q_nope . W_UK | rope(q_pe)] and the cache row [rms(c_kv) | rope(k_pe)]; S: the
 * rows of the cache and of cos / sin. Returns -2 (nothing written) for a row outside 0..S-1, else 0. */
int tl_mla_prep(int64_t n, int64_t H, int64_t P, int64_t R, int64_t V, int64_t L, int64_t kv_offset,
                const float *a, int64_t as, const float *b, int64_t bs, const int64_t *rows, int64_t S,
                const float *kv_b, const float *cos_t, const float *sin_t, const float *kv_norm, float eps,
                float *kv_cache, float *q_full) {
    int64_t half = R / 2, W = L + R;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= S) return -2; /* before any write */
    for (int64_t i = 0; i < n; i++) {
        const float *cs = cos_t + rows[i] * half, *sn = sin_t + rows[i] * half;
        const float *ai = a + i * as, *bi = b + i * bs;
        for (int64_t h = 0; h < H; h++) {
            const float *q = bi + h * (P + R);
            float *out = q_full + (i * H + h) * W;
            tl_row_kn(q, kv_b + h * (P + V) * L, L, P, L, NULL, out);
            tl_rope(q + P, cs, sn, half, out + L);
        }
        float *row = kv_cache + rows[i] * W;
        tl_rms_row(ai + kv_offset, kv_norm, L, eps, row);
        tl_rope(ai + kv_offset + L, cs, sn, half, row + L);
    }
    return 0;
}

/* The DeepSeek router for each row of x [n, D] (already normed): logits = gate . x, scores = sigmoid, choice =
 * scores + bias; with topk_group < n_group only the topk_group groups of the largest top-2 sums stay; the top_k
 * choices (largest first, the lower expert on a tie) give ids and their scores as weights (normalised to sum 1
 * when norm_topk), times route_scale; then the n_shared shared experts (ids E.., weight 1).
 * ids / wts: [n, top_k + n_shared]. Returns -1 on bad sizes. */
int tl_moe_route(int64_t n, int64_t D, int64_t E, const float *x, const float *gate, const float *bias,
                 int64_t top_k, int64_t n_group, int64_t topk_group, float route_scale, int norm_topk,
                 int64_t n_shared, int32_t *ids, float *wts) {
    enum { EMAX = 1024 };
    if (E > EMAX || E <= 0 || n_group <= 0 || E % n_group || top_k > E || topk_group > n_group) return -1;
    float scores[EMAX], choice[EMAX], gs[EMAX];
    int64_t per = E / n_group, width = top_k + n_shared;
    for (int64_t r = 0; r < n; r++) {
        const float *xv = x + r * D;
        int64_t e = 0;
        for (; e + 8 <= E; e += 8) tl_dot8(xv, gate + e * D, D, D, scores + e, 1);
        for (; e < E; e++) scores[e] = tl_dot(xv, gate + e * D, D);
        for (e = 0; e < E; e++) {
            scores[e] = 1.0f / (1.0f + expf(-scores[e]));
            choice[e] = scores[e] + bias[e];
        }
        if (topk_group < n_group) {
            for (int64_t g = 0; g < n_group; g++) {
                float a = -INFINITY, b = -INFINITY;
                for (int64_t i = g * per; i < (g + 1) * per; i++) {
                    float c = choice[i];
                    if (c > a) { b = a; a = c; } else if (c > b) b = c;
                }
                gs[g] = per > 1 ? a + b : a;
            }
            for (int64_t g = 0; g < n_group; g++) {  /* kept: fewer than topk_group groups beat it */
                int64_t better = 0;
                for (int64_t o = 0; o < n_group; o++) better += gs[o] > gs[g] || (gs[o] == gs[g] && o < g);
                if (better >= topk_group)
                    for (int64_t i = g * per; i < (g + 1) * per; i++) choice[i] = -INFINITY;
            }
        }
        int32_t *ri = ids + r * width;
        float *rw = wts + r * width, sum = 0.0f;
        for (int64_t j = 0; j < top_k; j++) {
            int64_t best = -1;
            for (e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t t = 0; t < j; t++) taken |= ri[t] == e;
                if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
            }
            ri[j] = (int32_t)best;
            rw[j] = scores[best];
            sum += rw[j];
        }
        for (int64_t j = 0; j < top_k; j++) rw[j] = (norm_topk ? rw[j] / (sum + 1e-20f) : rw[j]) * route_scale;
        for (int64_t j = 0; j < n_shared; j++) {
            ri[top_k + j] = (int32_t)(E + j);
            rw[top_k + j] = 1.0f;
        }
    }
    return 0;
}

/* SwiGLU experts: out[r] = sum_j wts[r, j] * expert_{ids[r, j]}(x[r]) over the slots j < k in order (ids < 0
 * skipped), expert e = w2[e] . (silu(g) * u) with [g | u] = w13[e] . x. Each expert runs once over all the rows
 * that chose it (its weights read once), every product the one chain of tl_dot. w13 [E, 2I, D], w2 [E, D, I].
 * Returns -1 when out of memory or an id is out of range. */
int tl_moe_experts(int64_t n, int64_t D, int64_t I, int64_t k, int64_t E, const float *x, const int32_t *ids,
                   const float *wts, const float *w13, const float *w2, float *out) {
    float *ys = (float *)calloc((size_t)(n * k * D), sizeof(float));
    float *xe = (float *)malloc((size_t)(n * D) * sizeof(float));
    float *gu = (float *)malloc((size_t)(n * 2 * I) * sizeof(float));
    float *hh = (float *)malloc((size_t)(n * I) * sizeof(float));
    float *ye = (float *)malloc((size_t)(n * D) * sizeof(float));
    int64_t *slot = (int64_t *)malloc((size_t)n * sizeof(int64_t));
    int rc = 0;
    if (!ys || !xe || !gu || !hh || !ye || !slot) { rc = -1; goto done; }
    for (int64_t i = 0; i < n * k; i++)
        if (ids[i] >= E) { rc = -1; goto done; }
    for (int64_t e = 0; e < E; e++) {
        int64_t m = 0;
        for (int64_t r = 0; r < n; r++)
            for (int64_t j = 0; j < k; j++)
                if (ids[r * k + j] == e) {
                    memcpy(xe + m * D, x + r * D, (size_t)D * sizeof(float));
                    slot[m++] = r * k + j;
                }
        if (!m) continue;
        tl_linear(1, m, 2 * I, D, xe, 0, D, w13 + e * 2 * I * D, 0, D, gu, 0, 2 * I);
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < I; i++) {
                float g = gu[r * 2 * I + i];
                hh[r * I + i] = (g / (1.0f + expf(-g))) * gu[r * 2 * I + I + i];
            }
        tl_linear(1, m, D, I, hh, 0, I, w2 + e * D * I, 0, I, ye, 0, D);
        for (int64_t r = 0; r < m; r++) memcpy(ys + slot[r] * D, ye + r * D, (size_t)D * sizeof(float));
    }
    for (int64_t r = 0; r < n; r++) {
        float *o = out + r * D;
        for (int64_t d = 0; d < D; d++) o[d] = ys[(r * k) * D + d] * wts[r * k];
        for (int64_t j = 1; j < k; j++) {
            const float *y = ys + (r * k + j) * D;
            float wj = wts[r * k + j];
            for (int64_t d = 0; d < D; d++) o[d] = o[d] + y[d] * wj;
        }
    }
done:
    free(ys); free(xe); free(gu); free(hh); free(ye); free(slot);
    return rc;
}
