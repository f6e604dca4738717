/* Scatter/gather socket I/O for the tcp plane's payload stream (tcp/rowio.py).
 *
 * Why C: a push moves thousands of pages that lie in random store rows and land in random
 * page slots. Here the kernel copies each byte exactly once per side, straight from the
 * source rows (sendmsg with one iovec per page piece) and straight into the destination
 * slots (recvmsg likewise), with the GIL released for the whole payload. Building the
 * iovecs in Python costs about a microsecond per page, and a Python loop over partial
 * writes holds the GIL that the other side of the plane needs.
 *
 * Both calls take a 2-D uint8 buffer (a numpy view: rows contiguous, any row stride), the
 * row indices (int64) and the column spans ((offset, length) int64 pairs, concatenated
 * per row in that order), and move the pieces row by row, span by span. Adjacent pieces
 * are coalesced into one iovec; at most IOV_MAX iovecs go into one syscall.
 *
 * Safety: every row index and span is checked before any byte moves (IndexError naming
 * the first bad index). The socket may be blocking or not (a Python socket with a
 * timeout is non-blocking underneath): see run() for how the calls block until
 * `deadline` (CLOCK_MONOTONIC seconds, the clock of Python's time.monotonic(); <= 0: no
 * deadline). EINTR is retried; EOF mid-payload raises ConnectionError, the deadline
 * TimeoutError, other errors OSError (errno set), each naming how many of the payload's
 * bytes had moved. The caller's thread must be the only one doing I/O on the socket
 * while a call runs (another may shut it down: the call then ends at once).
 *
 * The pipe path (same-host streams, MODE_PIPE in tcp/wire.py): splice_rows vmsplices the
 * pieces into a pipe (pages referenced, not copied), recv_rows with a `watch` socket
 * readv()s them out of a non-blocking pipe, pipe_drain waits until the pipe is empty (the
 * sender's rows are free only then). All three also end at once when the watched stream
 * socket is shut down or hangs up (ConnectionError), so abort and close work as they do
 * on the stream; see run_pipe().
 */
#define _GNU_SOURCE /* vmsplice */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif
#define MAX_IOV (IOV_MAX < 1024 ? IOV_MAX : 1024)

typedef struct {
    char *base;
    Py_ssize_t stride;
    const int64_t *rows;
    Py_ssize_t nrows;
    const int64_t *cols; /* 2 * ncols */
    Py_ssize_t ncols;
    Py_ssize_t row, col; /* next piece */
} pieces_t;

/* Fill iov[0..] with the next pieces (coalesced), starting at `start`; returns the count. */
static int fill(pieces_t *p, struct iovec *iov, int start) {
    int n = start;
    while (p->row < p->nrows) {
        char *ptr = p->base + p->rows[p->row] * p->stride + p->cols[2 * p->col];
        size_t len = (size_t)p->cols[2 * p->col + 1];
        if (n > 0 && (char *)iov[n - 1].iov_base + iov[n - 1].iov_len == ptr) {
            iov[n - 1].iov_len += len;
        } else {
            if (n == MAX_IOV) break;
            iov[n].iov_base = ptr;
            iov[n].iov_len = len;
            n++;
        }
        if (++p->col == p->ncols) {
            p->col = 0;
            p->row++;
        }
    }
    return n;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

enum { OK = 0, E_ERRNO, E_EOF, E_TIMEOUT, E_CUT };

/* SO_SNDTIMEO / SO_RCVTIMEO to what is left until `deadline` (0: wait forever). Returns
 * -1 with errno set, -2 when the deadline has passed, else 0. */
static int set_timeout(int fd, int opt, double deadline) {
    struct timeval tv = {0, 0};
    if (deadline > 0) {
        double left = deadline - now_s();
        if (left <= 0) return -2;
        tv.tv_sec = (time_t)left;
        tv.tv_usec = (suseconds_t)((left - (double)tv.tv_sec) * 1e6);
        if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1;
    }
    return setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof(tv));
}

/* Drop the `got` bytes a call moved from the front of iov[first:n] (whole iovecs, then
 * part of the next); returns the new `first`. */
static int consume(struct iovec *iov, int first, int n, size_t got) {
    while (first < n && got >= iov[first].iov_len) got -= iov[first++].iov_len;
    if (got) {
        iov[first].iov_base = (char *)iov[first].iov_base + got;
        iov[first].iov_len -= got;
    }
    return first;
}

