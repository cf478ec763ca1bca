/* linear_state._native: the CPU slot fingerprint and slot copy in C.
 *
 *   fingerprint(views, slot, weights, block) -> int
 *   copy_slot(rows, src, dst)
 *
 * The exact twin of SlotHasher's numpy and torch paths (linear_state/fingerprint.py, which stay the
 * reference; tests/test_fingerprint_native.py compares them bit for bit on every family's layout):
 * each row (one layer of one tensor) of the slot is read as words, widened to 64 bits as the
 * reference widens them (int32 and int16 keep their sign, bytes do not), summed per block of
 * `block` words modulo 2**64, and the block sums weighted by the hasher's odd weights. One pass
 * over the slot's bytes on the calling thread: inside SGLang's scheduler the numpy path's calls
 * cost ~58 us per small slot, this ~2. Reads only.
 *
 * copy_slot copies one slot's bytes onto another's, layer by layer, in the pool's byte views: what
 * LinearStatePool's immediate CPU copy does with torch._foreach_copy_ over two per-slot views
 * (tests/test_pool_native.py compares the two). Built by the package's own set-up.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* 0 when a call got `want` arguments, else -1 with a TypeError naming the function. */
static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, nargs);
    return -1;
}

/* The word kind of a buffer format: 8, 4, 2 (signed) or 1 (unsigned byte); 0 when not one. */
static int word_kind(const char *f)
{
    if (f == NULL)
        return 1; /* "B" */
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (!strcmp(f, "q") || !strcmp(f, "l"))
        return 8;
    if (!strcmp(f, "i"))
        return 4;
    if (!strcmp(f, "h"))
        return 2;
    if (!strcmp(f, "B"))
        return 1;
    return 0;
}

/* Sum of the n words at p (spaced `step` bytes apart) of kind k, widened, modulo 2**64. */
static uint64_t word_sum(const char *p, Py_ssize_t n, Py_ssize_t step, int k)
{
    uint64_t s = 0;
    Py_ssize_t j;
    switch (k) {
    case 8:
        if (step == 8) {
            const uint64_t *w = (const uint64_t *)p;
            for (j = 0; j < n; j++)
                s += w[j];
        } else {
            for (j = 0; j < n; j++) {
                uint64_t w;
                memcpy(&w, p + j * step, 8);
                s += w;
            }
        }
        break;
/* Sign-extending sum of n words of type T spaced `step` bytes apart (memcpy: any alignment). */
#define SIGNED_SUM(T)                                                                                                  \
    for (j = 0; j < n; j++) {                                                                                          \
        T w;                                                                                                           \
        memcpy(&w, p + j * step, sizeof w);                                                                            \
        s += (uint64_t)(int64_t)w;                                                                                     \
    }
    case 4:
        SIGNED_SUM(int32_t)
        break;
    case 2:
        SIGNED_SUM(int16_t)
        break;
#undef SIGNED_SUM
    default:
        for (j = 0; j < n; j++)
            s += (uint8_t)p[j * step];
    }
    return s;
}

PyDoc_STRVAR(fingerprint_doc,
             "fingerprint(views, slot, weights, block) -> int\n\n"
             "The fingerprint of `slot`: views are [L, S, words] arrays (int64, int32, int16 or uint8\n"
             "words, as SlotHasher cuts rows), weights the hasher's [rows, blocks] int64 weights (C\n"
             "order), block the words per block. The twin of SlotHasher's numpy path.\n\n"
             ":raises IndexError: slot outside a view's S. :raises ValueError: a view of another shape\n"
             "or word, or more rows or blocks than the weights have.");

