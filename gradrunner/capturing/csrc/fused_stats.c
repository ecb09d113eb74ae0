/* One read of a gradient: sum, sum of squares, min, max, non-zero, NaN and Inf counts.
 *
 * Built on first use by gradrunner/capturing/fused_stats.py with the system C compiler and loaded
 * through ctypes (no Python or torch headers needed). Sums accumulate in float64 per block of
 * BLOCK elements and the block sums are added in float64 again, so the error stays at float64
 * rounding for any size; nothing is copied. out = [sum, sumsq, min, max, nonzero, nan, inf].
 *
 * The `_hist` variants also count |g| (rounded to float32, a float64 clamped into float32's range
 * first: `mag_f64`) in histogram bins, block by block while the block is still in cache, so the gradient is read from memory once for both. The bins
 * come from tables built in Python (`extras.hist_tables`): `cell[b >> 20]` is the bin of the
 * smallest float32 whose bits start with `b >> 20` (8 exponent and 3 mantissa bits: a range of
 * 2^(1/8), narrower than a bin, so at most one edge `upper[r]` lies inside it and one comparison
 * finishes the job); zeros and subnormals (exponent 0) are walked up the edges; NaN and Inf
 * (exponent 255) have the last raw bin as their cell; `fold[r]` maps raw bins to the counts' bins.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 4096

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    /* branch-light half -> float (after F. Giesen): exact for normals, subnormals, inf and NaN */
    const uint32_t shifted_exp = 0x7c00u << 13;
    uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
    uint32_t exp = shifted_exp & o;
    float f;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == shifted_exp) {
        o += (uint32_t)(128 - 16) << 23;
    } else if (exp == 0) {
        o += 1u << 23;
        memcpy(&f, &o, 4);
        f -= 6.103515625e-05f;
        memcpy(&o, &f, 4);
    }
    o |= ((uint32_t)h & 0x8000u) << 16;
    memcpy(&f, &o, 4);
    return f;
}

/* NaN makes the min and max NaN (as torch.aminmax); counting happens only when a sum is not finite. */
#define FINISH(LOAD, T)                                                                   \
    double nan_count = 0, inf_count = 0;                                                  \
    if (!isfinite(s) || !isfinite(ss)) {                                                  \
        for (int64_t i = 0; i < n; i++) {                                                 \
            double v = (double)LOAD(x[i]);                                                \
            nan_count += isnan(v) ? 1 : 0;                                                      \
            inf_count += isinf(v) ? 1 : 0;                                                      \
        }                                                                                 \
        if (nan_count > 0) {                                                              \
            mn = (T)NAN;                                                                  \
            mx = (T)NAN;                                                                  \
        }                                                                                 \
    }                                                                                     \
    out[0] = s;                                                                           \
    out[1] = ss;                                                                          \
    out[2] = (double)mn;                                                                  \
    out[3] = (double)mx;                                                                  \
    out[4] = (double)nz;                                                                  \
    out[5] = nan_count;                                                                   \
    out[6] = inf_count;

#define IDENT(v) (v)

/* |v| as the float32 it is binned as. A float64 is clamped into float32's finite nonzero range first:
 * rounded as is, a finite value past FLT_MAX would become Inf (the NaN/Inf bin) and a nonzero one below
 * the smallest subnormal 0 (the zeros' bin). NaN and Inf are left as they are. */
static inline float mag_f64(double v) {
    double a = fabs(v);
    if (a > 3.4028234663852886e38 && a <= 1.7976931348623157e308) a = 3.4028234663852886e38;
    else if (a > 0.0 && a < 1.401298464324817e-45) a = 1.401298464324817e-45;
    return (float)a;
}
static inline float mag_f32(float v) { return fabsf(v); }
static inline float mag_f16(uint16_t v) { return fabsf(f16_to_f32(v)); }
static inline float mag_bf16(uint16_t v) { return fabsf(bf16_to_f32(v)); }

#define MAX_RAW 512

static inline int32_t raw_bin(float a, const int32_t *cell, const float *upper, int32_t n_raw) {
    uint32_t b;
    memcpy(&b, &a, 4);
    uint32_t idx = b >> 20; /* a >= 0 or NaN with the sign cleared: 11 bits */
    if (idx >= 8u) { /* NaN and Inf: cell n_raw - 1, whose upper edge is NaN (no comparison moves them) */
        int32_t r = cell[idx];
        return r + (a >= upper[r]);
    }
    int32_t r = 0; /* zero or subnormal: walk up the edges (rare) */
    while (r < n_raw - 2 && a >= upper[r]) r++;
    return r;
}

