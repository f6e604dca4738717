/* The receiver's batch check in one pass: slot bounds, promised slots, slots written
 * once, source-row bounds, and (optionally) both index arrays copied out for staging.
 *
 * Why C: the same-host (ipc) plane checks every page of a push before it copies a byte.
 * numpy needs about eight passes over the arrays for that (min/max of each, three fancy
 * indexes and two counts over the slot masks, two copies into the staging buffer); on
 * the H200's VM they cost 190-270 us of a just-woken thread for a 16384-page push, in
 * series with a ~550 us copy. One loop does it in a few microseconds, and cheap enough
 * that a big push can be checked and launched in parts (the GPU starts on the first part
 * while the rest is checked).
 *
 * All or nothing: on the first bad entry every mark this call made is undone and nothing
 * is reported as accepted; the caller fails the transfer with the code's message.
 *
 * pack_pair is the sender's side of the same arrays: one pass that narrows both int64
 * arrays to int32 (the wire's 4-byte form) and finds what post_push must check (the
 * lowest slot, whether every value fits). numpy needed seven passes (four reductions, two
 * astype, one asarray); on the H200's VM ~60 us of a 16384-page push.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "index arrays travel little-endian; this loop reads them natively"
#endif

enum { OK = 0, SLOT_OUTSIDE = 1, SLOT_NOT_GIVEN = 2, SLOT_TWICE = 3, ROW_NEGATIVE = 4, ROW_BEYOND = 5 };

#define CHECK_LOOP(T)                                                                    \
    do {                                                                                 \
        const char *S = (const char *)slots.buf, *R = (const char *)rows.buf;          \
        T *OS = out_buf ? (T *)out_buf : NULL;                                           \
        T *OR = out_buf ? (T *)(out_buf + rows_at) : NULL;                               \
        for (i = 0; i < n; i++) {                                                        \
            T s_, r_; /* memcpy: the arrays sit anywhere in a message (unaligned) */     \
            memcpy(&s_, S + i * sizeof(T), sizeof(T));                                   \
            memcpy(&r_, R + i * sizeof(T), sizeof(T));                                   \
            int64_t s = (int64_t)s_, r = (int64_t)r_;                                    \
            if ((uint64_t)s >= (uint64_t)num_slots) { code = SLOT_OUTSIDE; value = s; break; } \
            if (r < 0) { code = ROW_NEGATIVE; value = r; break; }                        \
            if (r >= row_limit) { code = ROW_BEYOND; value = r; break; }                 \
            if (ok && !ok[s]) { code = SLOT_NOT_GIVEN; value = s; break; }               \
            if (written) {                                                               \
                if (written[s]) { code = SLOT_TWICE; value = s; break; }                 \
                written[s] = 1;                                                          \
            }                                                                            \
            if (r > max_row) max_row = r;                                                \
            if (OS) { OS[i] = (T)s; OR[i] = (T)r; }                                      \
        }                                                                                \
        if (code != OK && written)                                                       \
            for (Py_ssize_t j = 0; j < i; j++) {                                         \
                T s_;                                                                    \
                memcpy(&s_, S + j * sizeof(T), sizeof(T));                               \
                written[(int64_t)s_] = 0;                                                \
            }                                                                            \
    } while (0)

static int get_opt(PyObject *o, Py_buffer *b, int flags, const char *what) {
    if (o == Py_None) {
        b->obj = NULL;
        b->buf = NULL;
        b->len = 0;
        return 0;
    }
    if (PyObject_GetBuffer(o, b, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a %sbuffer or None", what,
                     (flags & PyBUF_WRITABLE) ? "writable " : "");
        return -1;
    }
    return 0;
}

