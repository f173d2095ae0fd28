/* float16 rows scaled in float32 and rounded once, in one pass: the "fold" of half-precision weights.

   dst[r, c] = float16(float32(src[r, c]) * scale[r or c]), rounded to nearest even: the IEEE operations
   of numpy's float16(float32(w) * g) and of ONNX Runtime's Cast -> Mul -> Cast (the same F16C conversion
   instructions), so the same bits. numpy converts float16 one element at a time (0.7 GB/s here) and ONNX
   Runtime takes three passes through float32 temporaries (2.4-4 GB/s); this pass is limited by memory
   (docs/scale.md, ninth pass). Used by passes/stream_concat.py, which falls back to ONNX Runtime where
   this module is not built or the CPU lacks AVX2/F16C. */
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

/* Row r of src and dst starts r * stride elements after the first; scale has one value per row
   (per_row) or per column. src may be dst (each 8 values are read before they are written). */
__attribute__((target("avx2,f16c"))) static void scale_rows(const uint16_t *src, Py_ssize_t src_stride,
                                                            uint16_t *dst, Py_ssize_t dst_stride,
                                                            Py_ssize_t rows, Py_ssize_t cols,
                                                            const float *scale, int per_row) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const uint16_t *s = src + r * src_stride;
        uint16_t *d = dst + r * dst_stride;
        Py_ssize_t c = 0;
        for (; c + 8 <= cols; c += 8)
            scale8(s + c, d + c, per_row ? _mm256_set1_ps(scale[r]) : _mm256_loadu_ps(scale + c));
        if (c < cols) { /* the last few through a padded block: the same instructions */
            uint16_t in[8] = {0}, out[8];
            float g[8] = {0};
            memcpy(in, s + c, (size_t)(cols - c) * sizeof(uint16_t));
            for (Py_ssize_t i = 0; i < cols - c; i++)
                g[i] = per_row ? scale[r] : scale[c + i];
            scale8(in, out, _mm256_loadu_ps(g));
            memcpy(d + c, out, (size_t)(cols - c) * sizeof(uint16_t));
        }
    }
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

/* scale(src, src_stride, dst, dst_stride, rows, cols, scale, per_row): addresses as integers, strides in
   elements; runs without the interpreter lock. The caller checks shapes and calls supported() first. */
static PyObject *scale(PyObject *self, PyObject *args) {
    Py_ssize_t src, src_stride, dst, dst_stride, rows, cols, scale_address;
    int per_row;
    if (!PyArg_ParseTuple(args, "nnnnnnnp", &src, &src_stride, &dst, &dst_stride, &rows, &cols,
                          &scale_address, &per_row))
        return NULL;
#ifdef HALF_SCALE_X86
    Py_BEGIN_ALLOW_THREADS
    scale_rows((const uint16_t *)src, src_stride, (uint16_t *)dst, dst_stride, rows, cols,
               (const float *)scale_address, per_row);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "float16 scaling is built for x86-64 only");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "Whether this CPU runs scale (AVX2 and F16C)."},
    {"scale", scale, METH_VARARGS, "float16 rows times float32 scales, rounded once (see the file)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_half_scale", NULL, -1, methods};

PyMODINIT_FUNC PyInit__half_scale(void) { return PyModule_Create(&module); }
