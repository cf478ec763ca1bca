/* radixcache.core._native: the tree's hot read paths in C.
 *
 * Three functions, each the exact twin of a pure-Python reference kept in radixcache/core
 * (tests/test_native.py compares them on random trees and ids):
 *
 *   walk(kb, end, root, page_bytes)             -> HybridRadixCache._walk_py
 *   duplicates(kvn, path, split_child, split_k, known)
 *                                               -> HybridRadixCache._duplicates_py
 *   words_to_key(ids)                           -> radixcache.core.keys._from_words64_py
 *                                                  (and _has_images, in the same pass)
 *   gather(node, start, out)                    -> HybridRadixCache._gather_py
 *   exclusive(method, busy)                     -> radixcache.manager.cache_manager._exclusive
 *
 * walk, duplicates and gather only read the tree (the nodes' children, key, snapshot, host, depth,
 * parent and value_np), so they cannot break its invariants; gather writes only the caller's
 * array; words_to_key reads a buffer of ids. Built by the package's own set-up (setuptools, gcc); where it
 * is not built, or RADIXCACHE_NATIVE=0, the tree runs the Python reference.
 *
 * NOTE: the lock walks (lock, unlock, relock) were tried here too and measured: 5.3 -> 5.0 us per
 * lock in the SGLang scheduler benchmark (paths are a few nodes; the call's cost is elsewhere), so
 * they stay in Python, where a mistake cannot corrupt memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static PyObject *s_children, *s_key, *s_snapshot, *s_host, *s_depth, *s_value_np, *s_parent;

/* 0 when a call got `want` arguments, else -1 with a TypeError naming the function. */
static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd argument%s, got %zd", name, want, want == 1 ? "" : "s", nargs);
    return -1;
}

/* An int argument as Py_ssize_t (-1 and an exception on failure). */
static Py_ssize_t as_size(PyObject *o, const char *what)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    return PyLong_AsSsize_t(o);
}

/* Bytes (whole pages, at least one) on which key[0:] and edge agree, the first page known to
 * agree: a binary search over pages, one memcmp per probe (HybridRadixCache._common_bytes). */
static Py_ssize_t common_bytes(const char *key, const char *edge, Py_ssize_t limit, Py_ssize_t pb)
{
    Py_ssize_t lo = 1, hi = limit / pb;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) / 2;
        if (memcmp(key, edge, (size_t)(mid * pb)) == 0)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo * pb;
}

PyDoc_STRVAR(walk_doc,
             "walk(kb, end, root, page_bytes) -> (path, pos, snap_at, partial)\n\n"
             "Follow kb[:end] down from root: the whole edges matched (a list of nodes), the bytes\n"
             "matched, how many of those nodes lead to the deepest one holding a snapshot (either\n"
             "tier), and the child whose edge the key leaves part-way (None when it leaves at a node).\n"
             "Reads only. The twin of HybridRadixCache._walk_py.");