/* Move everything the pieces (after `head`, when sending) describe. Runs without the GIL.
 * Returns OK or an error kind; *moved counts the bytes moved, *err the errno.
 *
 * The calls block in the kernel (the fd's O_NONBLOCK is cleared for the duration, and
 * SO_SNDTIMEO / SO_RCVTIMEO carry the deadline): a blocking sendmsg sends its whole
 * iovec and a recvmsg with MSG_WAITALL fills its whole iovec in one call, where a
 * non-blocking loop would return to user space (EAGAIN, poll, another call) each time
 * the socket buffer (~200 KiB for AF_UNIX) fills or drains: a third of the time on the
 * 2-core box. Flags and timeouts are restored before returning. */
static int run(int fd, int sending, const char *head, Py_ssize_t head_len, pieces_t *p,
               double deadline, Py_ssize_t *moved, int *err) {
    struct iovec iov[MAX_IOV];
    int n = 0, first = 0, rc = OK;
    if (head_len > 0) {
        iov[0].iov_base = (void *)head;
        iov[0].iov_len = (size_t)head_len;
        n = 1;
    }
    n = fill(p, iov, n); /* the head goes out with the first pieces: one syscall */
    if (n == 0) return OK;
    int opt = sending ? SO_SNDTIMEO : SO_RCVTIMEO;
    int flags = sending ? MSG_NOSIGNAL : MSG_WAITALL;
    struct timeval saved;
    socklen_t saved_len = sizeof(saved);
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || getsockopt(fd, SOL_SOCKET, opt, &saved, &saved_len) < 0) {
        *err = errno;
        return E_ERRNO;
    }
    if ((fl & O_NONBLOCK) && fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0) {
        *err = errno;
        return E_ERRNO;
    }
    int t = set_timeout(fd, opt, deadline);
    if (t == -2) rc = E_TIMEOUT;
    if (t == -1) {
        *err = errno;
        rc = E_ERRNO;
    }
    while (rc == OK) {
        if (first == n) { /* this batch is done: the next one */
            first = 0;
            n = fill(p, iov, 0);
            if (n == 0) break;
        } else if (first > 0 && p->row < p->nrows && n - first < MAX_IOV / 2) {
            /* top the batch up so each syscall keeps many pieces */
            memmove(iov, iov + first, (size_t)(n - first) * sizeof(struct iovec));
            n -= first;
            first = 0;
            n = fill(p, iov, n);
        }
        struct msghdr msg;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = iov + first;
        msg.msg_iovlen = (size_t)(n - first);
        size_t want = 0;
        for (int i = first; i < n; i++) want += iov[i].iov_len;
        ssize_t got = sending ? sendmsg(fd, &msg, flags) : recvmsg(fd, &msg, flags);
        if (got < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                *err = errno;
                rc = E_ERRNO;
                break;
            }
            got = 0; /* the timeout: see below whether the deadline passed */
        } else if (got == 0 && !sending) {
            rc = E_EOF;
            break;
        }
        *moved += got;
        first = consume(iov, first, n, (size_t)got);
        if ((size_t)got < want) { /* cut short (timeout, signal, EOF next): re-arm */
            t = set_timeout(fd, opt, deadline);
            if (t == -2) rc = E_TIMEOUT;
            if (t == -1) {
                *err = errno;
                rc = E_ERRNO;
            }
        }
    }
    int keep = errno;
    setsockopt(fd, SOL_SOCKET, opt, &saved, sizeof(saved));
    if (fl & O_NONBLOCK) fcntl(fd, F_SETFL, fl);
    errno = keep;
    return rc;
}

/* What is left until `deadline` in poll() milliseconds (-1: none), or -2 once passed. */
static int left_ms(double deadline) {
    if (deadline <= 0) return -1;
    double left = deadline - now_s();
    if (left <= 0) return -2;
    double ms = ceil(left * 1000.0);
    return ms > 1e9 ? 1000000000 : (int)ms;
}

/* Wait until `fd` has `events` or `watch` (the stream socket) was shut down or hung up
 * (POLLRDHUP: a receiver's abort, a plane's close, the peer gone). OK, E_CUT, E_TIMEOUT
 * or E_ERRNO. */
