/* One-pass scattered row copy on the host: dst row dst_idx[i] = src row src_idx[i].
 *
 * Why C: the same-host (ipc) plane's host path copies pages from the producer's store rows
 * into the consumer's slots, both drawn at random. numpy and torch can only do that in two
 * passes (a gather into a buffer, then a scatter), so a 256 MiB transfer ran at 5-6 GB/s
 * on the 2-core box against 12-13 GB/s for one memcpy. Here every row is one memcpy
 * straight from its source row to its slot, on up to `threads` threads, without the GIL.
 *
 * Stores: a copy of NT_MIN_TOTAL bytes or more (rows of 4 KiB or more) writes with
 * non-temporal stores on x86-64 (SSE2, always there): it is far bigger than the caches,
 * so a normal store would first read each destination line only to overwrite it, and
 * would evict everything else on the way. glibc's memcpy does the same above ~3/4 of the
 * shared cache, so the one-memcpy ceiling we are held against already has this
 * advantage. Measured on the 2-core box (256 MiB of random /dev/shm rows into random
 * huge-page slots, /scratch/rc5/b.py, median of 5, ratio to one 256 MiB np.copyto):
 * 1 thread 0.87 -> 1.10 at 64 KiB rows, 1.03 -> 1.32 at 256 KiB; 2 threads 1.20 -> 1.60
 * and 1.30 -> 1.73; 16 KiB rows 0.92 -> 1.15 with 2 threads.
 *
 * copy_runs does the same for pages of several runs each (a TP slice's per-buffer runs):
 * one pass over the pages, each page's runs in turn, instead of one copy_rows per run.
 *
 * Safety: every index is checked against its side's row count before any byte moves
 * (IndexError naming the first bad one); row_bytes must fit in both strides.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_NT 1
#else
#define HAVE_NT 0
#endif

#define MAX_THREADS 8
#define NT_MIN_TOTAL (16LL << 20)
#define NT_MIN_ROW 4096
#define NT_MIN_RUN 256
#define PREFETCH_BYTES 512

#if HAVE_NT
/* memcpy with non-temporal 16-byte stores from the first 16-byte-aligned destination
 * byte; the unaligned head and the tail go through memcpy. */
static void copy_nt(char *d, const char *s, size_t n) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    if (i < n) memcpy(d + i, s + i, n - i);
}
#endif

typedef struct {
    char *dst;
    const char *src;
    Py_ssize_t dst_stride, src_stride, row_bytes;
    const int64_t *si, *di;
    Py_ssize_t lo, hi;
    int nt; /* non-temporal stores */
    const int64_t *runs; /* copy_runs: n_runs x (src offset, dst address, dst stride, len) */
    Py_ssize_t n_runs;
} job_t;

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
#if HAVE_NT
    if (j->nt) {
        for (Py_ssize_t i = j->lo; i < j->hi; i++)
            copy_nt(j->dst + j->di[i] * j->dst_stride, j->src + j->si[i] * j->src_stride,
                    (size_t)j->row_bytes);
        _mm_sfence(); /* the stores are visible before the caller learns the copy is done */
        return NULL;
    }
#endif
    for (Py_ssize_t i = j->lo; i < j->hi; i++)
        memcpy(j->dst + j->di[i] * j->dst_stride, j->src + j->si[i] * j->src_stride,
               (size_t)j->row_bytes);
    return NULL;
}

/* copy_runs' worker: for each of its rows, every run in order (a row's runs are
 * written together, so each page's source and slots are walked once). */