static PyObject *fingerprint(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_nargs("fingerprint", nargs, 4) < 0)
        return NULL;
    PyObject *views = args[0];
    if (!PyList_Check(views)) {
        PyErr_Format(PyExc_TypeError, "views must be a list, got %.100s", Py_TYPE(views)->tp_name);
        return NULL;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(args[1]);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t block = PyLong_AsSsize_t(args[3]);
    if (block == -1 && PyErr_Occurred())
        return NULL;
    if (block <= 0) {
        PyErr_Format(PyExc_ValueError, "block must be positive, got %zd", block);
        return NULL;
    }
    Py_buffer m;
    if (PyObject_GetBuffer(args[2], &m, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0)
        return NULL;
    if (m.ndim != 2 || word_kind(m.format) != 8) {
        PyBuffer_Release(&m);
        PyErr_SetString(PyExc_ValueError, "weights must be a C-contiguous [rows, blocks] int64 array");
        return NULL;
    }
    const uint64_t *wt = (const uint64_t *)m.buf;
    Py_ssize_t rows = m.shape[0], blocks = m.shape[1], row = 0;
    uint64_t fp = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(views); i++) {
        Py_buffer v;
        if (PyObject_GetBuffer(PyList_GET_ITEM(views, i), &v, PyBUF_STRIDES | PyBUF_FORMAT) != 0)
            goto fail;
        int k = word_kind(v.format);
        if (v.ndim != 3 || k == 0 || v.itemsize != k) {
            PyBuffer_Release(&v);
            PyErr_SetString(PyExc_ValueError, "a view must be [L, S, words] of int64, int32, int16 or uint8 words");
            goto fail;
        }
        Py_ssize_t layers = v.shape[0], n = v.shape[2];
        if (slot < 0 || slot >= v.shape[1]) {
            PyErr_Format(PyExc_IndexError, "slot %zd outside [0, %zd)", slot, v.shape[1]);
            PyBuffer_Release(&v);
            goto fail;
        }
        Py_ssize_t nblocks = (n + block - 1) / block;
        if (row + layers > rows || nblocks > blocks) {
            PyErr_Format(PyExc_ValueError, "%zd rows of %zd blocks do not fit weights of %zd x %zd", row + layers,
                         nblocks, rows, blocks);
            PyBuffer_Release(&v);
            goto fail;
        }
        for (Py_ssize_t l = 0; l < layers; l++, row++) {
            const char *p = (const char *)v.buf + l * v.strides[0] + slot * v.strides[1];
            for (Py_ssize_t b = 0; b < nblocks; b++) {
                Py_ssize_t len = n - b * block < block ? n - b * block : block;
                fp += word_sum(p + b * block * v.strides[2], len, v.strides[2], k) * wt[row * blocks + b];
            }
        }
        PyBuffer_Release(&v);
    }
    PyBuffer_Release(&m);
    return PyLong_FromUnsignedLongLong((unsigned long long)fp);
fail:
    PyBuffer_Release(&m);
    return NULL;
}

PyDoc_STRVAR(copy_slot_doc,
             "copy_slot(rows, src, dst) -> None\n\n"
             "Copy slot src onto slot dst in each of rows, writable [L, S, bytes] uint8 views whose last\n"
             "dimension is contiguous (a pool's tensors as bytes): one memmove per layer. Every view is\n"
             "checked before any byte moves.\n\n"
             ":raises IndexError: src or dst outside a view's S. :raises ValueError: a view that is not\n"
             "such bytes (or is read-only).");

#define COPY_MAX_VIEWS 8

static PyObject *copy_slot(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_nargs("copy_slot", nargs, 3) < 0)
        return NULL;
    PyObject *rows = args[0];
    if (!PyList_Check(rows) || PyList_GET_SIZE(rows) > COPY_MAX_VIEWS) {
        PyErr_Format(PyExc_TypeError, "rows must be a list of at most %d views", COPY_MAX_VIEWS);
        return NULL;
    }
    Py_ssize_t src = PyLong_AsSsize_t(args[1]);
    if (src == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t dst = PyLong_AsSsize_t(args[2]);
    if (dst == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer v[COPY_MAX_VIEWS];
    Py_ssize_t n = PyList_GET_SIZE(rows), taken = 0;
    for (; taken < n; taken++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(rows, taken), &v[taken], PyBUF_STRIDES | PyBUF_WRITABLE) != 0)
            goto fail;
        Py_buffer *b = &v[taken];
        if (b->ndim != 3 || b->itemsize != 1 || (b->shape[2] > 1 && b->strides[2] != 1)) {
            PyErr_SetString(PyExc_ValueError, "a view must be [L, S, bytes] of contiguous bytes");
            taken++;
            goto fail;
        }
        if (src < 0 || src >= b->shape[1] || dst < 0 || dst >= b->shape[1]) {
            PyErr_Format(PyExc_IndexError, "slots %zd -> %zd outside [0, %zd)", src, dst, b->shape[1]);
            taken++;
            goto fail;
        }
    }
    if (src != dst)
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_buffer *b = &v[i];
            for (Py_ssize_t l = 0; l < b->shape[0]; l++) {
                char *base = (char *)b->buf + l * b->strides[0];
                memmove(base + dst * b->strides[1], base + src * b->strides[1], (size_t)b->shape[2]);
            }
        }
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&v[i]);
    Py_RETURN_NONE;
fail:
    for (Py_ssize_t i = 0; i < taken; i++)
        if (v[i].obj != NULL)
            PyBuffer_Release(&v[i]);
    return NULL;
}

static PyMethodDef methods[] = {
    {"fingerprint", (PyCFunction)(void (*)(void))fingerprint, METH_FASTCALL, fingerprint_doc},
    {"copy_slot", (PyCFunction)(void (*)(void))copy_slot, METH_FASTCALL, copy_slot_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "The CPU slot fingerprint and copy in C (see linear_state/_native.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
