/* Half-precision rows scaled in float32 and rounded once, in one pass: the "fold" of float16 and bfloat16
   weights.

   dst[r, c] = half(float32(src[r, c]) * scale[r or c]), rounded to nearest even: the IEEE operations of
   numpy's half(float32(w) * g). float16 with the F16C conversions that ONNX Runtime's casts use; bfloat16
   as ml_dtypes converts it (a shift up; rounding by adding 0x7FFF plus the lowest kept bit; a NaN becomes
   the quiet NaN 0x7FC0 with its sign). So the same bits. numpy converts float16 one element at a time
   (0.7 GB/s here), bfloat16 through ml_dtypes at 2.7 GB/s, and ONNX Runtime takes three passes through
   float32 temporaries (2.4-4 GB/s); this pass is limited by memory (docs/scale.md, ninth pass). Used by
   passes/io/stream_concat.py, which falls back to those where this module is not built or the CPU lacks
   AVX2/F16C. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HALF_SCALE_X86 1

__attribute__((target("avx2,f16c"))) static inline void scale8(const uint16_t *src, uint16_t *dst,
                                                                  __m256 scale) {
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
    __m128i y = _mm256_cvtps_ph(_mm256_mul_ps(x, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)dst, y);
}

__attribute__((target("avx2"))) static inline void scale8_bf16(const uint16_t *src, uint16_t *dst,
                                                               __m256 scale) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
    __m256 y = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)), scale);
    __m256i bits = _mm256_castps_si256(y), high = _mm256_srli_epi32(bits, 16);
    __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd); /* to nearest, ties to even */
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    __m256i sign = _mm256_and_si256(high, _mm256_set1_epi32(0x8000));
    __m256i quiet = _mm256_or_si256(sign, _mm256_set1_epi32(0x7FC0));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    __m256i half = _mm256_blendv_epi8(rounded, quiet, nan);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(half, half), 0xD8); /* lanes in order */
    _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(packed));
}

typedef void (*kernel8)(const uint16_t *, uint16_t *, __m256);

/* Row r of src and dst starts r * stride elements after the first; scale has one value per row
   (per_row) or per column. src may be dst (each 8 values are read before they are written). Inlined
   once per kernel, so that the kernel is inlined into its loop. */
__attribute__((target("avx2,f16c"), always_inline)) static inline void
scale_rows_with(kernel8 kernel, const uint16_t *src, Py_ssize_t src_stride, uint16_t *dst,
                Py_ssize_t dst_stride, Py_ssize_t rows, Py_ssize_t cols, const float *scale, int per_row) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const uint16_t *s = src + r * src_stride;
        uint16_t *d = dst + r * dst_stride;
        Py_ssize_t c = 0;
        for (; c + 8 <= cols; c += 8)
            kernel(s + c, d + c, per_row ? _mm256_set1_ps(scale[r]) : _mm256_loadu_ps(scale + c));
        if (c < cols) { /* the last few through a padded block: the same instructions */
            uint16_t in[8] = {0}, out[8];
            float g[8] = {0};
            memcpy(in, s + c, (size_t)(cols - c) * sizeof(uint16_t));
            for (Py_ssize_t i = 0; i < cols - c; i++)
                g[i] = per_row ? scale[r] : scale[c + i];
            kernel(in, out, _mm256_loadu_ps(g));
            memcpy(d + c, out, (size_t)(cols - c) * sizeof(uint16_t));
        }
    }
}

__attribute__((target("avx2,f16c"))) static void scale_rows(const uint16_t *src, Py_ssize_t src_stride,
                                                            uint16_t *dst, Py_ssize_t dst_stride,
                                                            Py_ssize_t rows, Py_ssize_t cols,
                                                            const float *scale, int per_row,
                                                            int bfloat16) {
    if (bfloat16)
        scale_rows_with(scale8_bf16, src, src_stride, dst, dst_stride, rows, cols, scale, per_row);
    else
        scale_rows_with(scale8, src, src_stride, dst, dst_stride, rows, cols, scale, per_row);
}
#endif

static PyObject *supported(PyObject *self, PyObject *args) {
#ifdef HALF_SCALE_X86
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"));
#else
    Py_RETURN_FALSE;
#endif
}

/* scale(src, src_stride, dst, dst_stride, rows, cols, scale, per_row, bfloat16): addresses as integers,
   strides in elements; float16 unless bfloat16; runs without the interpreter lock. The caller checks
   shapes and calls supported() first. */
static PyObject *scale(PyObject *self, PyObject *args) {
    Py_ssize_t src, src_stride, dst, dst_stride, rows, cols, scale_address;
    int per_row, bfloat16;
    if (!PyArg_ParseTuple(args, "nnnnnnnpp", &src, &src_stride, &dst, &dst_stride, &rows, &cols,
                          &scale_address, &per_row, &bfloat16))
        return NULL;
#ifdef HALF_SCALE_X86
    Py_BEGIN_ALLOW_THREADS
    scale_rows((const uint16_t *)src, src_stride, (uint16_t *)dst, dst_stride, rows, cols,
               (const float *)scale_address, per_row, bfloat16);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "half-precision scaling is built for x86-64 only");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "Whether this CPU runs scale (AVX2 and F16C)."},
    {"scale", scale, METH_VARARGS, "half-precision rows times float32 scales, rounded once (see the file)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_half_scale", NULL, -1, methods};

PyMODINIT_FUNC PyInit__half_scale(void) { return PyModule_Create(&module); }
