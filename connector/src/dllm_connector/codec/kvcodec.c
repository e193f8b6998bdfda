/* KV codec kernels for host memory: fp8 (e4m3, power-of-two scales) and int8, one scale per row.
 *
 * The same payload bytes and decoded values as codec.py's torch kernels, bit for bit (the tests
 * compare them on every finite 16-bit value): each loop is the torch kernel's arithmetic, element
 * by element, written so that the compiler vectorizes it. native.py compiles this file for
 * the CPU it runs on (-O3 -march=native -ffp-contract=off: no fused multiply-add, whose single
 * rounding would differ from torch's two) and calls it through ctypes, which releases the GIL.
 *
 * Rows are contiguous, `row_len` elements each; a row is one scale group. Source dtypes: 0 bfloat16,
 * 1 float16, 2 float32. A row holding NaN or inf gets a NaN scale (the caller refuses the payload).
 * Plain C11, no compiler extensions: float16 is converted with integer operations, as bfloat16 is.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef KVCODEC_SOURCE_SHA256
#define KVCODEC_SOURCE_SHA256 "unknown"
#endif

enum { KV_BF16 = 0, KV_F16 = 1, KV_F32 = 2 };

#define F32_EXP_MASK 0x7F800000u   /* float32 bits at or above: inf or NaN */
#define E4M3_MIN_NORMAL (121u << 23) /* float32 bits of 2^-6 */
#define E4M3_REBIAS (120u << 3)
#define E4M3_MAX_CODE 0x7Eu
#define SUBNORMAL_ROUNDER 16384.0f /* 2^14: its float32 ulp is 2^-9, e4m3's subnormal step */
#define SUBNORMAL_ROUNDER_BITS 0x46800000u
#define MIN_SCALE 1.17549435e-38f /* the smallest normal float32 */

static inline float f32_from_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint32_t bits_of_f32(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static inline uint16_t bf16_from_f32(float value) {
    uint32_t bits = bits_of_f32(value);
    if ((bits & 0x7FFFFFFFu) > F32_EXP_MASK) return 0x7FC0; /* NaN, as torch's scalar cast */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* float16 bits -> float32, exactly (subnormals by a multiply that is exact, inf and NaN kept). */
static inline float f32_from_f16(uint16_t half) {
    uint32_t sign = (uint32_t)(half & 0x8000u) << 16;
    uint32_t exponent = (half >> 10) & 0x1Fu, mantissa = half & 0x3FFu;
    uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);
    uint32_t special = F32_EXP_MASK | (mantissa << 13);
    uint32_t subnormal = bits_of_f32((float)(int32_t)mantissa * 0x1p-24f);
    uint32_t magnitude = exponent == 0 ? subnormal : (exponent == 31 ? special : normal);
    return f32_from_bits(magnitude | sign);
}

/* float32 -> float16 bits, rounded to nearest even; overflow to inf, NaN to a quiet NaN. */
static inline uint16_t f16_from_f32(float value) {
    uint32_t bits = bits_of_f32(value);
    uint32_t sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7FFFFFFFu;
    /* normal: round the mantissa to 10 bits (a carry moves the exponent), exponent bias 127 -> 15 */
    uint32_t normal = ((magnitude + 0xFFFu + ((magnitude >> 13) & 1u)) >> 13) - (112u << 10);
    /* subnormal, below 2^-14: steps of 2^-24, and 1024 steps are the smallest normal's bits */
    float small = f32_from_bits(magnitude) < 0x1p-14f ? f32_from_bits(magnitude) : 0x1p-14f;
    uint32_t subnormal = (uint32_t)(int32_t)rintf(small * 0x1p24f); /* at most 1024: no overflow */
    uint32_t out = magnitude < 0x38800000u ? subnormal : normal;
    out = magnitude >= 0x477FF000u ? 0x7C00u : out; /* 65520 and above round to inf */
    out = magnitude > F32_EXP_MASK ? 0x7E00u : out;
    return (uint16_t)(sign | out);
}

/* ---- loading and storing one element of each source dtype ---- */

static inline float load_bf16(const void *rows, int64_t i) {
    return f32_from_bits((uint32_t)((const uint16_t *)rows)[i] << 16);
}
static inline float load_f16(const void *rows, int64_t i) { return f32_from_f16(((const uint16_t *)rows)[i]); }
static inline float load_f32(const void *rows, int64_t i) { return ((const float *)rows)[i]; }

static inline void store_bf16(void *out, int64_t i, float v) { ((uint16_t *)out)[i] = bf16_from_f32(v); }
static inline void store_f16(void *out, int64_t i, float v) { ((uint16_t *)out)[i] = f16_from_f32(v); }
static inline void store_f32(void *out, int64_t i, float v) { ((float *)out)[i] = v; }

/* The row's largest magnitude as float32 bits: the largest of the magnitudes' bit patterns, which
 * order as the values do (NaN above inf), so one integer max per element. */
static inline uint16_t max_magnitude_16(const void *rows, int64_t n) {
    const uint16_t *row = rows;
    uint16_t top = 0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t magnitude = row[i] & 0x7FFF;
        top = magnitude > top ? magnitude : top;
    }
    return top;
}