static PyObject *walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_nargs("walk", nargs, 4) < 0)
        return NULL;
    PyObject *kb = args[0];
    if (!PyBytes_CheckExact(kb)) {
        PyErr_Format(PyExc_TypeError, "walk's key must be bytes, got %.100s", Py_TYPE(kb)->tp_name);
        return NULL;
    }
    Py_ssize_t end = as_size(args[1], "end");
    if (end == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t pb = as_size(args[3], "page_bytes");
    if (pb == -1 && PyErr_Occurred())
        return NULL;
    const char *k = PyBytes_AS_STRING(kb);
    Py_ssize_t klen = PyBytes_GET_SIZE(kb);
    if (end < 0 || end > klen || pb <= 0) {
        PyErr_Format(PyExc_ValueError, "walk: end %zd outside [0, %zd] or page_bytes %zd not positive", end, klen,
                     pb);
        return NULL;
    }
    PyObject *path = PyList_New(0);
    if (path == NULL)
        return NULL;
    PyObject *node = args[2]; /* borrowed: the root, then path's last item */
    PyObject *partial = NULL;
    Py_ssize_t pos = 0, snap_at = 0;
    while (pos < end) {
        PyObject *children = PyObject_GetAttr(node, s_children);
        if (children == NULL)
            goto fail;
        if (!PyDict_Check(children)) {
            PyErr_Format(PyExc_TypeError, "a node's children must be a dict, got %.100s", Py_TYPE(children)->tp_name);
            Py_DECREF(children);
            goto fail;
        }
        Py_ssize_t n = klen - pos < pb ? klen - pos : pb; /* kb[pos:pos + pb] */
        PyObject *page = PyBytes_FromStringAndSize(k + pos, n);
        if (page == NULL) {
            Py_DECREF(children);
            goto fail;
        }
        PyObject *child = PyDict_GetItemWithError(children, page); /* borrowed */
        Py_DECREF(page);
        if (child == NULL) {
            Py_DECREF(children);
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        Py_INCREF(child);
        Py_DECREF(children);
        PyObject *edge = PyObject_GetAttr(child, s_key);
        if (edge == NULL) {
            Py_DECREF(child);
            goto fail;
        }
        if (!PyBytes_Check(edge)) {
            PyErr_Format(PyExc_TypeError, "a node's key must be bytes, got %.100s", Py_TYPE(edge)->tp_name);
            Py_DECREF(edge);
            Py_DECREF(child);
            goto fail;
        }
        const char *e = PyBytes_AS_STRING(edge);
        Py_ssize_t el = PyBytes_GET_SIZE(edge);
        if (el <= end - pos && memcmp(k + pos, e, (size_t)el) == 0) { /* kb.startswith(edge, pos, end) */
            Py_DECREF(edge);
            pos += el;
            int err = PyList_Append(path, child);
            Py_DECREF(child); /* path holds it */
            if (err)
                goto fail;
            node = child;
            PyObject *snap = PyObject_GetAttr(child, s_snapshot);
            if (snap == NULL)
                goto fail;
            int held = snap != Py_None;
            Py_DECREF(snap);
            if (!held) {
                PyObject *host = PyObject_GetAttr(child, s_host);
                if (host == NULL)
                    goto fail;
                held = host != Py_None;
                Py_DECREF(host);
            }
            if (held)
                snap_at = PyList_GET_SIZE(path);
            continue;
        }
        Py_ssize_t limit = el < end - pos ? el : end - pos;
        pos += common_bytes(k + pos, e, limit, pb);
        Py_DECREF(edge);
        partial = child; /* owned */
        break;
    }
    if (partial == NULL) {
        partial = Py_None;
        Py_INCREF(partial);
    }
    PyObject *out = Py_BuildValue("(NnnN)", path, pos, snap_at, partial);
    return out; /* on failure Py_BuildValue released both references ("N") */
fail:
    Py_DECREF(path);
    return NULL;
}

/* A contiguous 1-D array of signed integers as a buffer: 8-byte ones (numpy int64), and with
 * `allow32` 4-byte ones too (numpy int32: an engine's page table row); view->itemsize says which.
 * `writable`: the caller writes into it. 0: taken, 1: not such an array (no exception set: the
 * caller falls back), -1: an error. */
static int index_buffer(PyObject *o, Py_buffer *view, int allow32, int writable)
{
    if (o == Py_None || !PyObject_CheckBuffer(o))
        return 1;
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) != 0) {
        /* numpy refuses a strided array with ValueError, other exporters with BufferError */
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            return 1;
        }
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    int ok64 = view->itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0);
    int ok32 = allow32 && view->itemsize == 4 && (strcmp(f, "i") == 0 || (sizeof(long) == 4 && strcmp(f, "l") == 0));
    if (view->ndim != 1 || !(ok64 || ok32)) {
        PyBuffer_Release(view);
        return 1;
    }
    return 0;
}

static int int64_buffer(PyObject *o, Py_buffer *view)
{
    return index_buffer(o, view, 0, 0);
}

typedef struct {
    Py_buffer view;
    Py_ssize_t from, count; /* the compared items of view: [from, from + count) */
} Span;

PyDoc_STRVAR(duplicates_doc,
             "duplicates(kvn, path, split_child, split_k, known) -> bytearray | None | NotImplemented\n\n"
             "The caller's KV indices kvn (int64 or int32) that differ from the tree's for the same tokens,\n"
             "over the nodes of path deeper than known and the first split_k tokens of split_child\n"
             "(or None), as native int64 bytes; None when none differ. NotImplemented when an index\n"
             "array is not a contiguous int64 (kvn: or int32) numpy array (the caller runs the Python reference,\n"
             "HybridRadixCache._duplicates_py, whose twin this is).");

