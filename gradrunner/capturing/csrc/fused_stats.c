/* One read of a gradient: sum, sum of squares, min, max, non-zero, NaN and Inf counts.
 *
 * Built on first use by gradrunner/capturing/fused_stats.py with the system C compiler and loaded
 * through ctypes (no Python or torch headers needed). Sums accumulate in float64 per block of
 * BLOCK elements and the block sums are added in float64 again, so the error stays at float64
 * rounding for any size; nothing is copied. out = [sum, sumsq, min, max, nonzero, nan, inf].
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

#define DEFINE(NAME, IN, T, LOAD, BITS, MASK)                                             \
    void NAME(const IN *x, int64_t n, double *out) {                                      \
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
        }                                                                                 \
        FINISH(LOAD, T)                                                                   \
    }

DEFINE(gr_stats_f64, double, double, IDENT, uint64_t, 0x7fffffffffffffffull)
DEFINE(gr_stats_f32, float, float, IDENT, uint32_t, 0x7fffffffu)
DEFINE(gr_stats_f16, uint16_t, float, f16_to_f32, uint16_t, 0x7fffu)
DEFINE(gr_stats_bf16, uint16_t, float, bf16_to_f32, uint16_t, 0x7fffu)