static inline uint32_t amax_bits_bf16(const void *rows, int64_t n) {
    return (uint32_t)max_magnitude_16(rows, n) << 16;
}

static inline uint32_t amax_bits_f16(const void *rows, int64_t n) {
    return bits_of_f32(f32_from_f16(max_magnitude_16(rows, n)));
}

static inline uint32_t amax_bits_f32(const void *rows, int64_t n) {
    const uint32_t *row = rows;
    uint32_t top = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t magnitude = row[i] & 0x7FFFFFFFu;
        top = magnitude > top ? magnitude : top;
    }
    return top;
}

/* ---- fp8 ---- */

/* 2^-k and 2^k, the smallest power of two with amax * 2^-k <= 448 (codec._fp8_scales). */
static inline void fp8_scale_of(uint32_t amax_bits, float *inverse, float *scale) {
    int32_t k = (int32_t)(amax_bits >> 23) - 135 + ((amax_bits & 0x7FFFFFu) > 0x600000u);
    k = k < -126 ? -126 : k;
    *inverse = f32_from_bits((uint32_t)(127 - k) << 23);
    *scale = amax_bits >= F32_EXP_MASK ? f32_from_bits(0x7FC00000u) : f32_from_bits((uint32_t)(127 + k) << 23);
}

/* The e4m3 code of x * inverse, rounded to nearest even (codec._fp8_codes). Unsigned arithmetic:
 * for finite x the values are torch's int32 ones; for NaN (a refused row) it wraps, defined. */
