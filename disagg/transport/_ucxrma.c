/* Post and drive thousands of UCX RMA operations (ucp_get_nbx / ucp_put_nbx) without a
 * Python step per operation (disagg/transport/ucx_rma.py).
 *
 * Built without UCX headers: the libucp entry points arrive from ctypes as integers
 * (function addresses of the copy of libucp that ucxx loaded), and the only types used
 * are mirrored below. Every call here must come from the thread that owns the worker
 * (the UCX plane's progress thread); the GIL is released while UCX runs, so the
 * caller's other threads keep going.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* ucs_status_ptr_t ucp_get_nbx(ucp_ep_h ep, void *buffer, size_t count,
 *                              uint64_t remote_addr, ucp_rkey_h rkey,
 *                              const ucp_request_param_t *param);
 * ucp_put_nbx has the same signature (buffer: the local source). */
typedef void *(*rma_fn)(void *, void *, size_t, uint64_t, void *, const void *);
/* ucs_status_t (a signed-char-sized enum) ucp_request_check_status(void *request) */
typedef int8_t (*check_fn)(void *);
typedef void (*free_fn)(void *);
/* unsigned ucp_worker_progress(ucp_worker_h worker) */
typedef unsigned (*progress_fn)(void *);

#define UCS_INPROGRESS 1
#define UCS_ERR_LAST (-100)
/* UCS_PTR_IS_ERR: (uintptr_t)ptr >= (uintptr_t)UCS_ERR_LAST */
#define PTR_IS_ERR(p) ((uintptr_t)(p) >= (uintptr_t)(intptr_t)UCS_ERR_LAST)

/* post(fn, ep, rkey, param, local, remote, length, n, reqs) -> (posted, nreqs, status)
 *
 * For i in [0, n): fn(ep, local[i], length[i], remote[i], rkey, param). ``local``,
 * ``remote``, ``length`` and ``reqs`` are addresses of uint64 arrays (n entries each;
 * ``reqs`` receives the request pointers of operations not completed in place, packed
 * from index 0). Stops at the first operation UCX refuses: ``posted`` is how many were
 * handed to UCX (those must still be completed or the endpoint closed), ``status`` that
 * refusal's ucs_status_t (0 when all were posted). */
static PyObject *post(PyObject *self, PyObject *args) {
    unsigned long long fn, ep, rkey, param, local, remote, length, reqs;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "KKKKKKKKn", &fn, &ep, &rkey, &param, &local, &remote,
                          &length, &n, &reqs))
        return NULL;
    if (!fn || !ep || !rkey || !param || n < 0 || (n && (!local || !remote || !length || !reqs))) {
        PyErr_SetString(PyExc_ValueError, "post: null pointer or negative count");
        return NULL;
    }
    rma_fn f = (rma_fn)(uintptr_t)fn;
    const uint64_t *loc = (const uint64_t *)(uintptr_t)local;
    const uint64_t *rem = (const uint64_t *)(uintptr_t)remote;
    const uint64_t *len = (const uint64_t *)(uintptr_t)length;
    uint64_t *out = (uint64_t *)(uintptr_t)reqs;
    Py_ssize_t i = 0, k = 0;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i < n; i++) {
        void *r = f((void *)(uintptr_t)ep, (void *)(uintptr_t)loc[i], (size_t)len[i], rem[i],
                    (void *)(uintptr_t)rkey, (const void *)(uintptr_t)param);
        if (PTR_IS_ERR(r)) {
            status = (int)(intptr_t)r;
            break;
        }
        if (r != NULL)
            out[k++] = (uint64_t)(uintptr_t)r;
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("nni", i, k, status);
}

/* Advance ``*start`` over the requests reqs[*start:n] that completed, in order, freeing
 * each; stops at the first one still in progress. Requests of one endpoint complete in
 * about the order they were posted (cma serves them FIFO), so this costs O(1) per
 * request over a batch, where re-checking every pending request after each progress
 * call costs O(n) per call: a later completed request is simply freed when the scan
 * reaches it. Records the first failure in ``*err``. */
static void reap(check_fn check, free_fn release, const uint64_t *r, Py_ssize_t n,
                 Py_ssize_t *start, int *err) {
    Py_ssize_t i = *start;
    for (; i < n; i++) {
        void *req = (void *)(uintptr_t)r[i];
        int st = check(req);
        if (st == UCS_INPROGRESS)
            break;
        release(req);
        if (st != 0 && *err == 0)
            *err = st;
    }
    *start = i;
}

/* drive(progress, worker, check, free, reqs, n, start, rounds) -> (start, status)
 *
 * Progress the worker up to ``rounds`` times (0: only check), after each call freeing
 * the requests reqs[start:n] that completed in order (``reap``), until all have.
 * Returns the new ``start`` (all complete and freed when it equals ``n``) and the
 * first failed request's ucs_status_t, 0 when none failed. */
static PyObject *drive(PyObject *self, PyObject *args) {
    unsigned long long progress, worker, check, release, reqs;
    Py_ssize_t n, start, rounds;
    if (!PyArg_ParseTuple(args, "KKKKKnnn", &progress, &worker, &check, &release, &reqs, &n,
                          &start, &rounds))
        return NULL;
    if (!check || !release || n < 0 || start < 0 || start > n || (n && !reqs) ||
        (rounds && (!progress || !worker))) {
        PyErr_SetString(PyExc_ValueError, "drive: null pointer or bad range");
        return NULL;
    }
    progress_fn p = (progress_fn)(uintptr_t)progress;
    check_fn c = (check_fn)(uintptr_t)check;
    free_fn f = (free_fn)(uintptr_t)release;
    const uint64_t *r = (const uint64_t *)(uintptr_t)reqs;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    reap(c, f, r, n, &start, &err);
    for (Py_ssize_t i = 0; i < rounds && start < n; i++) {
        p((void *)(uintptr_t)worker);
        reap(c, f, r, n, &start, &err);
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("ni", start, err);
}

static PyMethodDef methods[] = {
    {"post", post, METH_VARARGS, "Post n RMA operations; (posted, nreqs, status)."},
    {"drive", drive, METH_VARARGS, "Progress and reap requests; (remaining, status)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ucxrma",
                                    "Batched UCX RMA posting (see ucx_rma.py).", -1, methods};

PyMODINIT_FUNC PyInit__ucxrma(void) { return PyModule_Create(&module); }