static PyObject *duplicates(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_nargs("duplicates", nargs, 5) < 0)
        return NULL;
    PyObject *path = args[1], *split_child = args[2];
    if (!PyList_CheckExact(path)) {
        PyErr_Format(PyExc_TypeError, "duplicates' path must be a list, got %.100s", Py_TYPE(path)->tp_name);
        return NULL;
    }
    Py_ssize_t split_k = as_size(args[3], "split_k");
    if (split_k == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t known = as_size(args[4], "known");
    if (known == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t npath = PyList_GET_SIZE(path);
    Span *spans = PyMem_Calloc((size_t)npath + 1, sizeof(Span));
    if (spans == NULL)
        return PyErr_NoMemory();
    Py_ssize_t nspans = 0, start = 0, total = 0;
    PyObject *result = NULL;
    Py_buffer mine;
    int have_mine = 0;
    int r = index_buffer(args[0], &mine, 1, 0);
    if (r)
        goto fallback_or_fail;
    have_mine = 1;
    for (Py_ssize_t i = 0; i < npath; i++) {
        PyObject *n = PyList_GET_ITEM(path, i);
        PyObject *d = PyObject_GetAttr(n, s_depth);
        if (d == NULL)
            goto fail;
        Py_ssize_t depth = as_size(d, "a node's depth");
        Py_DECREF(d);
        if (depth == -1 && PyErr_Occurred())
            goto fail;
        if (i == npath - 1)
            start = depth; /* path[-1].depth */
        if (depth <= known)
            continue;
        PyObject *v = PyObject_GetAttr(n, s_value_np);
        if (v == NULL)
            goto fail;
        r = int64_buffer(v, &spans[nspans].view);
        Py_DECREF(v);
        if (r)
            goto fallback_or_fail;
        spans[nspans].from = 0;
        spans[nspans].count = spans[nspans].view.len / 8;
        total += spans[nspans].count;
        nspans++;
    }
    start -= total; /* the first compared span's start */
    if (split_child != Py_None) {
        PyObject *v = PyObject_GetAttr(split_child, s_value_np);
        if (v == NULL)
            goto fail;
        r = int64_buffer(v, &spans[nspans].view);
        Py_DECREF(v);
        if (r)
            goto fallback_or_fail;
        Py_ssize_t have = spans[nspans].view.len / 8;
        spans[nspans].from = 0;
        spans[nspans].count = split_k < have ? (split_k < 0 ? 0 : split_k) : have; /* value_np[:k] */
        nspans++;
    }
    if (known > start && nspans) { /* the first span starts inside the known prefix: cut it */
        Py_ssize_t cut = known - start < spans[0].count ? known - start : spans[0].count;
        spans[0].from += cut;
        spans[0].count -= cut;
        start += cut;
    }
    /* the caller's indices: int64, or int32 widened as they are read */
    const int64_t *m64 = mine.itemsize == 8 ? (const int64_t *)mine.buf : NULL;
    const int32_t *m32 = mine.itemsize == 4 ? (const int32_t *)mine.buf : NULL;
#define MINE(i) (m64 ? m64[i] : (int64_t)m32[i])
    Py_ssize_t mlen = mine.len / mine.itemsize;
    Py_ssize_t differ = 0, at = start;
    for (Py_ssize_t s = 0; s < nspans; s++) {
        if (at < 0 || at + spans[s].count > mlen) {
            PyErr_Format(PyExc_ValueError, "duplicates: span [%zd, %zd) outside the caller's %zd indices", at,
                         at + spans[s].count, mlen);
            goto fail;
        }
        const int64_t *t = (const int64_t *)spans[s].view.buf + spans[s].from;
        for (Py_ssize_t j = 0; j < spans[s].count; j++)
            differ += MINE(at + j) != t[j];
        at += spans[s].count;
    }
    if (differ == 0) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    result = PyByteArray_FromStringAndSize(NULL, differ * 8);
    if (result == NULL)
        goto fail;
    int64_t *out = (int64_t *)PyByteArray_AS_STRING(result);
    at = start;
    for (Py_ssize_t s = 0; s < nspans; s++) {
        const int64_t *t = (const int64_t *)spans[s].view.buf + spans[s].from;
        for (Py_ssize_t j = 0; j < spans[s].count; j++)
            if (MINE(at + j) != t[j])
                *out++ = MINE(at + j);
        at += spans[s].count;
    }
#undef MINE
    goto done;
fallback_or_fail:
    if (r < 0)
        goto fail;
    result = Py_NotImplemented;
    Py_INCREF(result);
    goto done;
fail:
    Py_CLEAR(result);
done:
    for (Py_ssize_t s = 0; s < nspans; s++)
        PyBuffer_Release(&spans[s].view);
    PyMem_Free(spans);
    if (have_mine)
        PyBuffer_Release(&mine);
    return result;
}



PyDoc_STRVAR(words_to_key_doc,
             "words_to_key(ids) -> tuple[bytes, bool] | None\n\n"
             "The canonical key bytes (native uint32 per id) of a contiguous buffer of 8-byte integer\n"
             "ids (array('q'), numpy int64 or uint64), and whether an id is at least IMAGE_ID_BASE\n"
             "(2**30: an image-derived id), read in the same pass; None when an id is outside\n"
             "[0, 2**31) (the caller's reference names it), or the buffer is not such ids. The twin of\n"
             "radixcache.core.keys._from_words64_py (and _has_images of its bytes).");

static PyObject *words_to_key(PyObject *module, PyObject *ids)
{
    (void)module;
    Py_buffer v;
    if (PyObject_GetBuffer(ids, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError) ||
            PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        return NULL;
    }
    const char *f = v.format ? v.format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    int is_signed = strcmp(f, "q") == 0 || strcmp(f, "l") == 0;
    int is_unsigned = strcmp(f, "Q") == 0 || strcmp(f, "L") == 0;
    if (v.itemsize != 8 || v.ndim > 1 || !(is_signed || is_unsigned)) {
        PyBuffer_Release(&v);
        Py_RETURN_NONE;
    }
    Py_ssize_t n = v.len / 8;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        PyBuffer_Release(&v);
        return NULL;
    }
    uint32_t *o = (uint32_t *)PyBytes_AS_STRING(out);
    const uint64_t *w = (const uint64_t *)v.buf; /* a negative signed id reads as >= 2**63 here */
    uint64_t images = 0; /* bit 30 of any id: an image-derived id (IMAGE_ID_BASE is 2**30) */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (w[i] >= ((uint64_t)1 << 31)) {
            Py_DECREF(out);
            PyBuffer_Release(&v);
            Py_RETURN_NONE;
        }
        images |= w[i];
        o[i] = (uint32_t)w[i];
    }
    PyBuffer_Release(&v);
    return Py_BuildValue("(NO)", out, (images >> 30) & 1 ? Py_True : Py_False);
}

