/* Bounded spin-waits with the GIL released (disagg.transport.spin).
 *
 * Why C: a Python loop that polls (select(0), Event.is_set) takes the GIL between polls,
 * so it slows the thread doing the work and, when that thread holds the GIL, sleeps on
 * the GIL itself (measured on the H200 VM: no gain). Here the whole window
 * runs without the GIL; only the return takes it back.
 *
 * wait_readable(fd, spin_ns, publish=()) -> bool: poll(fd, POLLIN) with a zero timeout
 *   until it reports anything (readable, error, hang-up: the caller's own select sorts it
 *   out) or spin_ns passed. An epoll descriptor is readable while any of its watched
 *   descriptors is ready, so one call watches a whole selector. `publish`: flag buffers
 *   whose first byte is set to 1 once the GIL is released, before the spin. A waiter
 *   spinning on such a flag (wait_flag) then finds the GIL free when it returns; a flag
 *   set from Python, GIL held, sends it to sleep on the GIL instead (a futex wake-up:
 *   ~50 us on the H200's VM).
 * wait_flag(buffer, spin_ns) -> bool: until the buffer's first byte is non-zero (an
 *   acquire load: what the setter wrote before the byte is visible) or spin_ns passed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <poll.h>
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ __volatile__("yield")
#else
#define RELAX() ((void)0)
#endif

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static PyObject *wait_readable(PyObject *self, PyObject *args) {
    int fd;
    long long spin_ns;
    PyObject *publish = NULL;
    if (!PyArg_ParseTuple(args, "iL|O", &fd, &spin_ns, &publish)) return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "wait_readable: descriptor must be >= 0");
        return NULL;
    }
    PyObject *seq = NULL;
    Py_buffer *flags = NULL;
    Py_ssize_t nflags = 0, got = 0;
    if (publish != NULL && publish != Py_None) {
        seq = PySequence_Fast(publish, "wait_readable: publish must be a sequence of buffers");
        if (seq == NULL) return NULL;
        nflags = PySequence_Fast_GET_SIZE(seq);
        flags = nflags ? PyMem_Calloc((size_t)nflags, sizeof(Py_buffer)) : NULL;
        if (nflags && flags == NULL) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
        for (; got < nflags; got++) {
            PyObject *o = PySequence_Fast_GET_ITEM(seq, got);
            if (PyObject_GetBuffer(o, &flags[got], PyBUF_WRITABLE) < 0) goto fail;
            if (flags[got].len < 1) {
                PyBuffer_Release(&flags[got]);
                PyErr_SetString(PyExc_ValueError, "wait_readable: a publish flag is empty");
                goto fail;
            }
        }
    }
    int ready = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < nflags; i++) __atomic_store_n((unsigned char *)flags[i].buf, 1, __ATOMIC_RELEASE);
    uint64_t end = now_ns() + (uint64_t)(spin_ns > 0 ? spin_ns : 0);
    struct pollfd p = {fd, POLLIN, 0};
    for (;;) {
        if (poll(&p, 1, 0) != 0) { /* ready, or an error the caller's select reports */
            ready = 1;
            break;
        }
        if (now_ns() >= end) break;
        for (int i = 0; i < 32; i++) RELAX();
    }
    Py_END_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&flags[i]);
    PyMem_Free(flags);
    Py_XDECREF(seq);
    return PyBool_FromLong(ready);
fail:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&flags[i]);
    PyMem_Free(flags);
    Py_XDECREF(seq);
    return NULL;
}

static PyObject *wait_flag(PyObject *self, PyObject *args) {
    Py_buffer buf;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "y*L", &buf, &spin_ns)) return NULL;
    if (buf.len < 1) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "wait_flag: the flag buffer is empty");
        return NULL;
    }
    const unsigned char *flag = (const unsigned char *)buf.buf;
    int set = 0;
    Py_BEGIN_ALLOW_THREADS;
    uint64_t end = now_ns() + (uint64_t)(spin_ns > 0 ? spin_ns : 0);
    for (;;) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE)) {
            set = 1;
            break;
        }
        if (now_ns() >= end) break;
        for (int i = 0; i < 32; i++) RELAX();
    }
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&buf);
    return PyBool_FromLong(set);
}

static PyMethodDef methods[] = {
    {"wait_readable", wait_readable, METH_VARARGS,
     "wait_readable(fd, spin_ns, publish=()) -> bool: set each publish flag's first byte once "
     "the GIL is released, then spin until fd polls ready or spin_ns passed."},
    {"wait_flag", wait_flag, METH_VARARGS,
     "wait_flag(buffer, spin_ns) -> bool: spin (GIL released) until buffer[0] != 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_spin", NULL, -1, methods};

PyMODINIT_FUNC PyInit__spin(void) { return PyModule_Create(&module); }