static inline uint8_t fp8_code(float x, float inverse) {
    float scaled = fabsf(x) * inverse;
    uint32_t bits = bits_of_f32(scaled);
    uint32_t normal = ((bits + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20) - E4M3_REBIAS;
    uint32_t subnormal = bits_of_f32(scaled + SUBNORMAL_ROUNDER) - SUBNORMAL_ROUNDER_BITS;
    uint32_t code = bits < E4M3_MIN_NORMAL ? subnormal : normal;
    code = code < E4M3_MAX_CODE ? code : E4M3_MAX_CODE;
    return (uint8_t)(code | ((bits_of_f32(x) >> 24) & 0x80u));
}

/* The code's e4m3 value times scale, within +-limit (codec._fp8_values: the two NaN codes read
 * as +-480, as there). */
static inline float fp8_value(uint8_t code, float scale, float limit) {
    uint32_t magnitude = code & 0x7Fu;
    /* (float) of the unsigned value: fp8 decode ran slower through int32 (docs/kv-connector.md) */
    float value = magnitude >= 8 ? f32_from_bits((magnitude << 20) + (120u << 23)) : (float)magnitude * 0x1p-9f;
    value = f32_from_bits(bits_of_f32(value) | ((uint32_t)(code & 0x80u) << 24)) * scale;
    return value < -limit ? -limit : (value > limit ? limit : value);
}

/* fp8 decode looks each code up in a table of the row's 256 decoded values (the same fp8_value,
 * so the same bits): faster than the per-element arithmetic, in cache (docs/kv-connector.md). */
#define FP8_KERNELS(NAME)                                                                           \
    static void fp8_encode_##NAME(const void *rows, int64_t nrows, int64_t n, uint8_t *codes,        \
                                  float *scales) {                                                  \
        for (int64_t r = 0; r < nrows; r++) {                                                       \
            const char *row = (const char *)rows + r * n * (int64_t)sizeof(NAME##_t);               \
            float inverse;                                                                          \
            fp8_scale_of(amax_bits_##NAME(row, n), &inverse, &scales[r]);                           \
            uint8_t *out = codes + r * n;                                                           \
            for (int64_t i = 0; i < n; i++) out[i] = fp8_code(load_##NAME(row, i), inverse);        \
        }                                                                                           \
    }                                                                                               \
    static void fp8_decode_##NAME(const uint8_t *codes, const float *scales, int64_t nrows,         \
                                  int64_t n, float limit, void *out) {                              \
        NAME##_t table[256];                                                                        \
        for (int64_t r = 0; r < nrows; r++) {                                                       \
            const uint8_t *row = codes + r * n;                                                     \
            NAME##_t *target = (NAME##_t *)((char *)out + r * n * (int64_t)sizeof(NAME##_t));       \
            for (int c = 0; c < 256; c++) store_##NAME(table, c, fp8_value((uint8_t)c, scales[r], limit)); \
            for (int64_t i = 0; i < n; i++) target[i] = table[row[i]];                              \
        }                                                                                           \
    }

/* ---- int8 ---- */

/* 127 / amax and amax / 127 (codec._int8_scales; NaN or inf stay so). */
static inline void int8_scale_of(uint32_t amax_bits, float *inverse, float *scale) {
    float value = f32_from_bits(amax_bits) / 127.0f;
    value = value < MIN_SCALE ? MIN_SCALE : value;
    *scale = value;
    *inverse = 1.0f / value;
}

static inline int8_t int8_code(float x, float inverse) {
    float value = x * inverse;
    value = value < -127.0f ? -127.0f : (value > 127.0f ? 127.0f : value);
    value = value == value ? value : 0.0f; /* NaN (a refused row): any code, but a defined one */
    return (int8_t)rintf(value);
}

#define INT8_KERNELS(NAME)                                                                          \
    static void int8_encode_##NAME(const void *rows, int64_t nrows, int64_t n, int8_t *codes,        \
                                   float *scales) {                                                 \
        for (int64_t r = 0; r < nrows; r++) {                                                       \
            const char *row = (const char *)rows + r * n * (int64_t)sizeof(NAME##_t);               \
            float inverse;                                                                          \
            int8_scale_of(amax_bits_##NAME(row, n), &inverse, &scales[r]);                          \
            int8_t *out = codes + r * n;                                                            \
            for (int64_t i = 0; i < n; i++) out[i] = int8_code(load_##NAME(row, i), inverse);       \
        }                                                                                           \
    }                                                                                               \
    static void int8_decode_##NAME(const int8_t *codes, const float *scales, int64_t nrows,         \
                                   int64_t n, void *out) {                                          \
        for (int64_t r = 0; r < nrows; r++) {                                                       \
            const int8_t *row = codes + r * n;                                                      \
            char *target = (char *)out + r * n * (int64_t)sizeof(NAME##_t);                         \
            float scale = scales[r];                                                                \
            for (int64_t i = 0; i < n; i++) store_##NAME(target, i, (float)row[i] * scale);         \
        }                                                                                           \
    }

typedef uint16_t bf16_t;
typedef uint16_t f16_t;
typedef float f32_t;

FP8_KERNELS(bf16)
FP8_KERNELS(f16)
FP8_KERNELS(f32)
INT8_KERNELS(bf16)
INT8_KERNELS(f16)
INT8_KERNELS(f32)

/* ---- entry points: 0 on success, -1 for an unknown dtype ---- */

/* The SHA-256 of the source this library was built from (native.py passes it at build time), so
 * that a library built from other source is never used. */
const char *dllm_kvcodec_source(void) { return KVCODEC_SOURCE_SHA256; }

int dllm_fp8_encode(int dtype, const void *rows, int64_t nrows, int64_t n, uint8_t *codes, float *scales) {
    switch (dtype) {
    case KV_BF16: fp8_encode_bf16(rows, nrows, n, codes, scales); return 0;
    case KV_F16: fp8_encode_f16(rows, nrows, n, codes, scales); return 0;
    case KV_F32: fp8_encode_f32(rows, nrows, n, codes, scales); return 0;
    default: return -1;
    }
}

int dllm_fp8_decode(int dtype, const uint8_t *codes, const float *scales, int64_t nrows, int64_t n, float limit,
                    void *out) {
    switch (dtype) {
    case KV_BF16: fp8_decode_bf16(codes, scales, nrows, n, limit, out); return 0;
    case KV_F16: fp8_decode_f16(codes, scales, nrows, n, limit, out); return 0;
    case KV_F32: fp8_decode_f32(codes, scales, nrows, n, limit, out); return 0;
    default: return -1;
    }
}

int dllm_int8_encode(int dtype, const void *rows, int64_t nrows, int64_t n, int8_t *codes, float *scales) {
    switch (dtype) {
    case KV_BF16: int8_encode_bf16(rows, nrows, n, codes, scales); return 0;
    case KV_F16: int8_encode_f16(rows, nrows, n, codes, scales); return 0;
    case KV_F32: int8_encode_f32(rows, nrows, n, codes, scales); return 0;
    default: return -1;
    }
}

int dllm_int8_decode(int dtype, const int8_t *codes, const float *scales, int64_t nrows, int64_t n, void *out) {
    switch (dtype) {
    case KV_BF16: int8_decode_bf16(codes, scales, nrows, n, out); return 0;
    case KV_F16: int8_decode_f16(codes, scales, nrows, n, out); return 0;
    case KV_F32: int8_decode_f32(codes, scales, nrows, n, out); return 0;
    default: return -1;
    }
}
