/* Two loops of the block-key computation (keys.py), moved out of the interpreter.
 *
 * Why C: a 32k-token prompt arrives from the engine as a Python list. Unboxing its ints
 * costs ~0.45 ms with the fastest pure-Python route (struct.pack), and the 2,048-step key
 * chain ~0.3 ms of interpreter overhead around ~0.08 ms of hashing: together most of the
 * 1 ms budget of get_num_new_matched_tokens. Here they cost ~0.1 ms and ~0.09 ms.
 *
 * No hashing is implemented here: chain_digests calls the digest function it is given
 * (xxhash.xxh3_128_digest), so the keys are the pure-Python path's keys by construction;
 * tests compare the two. keys.py falls back to pure Python when this module was not built
 * (no compiler at install time) and on any input this module refuses.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KEY_BYTES 16

/* pack_int64(tokens: list | tuple, start: int, stop: int) -> bytes: native-endian int64 of
 * tokens[start:stop] (no slice is built). TypeError for an element that is not exactly int
 * (bool, numpy scalars, floats: the caller's fallback decides what those mean),
 * OverflowError outside int64, IndexError for a range outside the sequence. */
static PyObject *pack_int64(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "pack_int64(tokens, start, stop)");
        return NULL;
    }
    PyObject *seq = args[0];
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        PyErr_Format(PyExc_TypeError, "tokens must be a list or tuple, not %.100s",
                     Py_TYPE(seq)->tp_name);
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t stop = PyLong_AsSsize_t(args[2]);
    if (stop == -1 && PyErr_Occurred()) return NULL;
    if (start < 0 || stop < start || stop > PySequence_Fast_GET_SIZE(seq)) {
        return PyErr_Format(PyExc_IndexError, "range %zd:%zd outside %zd tokens", start, stop,
                            PySequence_Fast_GET_SIZE(seq));
    }
    /* A list's items are read in place; nothing below runs Python code, so the list cannot
     * change under us. */
    PyObject **items = PySequence_Fast_ITEMS(seq) + start;
    Py_ssize_t n = stop - start;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) return NULL;
    int64_t *dst = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[i];
        if (!PyLong_CheckExact(o)) {
            Py_DECREF(out);
            return PyErr_Format(PyExc_TypeError, "token %zd is %.100s, not int", start + i,
                                Py_TYPE(o)->tp_name);
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow) {
            Py_DECREF(out);
            return PyErr_Format(PyExc_OverflowError, "token %zd does not fit in int64",
                                start + i);
        }
        dst[i] = (int64_t)v;
    }
    return out;
}

/* chain_digests(digest, prev: bytes-like[16], data: bytes-like, block_bytes: int) -> bytes
 * Key i = digest(key i-1 || data[i*block_bytes:(i+1)*block_bytes]), key -1 = prev; the
 * keys are returned back to back (16 bytes each). data must hold whole blocks. */
static PyObject *chain_digests(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "chain_digests(digest, prev, data, block_bytes)");
        return NULL;
    }
    PyObject *digest = args[0];
    Py_ssize_t bb = PyLong_AsSsize_t(args[3]);
    if (bb == -1 && PyErr_Occurred()) return NULL;
    if (bb <= 0) return PyErr_Format(PyExc_ValueError, "block_bytes must be > 0, got %zd", bb);
    Py_buffer prev, data;
    if (PyObject_GetBuffer(args[1], &prev, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &data, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&prev);
        return NULL;
    }
    PyObject *out = NULL;
    if (prev.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "prev must be %d bytes, got %zd", KEY_BYTES, prev.len);
        goto done;
    }
    if (data.len % bb) {
        PyErr_Format(PyExc_ValueError, "data of %zd bytes is not whole blocks of %zd", data.len,
                     bb);
        goto done;
    }
    Py_ssize_t n = data.len / bb;
    out = PyBytes_FromStringAndSize(NULL, n * KEY_BYTES);
    if (out == NULL) goto done;
    char *keys = PyBytes_AS_STRING(out);
    const char *last = (const char *)prev.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* A fresh bytes per call: the digest may keep a reference to its argument. */
        PyObject *msg = PyBytes_FromStringAndSize(NULL, KEY_BYTES + bb);
        if (msg == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        char *m = PyBytes_AS_STRING(msg);
        memcpy(m, last, KEY_BYTES);
        memcpy(m + KEY_BYTES, (const char *)data.buf + i * bb, (size_t)bb);
        PyObject *h = PyObject_Vectorcall(digest, &msg, 1, NULL);
        Py_DECREF(msg);
        if (h == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        if (!PyBytes_Check(h) || PyBytes_GET_SIZE(h) != KEY_BYTES) {
            Py_DECREF(h);
            Py_CLEAR(out);
            PyErr_Format(PyExc_ValueError, "digest must return %d bytes", KEY_BYTES);
            goto done;
        }
        memcpy(keys + i * KEY_BYTES, PyBytes_AS_STRING(h), KEY_BYTES);
        Py_DECREF(h);
        last = keys + i * KEY_BYTES;
    }
done:
    PyBuffer_Release(&prev);
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef methods[] = {
    {"pack_int64", (PyCFunction)(void (*)(void))pack_int64, METH_FASTCALL,
     "Native-endian int64 bytes of tokens[start:stop], a list or tuple of ints."},
    {"chain_digests", (PyCFunction)(void (*)(void))chain_digests, METH_FASTCALL,
     "Chained digests of whole blocks, back to back."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keyhash",
                                    "Block-key loops of disagg.protocol.keys, in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__keyhash(void) { return PyModule_Create(&module); }