static PyObject *check_stage(PyObject *self, PyObject *args) {
    PyObject *slots_o, *rows_o, *ok_o, *written_o, *out_o;
    int width;
    Py_ssize_t num_slots, rows_at;
    long long row_limit;
    if (!PyArg_ParseTuple(args, "OOinLOOOn", &slots_o, &rows_o, &width, &num_slots,
                          &row_limit, &ok_o, &written_o, &out_o, &rows_at))
        return NULL;
    if (width != 4 && width != 8) return PyErr_Format(PyExc_ValueError, "width must be 4 or 8, got %d", width);
    Py_buffer slots = {0}, rows = {0}, okb = {0}, wb = {0}, outb = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(slots_o, &slots, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(rows_o, &rows, PyBUF_SIMPLE) < 0) goto done;
    if (get_opt(ok_o, &okb, PyBUF_SIMPLE, "ok") < 0) goto done;
    if (get_opt(written_o, &wb, PyBUF_WRITABLE, "written") < 0) goto done;
    if (get_opt(out_o, &outb, PyBUF_WRITABLE, "out") < 0) goto done;
    if (slots.len != rows.len || slots.len % width) {
        PyErr_Format(PyExc_ValueError, "slots (%zd bytes) and rows (%zd bytes) must be equal arrays of %d-byte integers",
                     slots.len, rows.len, width);
        goto done;
    }
    Py_ssize_t n = slots.len / width;
    if (num_slots < 0 || (okb.obj && okb.len < num_slots) || (wb.obj && wb.len < num_slots)) {
        PyErr_Format(PyExc_ValueError, "slot masks hold %zd / %zd entries, fewer than the %zd slots",
                     okb.len, wb.len, num_slots);
        goto done;
    }
    if (outb.obj && (rows_at < n * width || rows_at % width || outb.len < rows_at + n * width)) {
        PyErr_Format(PyExc_ValueError, "out (%zd bytes) cannot hold %zd slots and rows from byte %zd", outb.len, n,
                     rows_at);
        goto done;
    }
    const uint8_t *ok = (const uint8_t *)okb.buf;
    uint8_t *written = (uint8_t *)wb.buf;
    char *out_buf = (char *)outb.buf;
    int code = OK;
    int64_t value = 0, max_row = -1;
    Py_ssize_t i = 0;
    Py_BEGIN_ALLOW_THREADS
    if (width == 4)
        CHECK_LOOP(int32_t);
    else
        CHECK_LOOP(int64_t);
    Py_END_ALLOW_THREADS
    if (code == OK)
        result = Py_BuildValue("(inL)", OK, (Py_ssize_t)-1, (long long)max_row);
    else
        result = Py_BuildValue("(inL)", code, i, (long long)value);
done:
    PyBuffer_Release(&slots);
    if (rows.obj) PyBuffer_Release(&rows);
    if (okb.obj) PyBuffer_Release(&okb);
    if (wb.obj) PyBuffer_Release(&wb);
    if (outb.obj) PyBuffer_Release(&outb);
    return result;
}

