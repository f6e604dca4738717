/* Post and drive thousands of UCX RMA reads (ucp_get_nbx) without a Python step per
 * read, shared out among several reader threads through one atomic cursor
 * (disagg/transport/ucx/native_rma.py: RmaShared / RmaPull).
 *
 * Built without UCX headers: the libucp entry points arrive from ctypes as integers
 * (function addresses of the copy of libucp that ucxx loaded), and the only types used
 * are mirrored below. Every call here must come from the thread that owns the worker
 * it is given (the UCX plane's progress thread, or one of its reader lanes, each with
 * its own worker); the GIL is released while UCX runs, so the caller's other threads
 * keep going.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

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

/* progress calls a reader makes after a slice to see it complete before claiming more
 * (reads still in flight after that are reaped later, by ``drive``) */
#define PULL_SPIN 4096

/* pull(fn, ep, rkey, param, local, remote, length, n, cursor, slice, max_bytes,
 *      progress, worker, check, free, reqs, nreqs, start)
 *   -> (posted, bytes, nreqs, start, status)
 *
 * One reader's share of a read list that several threads read at once, each on its
 * own worker and endpoint (native_rma.RmaPull): claims ``slice`` operations at a time from
 * the shared ``*cursor`` (an int64 every reader of the list advances atomically), posts
 * them (``fn(ep, local[i], length[i], remote[i], rkey, param)``: ucp_get_nbx), and after each slice progresses the worker (up to ``PULL_SPIN``
 * times) until the reads it posted completed, reaping them (``reap``), so a reader
 * claims only as fast as it copies; until the cursor passes ``n`` or this call posted
 * ``max_bytes`` (0: no limit). Requests not completed in place are appended to ``reqs``
 * (room for ``n`` entries) from index ``nreqs``; ``start`` is how many of them were
 * seen complete and freed. A refused or failed operation stops every reader: the cursor
 * is moved past ``n``. Returns this call's posted operations and bytes, the new
 * ``nreqs``/``start`` and the first failure's ucs_status_t (0: none). */