static int wait_pipe(int fd, short events, int watch, double deadline, int *err) {
    for (;;) {
        int ms = left_ms(deadline);
        if (ms == -2) return E_TIMEOUT;
        struct pollfd pf[2] = {{fd, events, 0}, {watch, POLLRDHUP, 0}};
        int r = poll(pf, watch >= 0 ? 2 : 1, ms);
        if (r < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return E_ERRNO;
        }
        /* Receiving, bytes already in the pipe are read before a cut is reported: a
         * sender that wrote its last bytes and then died closes the socket first, and
         * the error must say how much arrived. A cut while bytes keep flowing is still
         * seen within WATCH_EVERY calls (run_pipe). */
        if (events == POLLIN && (pf[0].revents & POLLIN)) return OK;
        if (watch >= 0 && pf[1].revents) return E_CUT;
        if (pf[0].revents) return OK; /* POLLERR / POLLHUP too: the next call says which */
    }
}

/* The pipe payload path (same-host streams; see tcp/rowio.py): sending, vmsplice the
 * pieces into the pipe `fd` (the pages are referenced, not copied: the receiver's readv
 * is the only copy, so the caller must keep the rows unchanged until the pipe has been
 * drained, see pipe_drain); receiving, readv them out of the pipe into the pieces.
 * Non-blocking calls, poll()ing the pipe and `watch` whenever the pipe is full (empty):
 * a full pipe holds 1 MiB, so a call moves up to that much; the watch ends the call as
 * soon as the stream socket is shut down. Runs without the GIL. */
#define WATCH_EVERY 8 /* calls between looks at the watch while the pipe never ran dry */
static int run_pipe(int fd, int watch, int sending, pieces_t *p, double deadline,
                    Py_ssize_t *moved, int *err) {
    struct iovec iov[MAX_IOV];
    int n = fill(p, iov, 0), first = 0, rc = OK, calls = 0;
    int pipe_size = fcntl(fd, F_GETPIPE_SZ);
    size_t cap = pipe_size > 0 ? (size_t)pipe_size : (size_t)1 << 20;
    while (rc == OK && first < n) {
        if (watch >= 0 && ++calls % WATCH_EVERY == 0) { /* a cut while bytes still flow */
            struct pollfd pf = {watch, POLLRDHUP, 0};
            if (poll(&pf, 1, 0) > 0) {
                rc = E_CUT;
                break;
            }
        }
        /* no more iovecs than one pipe-full: the kernel imports every iovec passed */
        int k = 0;
        for (size_t b = 0; first + k < n && (k == 0 || b < cap); k++) b += iov[first + k].iov_len;
        ssize_t got = sending ? vmsplice(fd, iov + first, (unsigned long)k, SPLICE_F_NONBLOCK)
                              : readv(fd, iov + first, k);
        if (got < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                *err = errno;
                rc = E_ERRNO;
                break;
            }
            rc = wait_pipe(fd, sending ? POLLOUT : POLLIN, watch, deadline, err);
            continue;
        }
        if (got == 0 && !sending) { /* every write end closed: the sender is gone */
            rc = E_EOF;
            break;
        }
        *moved += got;
        first = consume(iov, first, n, (size_t)got);
        if (first == n) {
            first = 0;
            n = fill(p, iov, 0);
        } else if (p->row < p->nrows && n - first < MAX_IOV / 2) {
            memmove(iov, iov + first, (size_t)(n - first) * sizeof(struct iovec));
            n -= first;
            first = 0;
            n = fill(p, iov, n);
        }
    }
    return rc;
}

/* SIGPIPE blocked in this thread while writing to a pipe whose reader may be gone (EPIPE
 * then, and no process-killing signal where the embedding program left it at default);
 * a SIGPIPE raised meanwhile is taken back before unblocking. */
typedef struct {
    sigset_t old;
    int was_pending;
} sigpipe_guard;

static void sigpipe_block(sigpipe_guard *g) {
    sigset_t set, pending;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    sigpending(&pending);
    g->was_pending = sigismember(&pending, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &set, &g->old);
}

static void sigpipe_restore(sigpipe_guard *g, int got_epipe) {
    if (got_epipe && !g->was_pending) {
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGPIPE);
        struct timespec zero = {0, 0};
        while (sigtimedwait(&set, NULL, &zero) < 0 && errno == EINTR) {
        }
    }
    pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

static int get_int64(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || view->format == NULL ||
        (strcmp(view->format, "l") && strcmp(view->format, "q") && strcmp(view->format, "<q") &&
         strcmp(view->format, "=q") && strcmp(view->format, "<l") &&
         strcmp(view->format, "=l"))) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The shared part of send_rows / recv_rows: parse, check, move, raise. */
enum { SEND, RECV, SPLICE };