PyDoc_STRVAR(gather_doc,
             "gather(node, start, out) -> bytearray | None | NotImplemented\n\n"
             "The KV indices of tokens [start, node.depth) of node's path, read from the edges' value_np\n"
             "up the parents: written into out[start:node.depth] (a writable contiguous int64 or int32\n"
             "array at least node.depth long; int32 takes the low 32 bits, as numpy's assignment), or,\n"
             "with out None, returned as native int64 bytes. NotImplemented when an edge's value_np or out\n"
             "is not such an array (the caller runs the Python reference, HybridRadixCache._gather_py,\n"
             "whose twin this is). The caller checks start and out's length.");

static PyObject *gather(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_nargs("gather", nargs, 3) < 0)
        return NULL;
    Py_ssize_t start = as_size(args[1], "start");
    if (start == -1 && PyErr_Occurred())
        return NULL;
    PyObject *result = NULL, *n = args[0];
    Py_buffer out;
    int r = 0, have_out = 0;
    if (args[2] != Py_None) {
        r = index_buffer(args[2], &out, 1, 1);
        if (r)
            goto fallback_or_fail;
        have_out = 1;
    }
    Py_INCREF(n);
    for (int first = 1; n != Py_None; first = 0) {
        PyObject *d = PyObject_GetAttr(n, s_depth);
        if (d == NULL)
            goto fail;
        Py_ssize_t depth = as_size(d, "a node's depth");
        Py_DECREF(d);
        if (depth == -1 && PyErr_Occurred())
            goto fail;
        if (first) { /* the output's extent: [start, depth) */
            Py_ssize_t want = depth > start ? depth - start : 0;
            if (have_out) {
                if (out.len / out.itemsize < depth || start < 0) {
                    PyErr_Format(PyExc_ValueError, "gather: out holds %zd indices, node depth %zd, start %zd",
                                 out.len / out.itemsize, depth, start);
                    goto fail;
                }
            } else if ((result = PyByteArray_FromStringAndSize(NULL, want * 8)) == NULL)
                goto fail;
        }
        if (depth <= start)
            break;
        PyObject *v = PyObject_GetAttr(n, s_value_np);
        if (v == NULL)
            goto fail;
        Py_buffer edge;
        r = int64_buffer(v, &edge);
        Py_DECREF(v);
        if (r)
            goto fallback_or_fail;
        Py_ssize_t k = edge.len / 8, top = depth - k, from = top < start ? start - top : 0;
        if (top < 0) {
            PyBuffer_Release(&edge);
            PyErr_Format(PyExc_ValueError, "gather: an edge of %zd indices ends at depth %zd", k, depth);
            goto fail;
        }
        const int64_t *e = (const int64_t *)edge.buf;
        if (!have_out)
            memcpy(PyByteArray_AS_STRING(result) + (top + from - start) * 8, e + from, (size_t)(k - from) * 8);
        else if (out.itemsize == 8)
            memcpy((int64_t *)out.buf + top + from, e + from, (size_t)(k - from) * 8);
        else {
            int32_t *o = (int32_t *)out.buf + top;
            for (Py_ssize_t j = from; j < k; j++)
                o[j] = (int32_t)(uint32_t)(uint64_t)e[j];
        }
        PyBuffer_Release(&edge);
        PyObject *p = PyObject_GetAttr(n, s_parent);
        if (p == NULL)
            goto fail;
        Py_SETREF(n, p);
    }
    Py_DECREF(n);
    n = NULL;
    if (have_out) {
        PyBuffer_Release(&out);
        Py_RETURN_NONE;
    }
    return result;