static PyObject *pull(PyObject *self, PyObject *args) {
    unsigned long long fn, ep, rkey, param, local, remote, length, cursor, progress, worker,
        check, release, reqs;
    Py_ssize_t n, slice, nreqs, start;
    long long max_bytes;
    if (!PyArg_ParseTuple(args, "KKKKKKKnKnLKKKKKnn", &fn, &ep, &rkey, &param, &local, &remote,
                          &length, &n, &cursor, &slice, &max_bytes, &progress, &worker, &check,
                          &release, &reqs, &nreqs, &start))
        return NULL;
    if (!fn || !ep || !rkey || !param || !cursor || !progress || !worker || !check ||
        !release || n < 0 || slice < 1 || max_bytes < 0 || nreqs < 0 || nreqs > n ||
        start < 0 || start > nreqs || (n && (!local || !remote || !length || !reqs))) {
        PyErr_SetString(PyExc_ValueError, "pull: null pointer or bad range");
        return NULL;
    }
    rma_fn f = (rma_fn)(uintptr_t)fn;
    progress_fn p = (progress_fn)(uintptr_t)progress;
    check_fn c = (check_fn)(uintptr_t)check;
    free_fn rel = (free_fn)(uintptr_t)release;
    const uint64_t *loc = (const uint64_t *)(uintptr_t)local;
    const uint64_t *rem = (const uint64_t *)(uintptr_t)remote;
    const uint64_t *len = (const uint64_t *)(uintptr_t)length;
    int64_t *cur = (int64_t *)(uintptr_t)cursor;
    uint64_t *out = (uint64_t *)(uintptr_t)reqs;
    Py_ssize_t posted = 0;
    long long bytes = 0;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    while (status == 0 && (max_bytes == 0 || bytes < max_bytes)) {
        int64_t i0 = __atomic_fetch_add(cur, (int64_t)slice, __ATOMIC_RELAXED);
        if (i0 >= (int64_t)n)
            break;
        int64_t i1 = i0 + slice < (int64_t)n ? i0 + slice : (int64_t)n;
        for (int64_t i = i0; i < i1; i++) {
            void *r = f((void *)(uintptr_t)ep, (void *)(uintptr_t)loc[i], (size_t)len[i], rem[i],
                        (void *)(uintptr_t)rkey, (const void *)(uintptr_t)param);
            if (PTR_IS_ERR(r)) {
                status = (int)(intptr_t)r;
                break;
            }
            posted++;
            bytes += (long long)len[i];
            if (r != NULL && nreqs < n)
                out[nreqs++] = (uint64_t)(uintptr_t)r;
        }
        /* catch up before claiming more: UCX may queue a get and copy it only in a
         * later progress call (cma serves one per call), and reads claimed but not yet
         * copied would be a share the other readers cannot take over */
        for (int spin = 0; start < nreqs && spin < PULL_SPIN; spin++) {
            p((void *)(uintptr_t)worker);
            reap(c, rel, out, nreqs, &start, &status);
        }
        if (status != 0)
            __atomic_store_n(cur, (int64_t)n, __ATOMIC_RELAXED); /* stop the other readers */
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("nLnni", posted, bytes, nreqs, start, status);
}


/* ---- cma failures: a failed request, not an abort (ucx/cma_guard.py) -----------------
 *
 * When process_vm_readv/writev fails (the peer process is gone: ESRCH; its memory was
 * unmapped: EFAULT), UCX's cma transport (src/uct/sm/scopy/cma/cma_ep.c,
 * uct_cma_ep_tx_error) reports the endpoint error to UCP, then logs the failure at a
 * level that depends on whether UCP handled it: our shm endpoints run without error
 * handling (UCP_ERR_HANDLING_MODE_PEER would move every lane off shared memory), so UCP
 * answers "unhandled" and the message is logged at UCS_LOG_LEVEL_FATAL, which UCS's
 * default log handler turns into abort() (log_level_trigger). Apart from that log
 * call the error path is the ordinary one: uct_cma_ep_tx returns UCS_ERR_IO_ERROR and
 * the scopy transport completes the operation with it, so the ucp_get_nbx/put request
 * fails and its caller sees the status. This handler, pushed ahead of UCS's default one
 * (ucs_log_push_handler; handlers run newest first), takes exactly the FATAL messages
 * of cma_ep.c: it counts them, keeps the latest text, prints it as an error and stops
 * the dispatch, so no abort follows. Every other message goes on to UCS unchanged.
 *
 * Mirrors ucs/debug/log_def.h (UCX >= 1.11, checked by the caller):
 *   ucs_log_func_rc_t (*ucs_log_func_t)(const char *file, unsigned line,
 *       const char *function, ucs_log_level_t level,
 *       const ucs_log_component_config_t *comp_conf, const char *message, va_list ap);
 *   void ucs_log_push_handler(ucs_log_func_t handler); */
#define UCS_LOG_LEVEL_FATAL 0
#define UCS_LOG_FUNC_RC_STOP 0
#define UCS_LOG_FUNC_RC_CONTINUE 1
typedef int (*log_fn)(const char *, unsigned, const char *, int, const void *, const char *,
                      va_list);
typedef void (*push_fn)(log_fn);

static int64_t cma_count;  /* cma failures taken (atomic) */
static int cma_pushed;     /* the handler is installed (set once, under the GIL) */
static int cma_last_busy;  /* spin flag guarding cma_last */
static char cma_last[512]; /* the latest one's text */

static int cma_handler(const char *file, unsigned line, const char *function, int level,
                       const void *comp_conf, const char *fmt, va_list ap) {
    (void)line;
    (void)function;
    (void)comp_conf;
    if (level != UCS_LOG_LEVEL_FATAL || file == NULL || fmt == NULL)
        return UCS_LOG_FUNC_RC_CONTINUE;
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    if (strcmp(base, "cma_ep.c") != 0)
        return UCS_LOG_FUNC_RC_CONTINUE;
    char msg[sizeof(cma_last)];
    va_list cp;
    va_copy(cp, ap);
    vsnprintf(msg, sizeof(msg), fmt, cp);
    va_end(cp);
    __atomic_add_fetch(&cma_count, 1, __ATOMIC_RELAXED);
    if (!__atomic_exchange_n(&cma_last_busy, 1, __ATOMIC_ACQUIRE)) {
        memcpy(cma_last, msg, sizeof(cma_last));
        __atomic_store_n(&cma_last_busy, 0, __ATOMIC_RELEASE);
    }
    fprintf(stderr, "[disagg] UCX cma: %s (the request fails; not fatal)\n", msg);
    return UCS_LOG_FUNC_RC_STOP;
}

/* guard_cma(push) -> bool: install ``cma_handler`` with ucs_log_push_handler (its
 * address, from ctypes); once per process, later calls return True at once. */
static PyObject *guard_cma(PyObject *self, PyObject *args) {
    unsigned long long push;
    if (!PyArg_ParseTuple(args, "K", &push))
        return NULL;
    if (!push) {
        PyErr_SetString(PyExc_ValueError, "guard_cma: null ucs_log_push_handler");
        return NULL;
    }
    if (!cma_pushed) {
        ((push_fn)(uintptr_t)push)(cma_handler);
        cma_pushed = 1;
    }
    Py_RETURN_TRUE;
}

/* cma_failures() -> (count, latest text): the cma failures ``cma_handler`` took. */
static PyObject *cma_failures(PyObject *self, PyObject *args) {
    char msg[sizeof(cma_last)];
    msg[0] = 0;
    while (__atomic_exchange_n(&cma_last_busy, 1, __ATOMIC_ACQUIRE))
        ;
    memcpy(msg, cma_last, sizeof(msg));
    __atomic_store_n(&cma_last_busy, 0, __ATOMIC_RELEASE);
    msg[sizeof(msg) - 1] = 0;
    return Py_BuildValue("Ls", (long long)__atomic_load_n(&cma_count, __ATOMIC_RELAXED), msg);
}

/* cma_log_test(dispatch, file) -> None: send one FATAL message "process_vm_readv(test)
 * returned -1: No such process" from source file ``file`` through ucs_log_dispatch (its
 * address, from ctypes) the way UCX's cma_ep.c does, for the tests: from "cma_ep.c" the
 * handler must take it; from any other file UCS aborts the process. */
typedef void (*dispatch_fn)(const char *, unsigned, const char *, int, void *, const char *,
                            ...);
static PyObject *cma_log_test(PyObject *self, PyObject *args) {
    unsigned long long dispatch, comp;
    const char *file;
    if (!PyArg_ParseTuple(args, "KKs", &dispatch, &comp, &file))
        return NULL;
    if (!dispatch || !comp) {
        PyErr_SetString(PyExc_ValueError, "cma_log_test: null pointer");
        return NULL;
    }
    ((dispatch_fn)(uintptr_t)dispatch)(file, 1, "cma_log_test", UCS_LOG_LEVEL_FATAL,
                                       (void *)(uintptr_t)comp, "%s(test) returned %d: %s",
                                       "process_vm_readv", -1, "No such process");
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"drive", drive, METH_VARARGS, "Progress and reap requests; (remaining, status)."},
    {"pull", pull, METH_VARARGS,
     "Claim and post slices of a shared read list; (posted, bytes, nreqs, start, status)."},
    {"guard_cma", guard_cma, METH_VARARGS, "Make UCX cma failures non-fatal; True."},
    {"cma_failures", cma_failures, METH_NOARGS, "(count, latest text) of cma failures taken."},
    {"cma_log_test", cma_log_test, METH_VARARGS, "Dispatch a FATAL cma-like UCS message."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ucxrma",
                                    "Batched UCX RMA posting (see ucx/native_rma.py).", -1, methods};

PyMODINIT_FUNC PyInit__ucxrma(void) { return PyModule_Create(&module); }