static PyObject *move(PyObject *args, int kind) {
    int fd, watch = -1, sending = kind != RECV;
    PyObject *head_obj = Py_None, *arr_obj, *rows_obj, *cols_obj;
    double deadline;
    if (kind == SEND) {
        if (!PyArg_ParseTuple(args, "iOOOOd", &fd, &head_obj, &arr_obj, &rows_obj, &cols_obj,
                              &deadline))
            return NULL;
    } else if (kind == SPLICE) {
        if (!PyArg_ParseTuple(args, "iiOOOd", &fd, &watch, &arr_obj, &rows_obj, &cols_obj,
                              &deadline))
            return NULL;
    } else if (!PyArg_ParseTuple(args, "iOOOd|i", &fd, &arr_obj, &rows_obj, &cols_obj, &deadline,
                                 &watch)) {
        return NULL;
    }
    Py_buffer head = {0}, arr = {0}, rv = {0}, cv = {0};
    int have_head = 0, have_arr = 0, have_rv = 0, have_cv = 0;
    PyObject *ret = NULL;
    if (head_obj != Py_None) {
        if (PyObject_GetBuffer(head_obj, &head, PyBUF_SIMPLE) < 0) goto done;
        have_head = 1;
    }
    if (PyObject_GetBuffer(arr_obj, &arr,
                           PyBUF_STRIDES | PyBUF_FORMAT | (sending ? 0 : PyBUF_WRITABLE)) < 0)
        goto done;
    have_arr = 1;
    if (arr.ndim != 2 || arr.itemsize != 1) {
        PyErr_Format(PyExc_ValueError, "rows must be a 2-D byte array, got %d-D of %zd-byte items",
                     arr.ndim, arr.itemsize);
        goto done;
    }
    Py_ssize_t nrows = arr.shape[0], width = arr.shape[1];
    Py_ssize_t stride = arr.strides[0];
    if (width > 1 && arr.strides[1] != 1) {
        PyErr_SetString(PyExc_ValueError, "rows must be contiguous (stride 1 within a row)");
        goto done;
    }
    if (nrows > 1 && stride < width) {
        PyErr_Format(PyExc_ValueError, "row stride %zd is below the row width %zd", stride, width);
        goto done;
    }
    if (get_int64(rows_obj, &rv, "rows") < 0) goto done;
    have_rv = 1;
    if (get_int64(cols_obj, &cv, "cols") < 0) goto done;
    have_cv = 1;
    Py_ssize_t n = rv.len / 8, ncols = cv.len / 16;
    const int64_t *rows = (const int64_t *)rv.buf, *cols = (const int64_t *)cv.buf;
    if (cv.len % 16 || ncols == 0) {
        PyErr_SetString(PyExc_ValueError, "cols must be one or more (offset, length) pairs");
        goto done;
    }
    Py_ssize_t per_row = 0;
    for (Py_ssize_t j = 0; j < ncols; j++) {
        int64_t o = cols[2 * j], c = cols[2 * j + 1];
        if (o < 0 || c < 1 || o > width || c > width - o) {
            PyErr_Format(PyExc_IndexError,
                         "column span %zd (offset %lld, length %lld) outside rows of %zd bytes",
                         j, (long long)o, (long long)c, width);
            goto done;
        }
        per_row += (Py_ssize_t)c;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= nrows) {
            PyErr_Format(PyExc_IndexError, "row %lld (index %zd) outside %zd rows",
                         (long long)rows[i], i, nrows);
            goto done;
        }
    }
    Py_ssize_t total = n * per_row + (have_head ? head.len : 0);
    pieces_t p = {(char *)arr.buf, stride, rows, n, cols, ncols, 0, 0};
    Py_ssize_t moved = 0;
    int err = 0, rc;
    Py_BEGIN_ALLOW_THREADS
    if (kind == SEND || (kind == RECV && watch < 0)) {
        rc = run(fd, sending, have_head ? (const char *)head.buf : NULL,
                 have_head ? head.len : 0, &p, deadline, &moved, &err);
    } else if (kind == SPLICE) {
        sigpipe_guard g;
        sigpipe_block(&g);
        rc = run_pipe(fd, watch, 1, &p, deadline, &moved, &err);
        sigpipe_restore(&g, rc == E_ERRNO && err == EPIPE);
    } else {
        rc = run_pipe(fd, watch, 0, &p, deadline, &moved, &err);
    }
    Py_END_ALLOW_THREADS
    const char *what = sending ? "sent" : "received";
    if (rc == OK) {
        ret = PyLong_FromSsize_t(moved);
    } else if (rc == E_EOF) {
        PyErr_Format(PyExc_ConnectionError,
                     "peer closed the connection with %zd of %zd payload bytes received", moved,
                     total);
    } else if (rc == E_CUT) {
        PyErr_Format(PyExc_ConnectionError,
                     "the stream was shut down with %zd of %zd payload bytes %s", moved, total,
                     what);
    } else if (rc == E_TIMEOUT) {
        PyErr_Format(PyExc_TimeoutError, "deadline passed with %zd of %zd payload bytes %s",
                     moved, total, what);
    } else {
        PyObject *msg = PyUnicode_FromFormat("%s with %zd of %zd payload bytes %s",
                                             strerror(err), moved, total, what);
        if (msg != NULL) {
            PyObject *exc = PyObject_CallFunction(PyExc_OSError, "iO", err, msg);
            if (exc != NULL) {
                PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
                Py_DECREF(exc);
            }
            Py_DECREF(msg);
        }
    }