#define DEFINE(NAME, IN, T, LOAD, MAG, BITS, MASK)                                           \
    static inline void NAME##_impl(const IN *x, int64_t n, double *out, int64_t *counts,  \
                                   const int32_t *cell, const float *upper,               \
                                   const int32_t *fold, int32_t n_raw) {                  \
        /* four sub-histograms: runs of equal bins (common) do not wait on one counter */  \
        int64_t raw[4][MAX_RAW];                                                          \
        if (counts) memset(raw, 0, sizeof(raw));                                          \
        double s = 0.0, ss = 0.0;                                                         \
        T mn = (T)INFINITY, mx = (T)-INFINITY;                                            \
        int64_t nz = 0;                                                                   \
        for (int64_t start = 0; start < n; start += BLOCK) {                              \
            int64_t end = start + BLOCK < n ? start + BLOCK : n;                          \
            double bs = 0.0, bss = 0.0;                                                   \
            T bmn = mn, bmx = mx;                                                         \
            int64_t bnz = 0;                                                              \
            _Pragma("omp simd reduction(+ : bs, bss, bnz) reduction(min : bmn) reduction(max : bmx)") \
            for (int64_t i = start; i < end; i++) {                                       \
                T v = (T)LOAD(x[i]);                                                      \
                double d = (double)v;                                                     \
                bs += d;                                                                  \
                bss += d * d;                                                             \
                bmn = v < bmn ? v : bmn;                                                  \
                bmx = v > bmx ? v : bmx;                                                  \
                BITS b;                                                                   \
                memcpy(&b, &x[i], sizeof(BITS));                                          \
                bnz += (b & MASK) != 0;                                                   \
            }                                                                             \
            s += bs;                                                                      \
            ss += bss;                                                                    \
            mn = bmn;                                                                     \
            mx = bmx;                                                                     \
            nz += bnz;                                                                    \
            if (counts) {                                                                 \
                int64_t i = start;                                                        \
                for (; i + 4 <= end; i += 4) {                                            \
                    raw[0][raw_bin(MAG(x[i]), cell, upper, n_raw)]++;      \
                    raw[1][raw_bin(MAG(x[i + 1]), cell, upper, n_raw)]++;  \
                    raw[2][raw_bin(MAG(x[i + 2]), cell, upper, n_raw)]++;  \
                    raw[3][raw_bin(MAG(x[i + 3]), cell, upper, n_raw)]++;  \
                }                                                                         \
                for (; i < end; i++) raw[0][raw_bin(MAG(x[i]), cell, upper, n_raw)]++; \
            }                                                                             \
        }                                                                                 \
        if (counts) {                                                                     \
            for (int32_t r = 0; r < n_raw; r++)                                           \
                counts[fold[r]] += raw[0][r] + raw[1][r] + raw[2][r] + raw[3][r];         \
        }                                                                                 \
        FINISH(LOAD, T)                                                                   \
    }                                                                                     \
    void NAME(const IN *x, int64_t n, double *out) {                                      \
        NAME##_impl(x, n, out, 0, 0, 0, 0, 0);                                            \
    }                                                                                     \
    void NAME##_hist(const IN *x, int64_t n, double *out, int64_t *counts,                \
                     const int32_t *cell, const float *upper, const int32_t *fold,        \
                     int32_t n_raw) {                                                     \
        if (n_raw < 2 || n_raw > MAX_RAW) return;                                         \
        NAME##_impl(x, n, out, counts, cell, upper, fold, n_raw);                         \
    }

DEFINE(gr_stats_f64, double, double, IDENT, mag_f64, uint64_t, 0x7fffffffffffffffull)
DEFINE(gr_stats_f32, float, float, IDENT, mag_f32, uint32_t, 0x7fffffffu)
DEFINE(gr_stats_f16, uint16_t, float, f16_to_f32, mag_f16, uint16_t, 0x7fffu)
DEFINE(gr_stats_bf16, uint16_t, float, bf16_to_f32, mag_bf16, uint16_t, 0x7fffu)