static void *run_runs(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t *r = j->runs;
    for (Py_ssize_t i = j->lo; i < j->hi; i++) {
        const char *s = j->src + j->si[i] * j->src_stride;
        int64_t d = j->di[i];
        for (Py_ssize_t k = 0; k < j->n_runs; k++) {
            const int64_t *q = r + 4 * k;
            /* The next run's first lines, requested now: each run starts a stream of its
             * own, which the hardware prefetcher only follows after a few misses, a good
             * share of a short run (a split's 2 KiB runs of 64 KiB pages: 6.6 -> 7.9 GB/s
             * with 512 bytes, one page copy 8.0; 256: 7.6, 1024 and 2048: 6.7; the 2-core
             * box, median of 15). A prefetch past the source never faults. Not where the
             * next run continues this one in the source row (a merge's runs are one
             * source span): the hardware already streams there and the requests only
             * cost (a merge's 2 KiB runs of 64 KiB pages, the C loop alone, three medians
             * of 11: 8.3-8.6 GB/s with them, 10.1-10.7 without). */
            const char *next = k + 1 < j->n_runs
                                   ? (q[4] == q[0] + q[3] ? NULL : s + q[4])
                               : i + 1 < j->hi ? j->src + j->si[i + 1] * j->src_stride + r[0]
                                               : NULL;
            if (next != NULL)
                for (int at = 0; at < PREFETCH_BYTES; at += 64) __builtin_prefetch(next + at);
            char *to = (char *)(uintptr_t)(q[1] + d * q[2]);
#if HAVE_NT
            if (j->nt) {
                copy_nt(to, s + q[0], (size_t)q[3]);
                continue;
            }
#endif
            memcpy(to, s + q[0], (size_t)q[3]);
        }
    }
#if HAVE_NT
    if (j->nt) _mm_sfence();
#endif
    return NULL;
}

static int get_index(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || view->format == NULL ||
        (strcmp(view->format, "l") && strcmp(view->format, "q") && strcmp(view->format, "<q") &&
         strcmp(view->format, "=q"))) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static Py_ssize_t first_bad(const int64_t *idx, Py_ssize_t n, Py_ssize_t rows) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= rows) return i;
    return -1;
}

/* Whether the index arrays are unusable: 0, or -1 with the exception set naming the
 * first bad index (counts that differ, a row outside its buffer). */
static int bad_rows(const int64_t *si, Py_ssize_t n, Py_ssize_t src_rows, const int64_t *di,
                    Py_ssize_t n_dst, Py_ssize_t dst_rows) {
    Py_ssize_t bad;
    if (n_dst != n) {
        PyErr_Format(PyExc_ValueError, "%zd source rows for %zd destination rows", n, n_dst);
    } else if ((bad = first_bad(si, n, src_rows)) >= 0) {
        PyErr_Format(PyExc_IndexError, "source row %lld (index %zd) outside %zd rows",
                     (long long)si[bad], bad, src_rows);
    } else if ((bad = first_bad(di, n, dst_rows)) >= 0) {
        PyErr_Format(PyExc_IndexError, "destination row %lld (index %zd) outside %zd rows",
                     (long long)di[bad], bad, dst_rows);
    } else {
        return 0;
    }
    return -1;
}

/* Runs work(jobs[t]) for every t, jobs 1.. on threads of their own (a job whose thread
 * did not start runs here). */
static void spread(void *(*work)(void *), job_t *jobs, pthread_t *tids, int *started,
                   int threads) {
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tids[t], NULL, work, &jobs[t]) == 0;
    work(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            work(&jobs[t]);
    }
}

/* Runs work over the index rows [0, n), split evenly across threads (clamped to
 * 1..MAX_THREADS and to n), each a copy of proto with its own row range, the GIL released. */
static void split_rows(void *(*work)(void *), job_t proto, Py_ssize_t n, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = n > 0 ? (int)n : 1;
    job_t jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        jobs[t] = proto;
        jobs[t].lo = n * t / threads;
        jobs[t].hi = n * (t + 1) / threads;
    }
    Py_BEGIN_ALLOW_THREADS
    spread(work, jobs, tids, started, threads);
    Py_END_ALLOW_THREADS
}


/* copy_rows(dst_ptr, dst_rows, dst_stride, src_ptr, src_rows, src_stride, row_bytes,
 *           src_idx, dst_idx, threads) -> None */