done:
    if (have_cv) PyBuffer_Release(&cv);
    if (have_rv) PyBuffer_Release(&rv);
    if (have_arr) PyBuffer_Release(&arr);
    if (have_head) PyBuffer_Release(&head);
    return ret;
}

static PyObject *send_rows(PyObject *self, PyObject *args) { return move(args, SEND); }
static PyObject *recv_rows(PyObject *self, PyObject *args) { return move(args, RECV); }
static PyObject *splice_rows(PyObject *self, PyObject *args) { return move(args, SPLICE); }

/* Wait until the pipe `fd` (either end) holds no byte: the receiver has copied every
 * vmspliced page out, so the sender's rows are free again. The pipe offers no wake-up
 * for "empty", so FIONREAD is checked every PIPE_DRAIN_NS (the last pipe-full, at most
 * 1 MiB, drains in about 0.2 ms); `watch` (the stream socket) shut down or hung up ends
 * the wait at once (ConnectionError), like the deadline (TimeoutError). */
#define PIPE_DRAIN_NS 20000
static PyObject *pipe_drain(PyObject *self, PyObject *args) {
    int fd, watch, rc = OK, err = 0, left = 0;
    double deadline;
    if (!PyArg_ParseTuple(args, "iid", &fd, &watch, &deadline)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        if (ioctl(fd, FIONREAD, &left) < 0) {
            err = errno;
            rc = E_ERRNO;
            break;
        }
        if (left == 0) break;
        if (deadline > 0 && now_s() >= deadline) {
            rc = E_TIMEOUT;
            break;
        }
        struct pollfd pf = {watch, POLLRDHUP, 0};
        struct timespec ts = {0, PIPE_DRAIN_NS};
        int r = ppoll(&pf, 1, &ts, NULL);
        if (r < 0 && errno != EINTR) {
            err = errno;
            rc = E_ERRNO;
            break;
        }
        if (r > 0) {
            rc = E_CUT;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (rc == OK) Py_RETURN_NONE;
    if (rc == E_CUT)
        PyErr_Format(PyExc_ConnectionError,
                     "the stream was shut down with %d payload bytes still unread in its pipe",
                     left);
    else if (rc == E_TIMEOUT)
        PyErr_Format(PyExc_TimeoutError,
                     "deadline passed with %d payload bytes still unread in the pipe", left);
    else {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    }
    return NULL;
}

static PyMethodDef methods[] = {
    {"send_rows", send_rows, METH_VARARGS,
     "send_rows(fd, head, arr, rows, cols, deadline) -> bytes sent: head (bytes or None), "
     "then columns cols of rows rows of arr, in order."},
    {"recv_rows", recv_rows, METH_VARARGS,
     "recv_rows(fd, arr, rows, cols, deadline, watch=-1) -> bytes received: into columns "
     "cols of rows rows of arr, in order. watch >= 0: fd is a non-blocking pipe, read until "
     "the socket watch is shut down or hangs up (ConnectionError)."},
    {"splice_rows", splice_rows, METH_VARARGS,
     "splice_rows(pipe_fd, watch, arr, rows, cols, deadline) -> bytes spliced: vmsplice "
     "columns cols of rows rows of arr into the pipe (referenced, not copied: keep them "
     "unchanged until pipe_drain returns); ends when the socket watch is shut down."},
    {"pipe_drain", pipe_drain, METH_VARARGS,
     "pipe_drain(pipe_fd, watch, deadline): wait until the pipe holds no byte."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_streamio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__streamio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "IOV_MAX", MAX_IOV) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