fallback_or_fail:
    Py_XDECREF(n);
    Py_CLEAR(result);
    if (have_out)
        PyBuffer_Release(&out);
    if (r < 0)
        return NULL;
    Py_RETURN_NOTIMPLEMENTED;
fail:
    Py_XDECREF(n);
    Py_CLEAR(result);
    if (have_out)
        PyBuffer_Release(&out);
    return NULL;
}

/* ------------------------------------------------------------------ exclusive
 * A method run under its object's non-blocking guard (radixcache.manager.cache_manager._exclusive,
 * whose Python wrapper stays the reference): acquire(False) on self._guard (a threading.Lock), the
 * method, release, without the Python wrapper's frame and argument packing (that wrapper cost ~5%
 * of the SGLang scheduler benchmark's cache time, session 35: seven guarded calls per request).
 * When the guard is held, busy(name) builds the exception raised. */
typedef struct {
    PyObject_HEAD
    PyObject *method; /* the undecorated function */
    PyObject *busy;   /* busy(name) -> the exception to raise when the guard is held */
    PyObject *name;   /* the method's __name__ */
    PyObject *dict;   /* __name__, __qualname__, __doc__, __wrapped__ */
    vectorcallfunc vectorcall;
} Exclusive;

static PyObject *s_guard, *s_acquire, *s_release;

static PyObject *exclusive_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Exclusive *x = (Exclusive *)self;
    if (PyVectorcall_NARGS(nargsf) < 1) {
        PyErr_Format(PyExc_TypeError, "%U() needs the object it guards as its first argument", x->name);
        return NULL;
    }
    PyObject *lock = PyObject_GetAttr(args[0], s_guard);
    if (lock == NULL)
        return NULL;
    PyObject *call[2] = {lock, Py_False};
    PyObject *got = PyObject_VectorcallMethod(s_acquire, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (got == NULL) {
        Py_DECREF(lock);
        return NULL;
    }
    int held = PyObject_IsTrue(got);
    Py_DECREF(got);
    if (held <= 0) {
        Py_DECREF(lock);
        if (held == 0) {
            PyObject *exc = PyObject_CallOneArg(x->busy, x->name);
            if (exc != NULL) {
                PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
                Py_DECREF(exc);
            }
        }
        return NULL;
    }
    PyObject *result = PyObject_Vectorcall(x->method, args, nargsf, kwnames);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb); /* the method's exception, if any, survives the release */
    PyObject *rel = PyObject_VectorcallMethod(s_release, call, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(lock);
    if (rel == NULL) { /* a release that fails wins: the guard's state is unknown */
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        Py_XDECREF(result);
        return NULL;
    }
    Py_DECREF(rel);
    PyErr_Restore(et, ev, tb);
    return result;
}