static PyObject *pack_pair(PyObject *self, PyObject *args) {
    PyObject *rows_o, *slots_o, *orows_o, *oslots_o;
    if (!PyArg_ParseTuple(args, "OOOO", &rows_o, &slots_o, &orows_o, &oslots_o)) return NULL;
    Py_buffer rows = {0}, slots = {0}, orows = {0}, oslots = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(rows_o, &rows, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(slots_o, &slots, PyBUF_SIMPLE) < 0) goto done;
    if (PyObject_GetBuffer(orows_o, &orows, PyBUF_WRITABLE) < 0) goto done;
    if (PyObject_GetBuffer(oslots_o, &oslots, PyBUF_WRITABLE) < 0) goto done;
    if (rows.len != slots.len || rows.len % 8) {
        PyErr_Format(PyExc_ValueError, "rows (%zd bytes) and slots (%zd bytes) must be equal arrays of int64",
                     rows.len, slots.len);
        goto done;
    }
    Py_ssize_t n = rows.len / 8;
    if (orows.len < n * 4 || oslots.len < n * 4) {
        PyErr_Format(PyExc_ValueError, "outputs (%zd / %zd bytes) cannot hold %zd int32 each", orows.len,
                     oslots.len, n);
        goto done;
    }
    if ((uintptr_t)rows.buf % 8 || (uintptr_t)slots.buf % 8 || (uintptr_t)orows.buf % 4 ||
        (uintptr_t)oslots.buf % 4) {
        PyErr_SetString(PyExc_ValueError, "pack_pair needs aligned arrays (numpy's are)");
        goto done;
    }
    /* OR-accumulated bits instead of min/max: the loop vectorises with plain SSE2.
     * v + 2^31 has bits above 31 iff v lies outside int32; the sign bit of s (s + 1) is
     * set iff s < 0 (s < -1). */
    uint64_t out_of_range = 0, negative = 0, below_m1 = 0;
    int64_t low = 0;
    const int64_t *R = (const int64_t *)rows.buf, *S = (const int64_t *)slots.buf;
    int32_t *OR = (int32_t *)orows.buf, *OS = (int32_t *)oslots.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t r = (uint64_t)R[i], s = (uint64_t)S[i];
        OR[i] = (int32_t)r; /* meaningful only when everything fits (checked below) */
        OS[i] = (int32_t)s;
        out_of_range |= (r + 0x80000000ull) | (s + 0x80000000ull);
        negative |= s;
        below_m1 |= s + 1;
    }
    if (below_m1 >> 63) { /* rare: a bad slot; find the lowest for the message */
        for (Py_ssize_t i = 0; i < n; i++) low = S[i] < low ? S[i] : low;
    } else if (negative >> 63) {
        low = -1;
    }
    Py_END_ALLOW_THREADS
    int narrow = (out_of_range >> 32) == 0;
    result = Py_BuildValue("(OL)", narrow ? Py_True : Py_False, (long long)low);
done:
    if (rows.obj) PyBuffer_Release(&rows);
    if (slots.obj) PyBuffer_Release(&slots);
    if (orows.obj) PyBuffer_Release(&orows);
    if (oslots.obj) PyBuffer_Release(&oslots);
    return result;
}

static PyMethodDef methods[] = {
    {"pack_pair", pack_pair, METH_VARARGS,
     "pack_pair(rows, slots, out_rows, out_slots) -> (narrow, lowest_slot): one pass over two "
     "native int64 arrays of equal length, writing each value truncated to int32 into the outputs. "
     "narrow: every value fits in int32 (else the outputs mean nothing). lowest_slot: min(0, slots)."},
    {"check_stage", check_stage, METH_VARARGS,
     "check_stage(slots, rows, width, num_slots, row_limit, ok, written, out, rows_at) -> "
     "(code, index, value): one pass over two little-endian index arrays of `width` bytes. "
     "Each slot must lie in [0, num_slots), be promised (ok[slot] != 0, when ok is given) and "
     "not written yet (written[slot] == 0, when written is given; then marked); each row must "
     "lie in [0, row_limit). With `out`, slots are copied to its byte 0 and rows to byte "
     "rows_at. Returns (0, -1, highest row or -1) on success, else (code, first bad index, "
     "its value) with every mark of this call undone: 1 slot outside, 2 slot not promised, "
     "3 slot written twice, 4 negative row, 5 row >= row_limit."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slotcheck",
                                    "The receiver's one-pass batch check (see _slotcheck.c).", -1, methods};

PyMODINIT_FUNC PyInit__slotcheck(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "SLOT_OUTSIDE", SLOT_OUTSIDE) < 0 ||
        PyModule_AddIntConstant(m, "SLOT_NOT_GIVEN", SLOT_NOT_GIVEN) < 0 ||
        PyModule_AddIntConstant(m, "SLOT_TWICE", SLOT_TWICE) < 0 ||
        PyModule_AddIntConstant(m, "ROW_NEGATIVE", ROW_NEGATIVE) < 0 ||
        PyModule_AddIntConstant(m, "ROW_BEYOND", ROW_BEYOND) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