static PyObject *copy_rows(PyObject *self, PyObject *args) {
    unsigned long long dst_ptr, src_ptr;
    Py_ssize_t dst_rows, dst_stride, src_rows, src_stride, row_bytes;
    PyObject *si_obj, *di_obj;
    int threads;
    if (!PyArg_ParseTuple(args, "KnnKnnnOOi", &dst_ptr, &dst_rows, &dst_stride, &src_ptr,
                          &src_rows, &src_stride, &row_bytes, &si_obj, &di_obj, &threads))
        return NULL;
    if (row_bytes < 0 || row_bytes > dst_stride || row_bytes > src_stride) {
        PyErr_Format(PyExc_ValueError, "row_bytes %zd must fit both strides (%zd, %zd)",
                     row_bytes, dst_stride, src_stride);
        return NULL;
    }
    Py_buffer sv, dv;
    if (get_index(si_obj, &sv, "src_idx") < 0) return NULL;
    if (get_index(di_obj, &dv, "dst_idx") < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    Py_ssize_t n = sv.len / 8;
    const int64_t *si = (const int64_t *)sv.buf, *di = (const int64_t *)dv.buf;
    PyObject *ret = NULL;
    if (bad_rows(si, n, src_rows, di, dv.len / 8, dst_rows) == 0) {
        int nt = HAVE_NT && row_bytes >= NT_MIN_ROW && (long long)n * row_bytes >= NT_MIN_TOTAL;
        split_rows(run,
                   (job_t){(char *)(uintptr_t)dst_ptr, (const char *)(uintptr_t)src_ptr,
                           dst_stride, src_stride, row_bytes, si, di, 0, 0, nt, NULL, 0},
                   n, threads);
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return ret;
}

/* copy_runs(src_ptr, src_rows, src_stride, runs, dst_rows, src_idx, dst_idx, threads):
 * for each i and each run k (a row of the int64 array runs: source offset, destination
 * address, destination row stride, length, in bytes), copy length bytes from
 * src_ptr + src_idx[i] * src_stride + offset to address + dst_idx[i] * stride. One call
 * moves a page's several runs (a TP slice's per-buffer runs), rows spread over threads. The
 * caller checked that every run lies inside its source row and destination region; the
 * indices are checked here against src_rows and dst_rows before a byte moves. */
static PyObject *copy_runs(PyObject *self, PyObject *args) {
    unsigned long long src_ptr;
    Py_ssize_t src_rows, src_stride, dst_rows;
    PyObject *runs_obj, *si_obj, *di_obj;
    int threads;
    if (!PyArg_ParseTuple(args, "KnnOnOOi", &src_ptr, &src_rows, &src_stride, &runs_obj,
                          &dst_rows, &si_obj, &di_obj, &threads))
        return NULL;
    Py_buffer rv, sv, dv;
    if (get_index(runs_obj, &rv, "runs") < 0) return NULL;
    if (rv.len % 32) {
        PyErr_SetString(PyExc_ValueError, "runs must be rows of 4 int64");
        PyBuffer_Release(&rv);
        return NULL;
    }
    if (get_index(si_obj, &sv, "src_idx") < 0) {
        PyBuffer_Release(&rv);
        return NULL;
    }
    if (get_index(di_obj, &dv, "dst_idx") < 0) {
        PyBuffer_Release(&rv);
        PyBuffer_Release(&sv);
        return NULL;
    }
    Py_ssize_t n = sv.len / 8, n_runs = rv.len / 32;
    const int64_t *si = (const int64_t *)sv.buf, *di = (const int64_t *)dv.buf;
    const int64_t *runs = (const int64_t *)rv.buf;
    PyObject *ret = NULL;
    long long row_bytes = 0, shortest = -1;
    for (Py_ssize_t k = 0; k < n_runs; k++) {
        row_bytes += runs[4 * k + 3];
        if (shortest < 0 || runs[4 * k + 3] < shortest) shortest = runs[4 * k + 3];
    }
    if (bad_rows(si, n, src_rows, di, dv.len / 8, dst_rows) == 0) {
        /* non-temporal stores as copy_rows decides for a row, each run long enough that
         * its unaligned head and tail stay a small share */
        int nt = HAVE_NT && row_bytes >= NT_MIN_ROW && shortest >= NT_MIN_RUN &&
                 (long long)n * row_bytes >= NT_MIN_TOTAL;
        split_rows(run_runs,
                   (job_t){NULL, (const char *)(uintptr_t)src_ptr, 0, src_stride, 0, si, di, 0,
                           0, nt, runs, n_runs},
                   n, threads);
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyBuffer_Release(&rv);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    return ret;
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst_ptr, dst_rows, dst_stride, src_ptr, src_rows, src_stride, row_bytes, "
     "src_idx, dst_idx, threads): dst row dst_idx[i] = src row src_idx[i], indices checked "
     "first."},
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(src_ptr, src_rows, src_stride, runs, dst_rows, src_idx, dst_idx, threads): "
     "for each row i and run (src offset, dst address, dst stride, len), copy the run of "
     "source row src_idx[i] to destination row dst_idx[i]; indices checked first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowcopy(void) { return PyModule_Create(&module); }
