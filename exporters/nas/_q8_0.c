/* GGML's Q8_0 blocks in one pass over float32 or bfloat16 rows: the GGUF writer's q8_0
   (exporters/nas/gguf_out.py), the bytes gguf.quants.quantize(x, Q8_0) gives.

   Per 32 values x: amax = max |x|, d = amax / 127 (float32 division), id = d ? 1 / d : 0, and
   q = round(x * id) to nearest, halves away from zero, as int8: the float32 operations of gguf-py's numpy
   code (and of ggml's quantize_row_q8_0_ref). The rounding is done as the truncation of v + copysign(0.5 -
   2^-25, v), which equals roundf(v) for every float32 of magnitude up to 128 (checked over all of them,
   exporters/nas/gguf_out.py) and vectorizes where roundf does not. The scale d is written as float32 into
   `scales`; the caller converts it to float16 with numpy (its rounding, the reference's) and stores it in
   each block's first two bytes, which this leaves alone. bfloat16 is widened exactly (a shift). Built with
   -ffp-contract=off (setup.py): x * id must be rounded before the addition, never fused into one FMA. Finite
   values only (a NaN weight gives whatever it gives, as in numpy). numpy takes about eight passes over the
   values for the same (0.4 GB/s of float32 here); this is one. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32
#define BLOCK_BYTES 34

static inline float widen(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static void quantize_block(const float *x, uint8_t *out, float *scale) {
    float amax = 0.0f;
    for (int i = 0; i < BLOCK; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int8_t *q = (int8_t *)(out + 2);
    for (int i = 0; i < BLOCK; i++) {
        const float v = x[i] * id;
        q[i] = (int8_t)(v + copysignf(0.5f - 0x1p-25f, v)); /* to nearest, halves away from zero */
    }
    *scale = d;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define Q8_0_X86 1

/* The same operations on 32 values in four AVX2 registers: exact max, one division, one multiply per
   value, the same rounding, then the int32 results packed to int8 in order. */
__attribute__((target("avx2"))) static inline void block_avx2(__m256 x[4], uint8_t *out, float *scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float d = _mm_cvtss_f32(h) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m256 half = _mm256_set1_ps(0.5f - 0x1p-25f);
    __m256i q[4];
    for (int k = 0; k < 4; k++) {
        __m256 v = _mm256_mul_ps(x[k], id);
        v = _mm256_add_ps(v, _mm256_or_ps(_mm256_and_ps(v, sign), half));
        q[k] = _mm256_cvttps_epi32(v);
    }
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)(out + 2), bytes);
    *scale = d;
}

__attribute__((target("avx2"))) static void quantize_avx2(const void *src, Py_ssize_t blocks, uint8_t *dst,
                                                          float *scales, int bfloat16) {
    __m256 x[4];
    for (Py_ssize_t b = 0; b < blocks; b++) {
        if (bfloat16) {
            const __m128i *bits = (const __m128i *)((const uint16_t *)src + b * BLOCK);
            for (int k = 0; k < 4; k++) {
                __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(bits + k));
                x[k] = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
            }
        } else {
            const float *f = (const float *)src + b * BLOCK;
            for (int k = 0; k < 4; k++)
                x[k] = _mm256_loadu_ps(f + 8 * k);
        }
        block_avx2(x, dst + b * BLOCK_BYTES, scales + b);
    }
}
#endif

static void quantize_scalar(const void *src, Py_ssize_t blocks, uint8_t *dst, float *scales, int bfloat16) {
    float block[BLOCK];
    for (Py_ssize_t b = 0; b < blocks; b++) {
        const float *x;
        if (bfloat16) {
            const uint16_t *bits = (const uint16_t *)src + b * BLOCK;
            for (int i = 0; i < BLOCK; i++)
                block[i] = widen(bits[i]);
            x = block;
        } else {
            x = (const float *)src + b * BLOCK;
        }
        quantize_block(x, dst + b * BLOCK_BYTES, scales + b);
    }
}

static int has_avx2(void) {
#ifdef Q8_0_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

/* quantize(src, count, dst, scales, bfloat16[, vector]): addresses as integers; `count` values (a multiple
   of 32) from src (float32, or bfloat16 bits) into count / 32 blocks of 34 bytes at dst and count / 32
   float32 scales; with AVX2 where the CPU has it (vector=False: the scalar code, for the tests); runs
   without the interpreter lock. The caller checks sizes. */
static PyObject *quantize(PyObject *self, PyObject *args) {
    Py_ssize_t src, count, dst, scales;
    int bfloat16, vector = 1;
    if (!PyArg_ParseTuple(args, "nnnnp|p", &src, &count, &dst, &scales, &bfloat16, &vector))
        return NULL;
    const int avx2 = vector && has_avx2();
    Py_BEGIN_ALLOW_THREADS
#ifdef Q8_0_X86
    if (avx2)
        quantize_avx2((const void *)src, count / BLOCK, (uint8_t *)dst, (float *)scales, bfloat16);
    else
#endif
        quantize_scalar((const void *)src, count / BLOCK, (uint8_t *)dst, (float *)scales, bfloat16);
    Py_END_ALLOW_THREADS
    (void)avx2;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS, "Q8_0 blocks of float32 or bfloat16 values (see the file)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_q8_0", NULL, -1, methods};

PyMODINIT_FUNC PyInit__q8_0(void) { return PyModule_Create(&module); }