static PyObject *exclusive_get(PyObject *self, PyObject *obj, PyObject *type)
{
    (void)type;
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static int exclusive_traverse(PyObject *self, visitproc visit, void *arg)
{
    Exclusive *x = (Exclusive *)self;
    Py_VISIT(x->method);
    Py_VISIT(x->busy);
    Py_VISIT(x->name);
    Py_VISIT(x->dict);
    return 0;
}

static int exclusive_clear(PyObject *self)
{
    Exclusive *x = (Exclusive *)self;
    Py_CLEAR(x->method);
    Py_CLEAR(x->busy);
    Py_CLEAR(x->name);
    Py_CLEAR(x->dict);
    return 0;
}

static void exclusive_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    exclusive_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyTypeObject ExclusiveType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "radixcache.core._native.Exclusive",
    .tp_basicsize = sizeof(Exclusive),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "A method run under its object's non-blocking guard (see exclusive).",
    .tp_vectorcall_offset = offsetof(Exclusive, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = exclusive_get,
    .tp_dictoffset = offsetof(Exclusive, dict),
    .tp_traverse = exclusive_traverse,
    .tp_clear = exclusive_clear,
    .tp_dealloc = exclusive_dealloc,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
};

PyDoc_STRVAR(exclusive_doc,
             "exclusive(method, busy) -> callable\n\n"
             "method wrapped to run under its first argument's non-blocking guard (its _guard, a\n"
             "threading.Lock): acquire(False), the call, release (also when the call raises); when\n"
             "the guard is held, the exception busy(method.__name__) is raised and method is not\n"
             "called. Bound as a method when it is a class attribute. The twin of\n"
             "radixcache.manager.cache_manager._exclusive's Python wrapper.");

static PyObject *exclusive(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_nargs("exclusive", nargs, 2) < 0)
        return NULL;
    if (!PyCallable_Check(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "exclusive: method and busy must be callable");
        return NULL;
    }
    PyObject *name = PyObject_GetAttrString(args[0], "__name__");
    if (name == NULL)
        return NULL;
    if (!PyUnicode_Check(name)) {
        Py_DECREF(name);
        PyErr_SetString(PyExc_TypeError, "exclusive: the method's __name__ must be a str");
        return NULL;
    }
    Exclusive *x = PyObject_GC_New(Exclusive, &ExclusiveType);
    if (x == NULL) {
        Py_DECREF(name);
        return NULL;
    }
    x->method = Py_NewRef(args[0]);
    x->busy = Py_NewRef(args[1]);
    x->name = name;
    x->dict = NULL;
    x->vectorcall = exclusive_vectorcall;
    PyObject_GC_Track((PyObject *)x);
    return (PyObject *)x;
}

static PyMethodDef methods[] = {
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL, walk_doc},
    {"duplicates", (PyCFunction)(void (*)(void))duplicates, METH_FASTCALL, duplicates_doc},
    {"words_to_key", words_to_key, METH_O, words_to_key_doc},
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL, gather_doc},
    {"exclusive", (PyCFunction)(void (*)(void))exclusive, METH_FASTCALL, exclusive_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "The radix tree's hot read paths in C (see radixcache/core/_native.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    if (!(s_children = PyUnicode_InternFromString("children")) || !(s_key = PyUnicode_InternFromString("key")) ||
        !(s_snapshot = PyUnicode_InternFromString("snapshot")) || !(s_host = PyUnicode_InternFromString("host")) ||
        !(s_depth = PyUnicode_InternFromString("depth")) || !(s_value_np = PyUnicode_InternFromString("value_np")) ||
        !(s_parent = PyUnicode_InternFromString("parent")) || !(s_guard = PyUnicode_InternFromString("_guard")) ||
        !(s_acquire = PyUnicode_InternFromString("acquire")) || !(s_release = PyUnicode_InternFromString("release")))
        return NULL;
    if (PyType_Ready(&ExclusiveType) < 0)
        return NULL;
    return PyModule_Create(&module);
}
