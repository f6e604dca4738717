/* UCX tcp put spike: the producer writes scattered store rows with ucp_put_nbx (one
 * put per row, straight from the row: tcp put_zcopy, no user-space gather) into a
 * registered *landing scratch* of the consumer (NSEG segments of SEG bytes), signals
 * each segment's completion, and the consumer scatters the segment into its pool slots
 * (one memcpy per row) and returns the scratch segment as a credit. Compared in the
 * same process pair with a raw TCP stream of the same byte count (the bench's ceiling:
 * 1 MiB send() calls from one contiguous buffer, recv() into one contiguous buffer).
 *
 * Usage: putspike PAGE N REPS MODE ERRMODE WAIT NSEG SEG
 *   PAGE bytes per page, N pages per transfer (store and pool have 2N rows),
 *   MODE  flush | fenceflag | tagonly | raw
 *         flush:     per segment ucp_ep_flush_nbx; on its completion a tag "seg done"
 *         fenceflag: per segment ucp_worker_fence + an 8-byte put of the segment's
 *                    sequence number into the consumer's registered flag word of that
 *                    scratch slot (RMA ordering after fence); consumer polls flags
 *         tagonly:   a tag "seg done" right after the puts, no flush/fence (NOT
 *                    guaranteed by UCX; counted: a segment whose bytes were not there)
 *         raw:       plain TCP stream, same bytes (ceiling)
 *   ERRMODE peer | none (endpoint error handling), WAIT spin | block (progress mode).
 * Fork: parent = consumer (listener), child = producer. Every byte of every transfer
 * is checked against the expected row content after each repeat (outside the timing).
 * Prints one line per process: GB/s per repeat, CPU seconds (utime+stime) per side.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#define DIE(...) do { fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(2); } while (0)
#define CHK(s, what) do { ucs_status_t _s = (s); if (_s != UCS_OK) DIE("%s: %s", what, ucs_status_string(_s)); } while (0)

enum { T_RKEY = 1, T_GO = 2, T_DONE = 3, T_CREDIT = 4, T_END = 5 };
#define TAG(kind) ((uint64_t)(kind) << 56)
#define TMASK (0xffull << 56)

static size_t PAGE, N, REPS, NSEG, SEG, PPS; /* PPS: pages per segment */
static int MODE, ERRPEER, SPIN;
enum { M_FLUSH, M_FENCEFLAG, M_TAGONLY, M_RAW };
static int PORT;
static int port_pipe[2]; /* the consumer's listener port, to the producer */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
/* this process's CPU time (all threads, user + system) */
static double cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static void *huge_alloc(size_t n) {
    size_t al = 2u << 20, len = (n + al - 1) / al * al;
    void *p = mmap(NULL, len + al, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) DIE("mmap");
    char *a = (char *)(((uintptr_t)p + al - 1) & ~(al - 1));
    madvise(a, len, MADV_HUGEPAGE);
    memset(a, 0, len);
    return a;
}
/* the same permutations on both sides: splitmix64 + Fisher-Yates */
static uint64_t rs;
static uint64_t rnd(void) {
    uint64_t z = (rs += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static void draw(int64_t *src, int64_t *dst, int64_t *tmp) {
    size_t rows = 2 * N;
    for (int k = 0; k < 2; k++) {
        for (size_t i = 0; i < rows; i++) tmp[i] = i;
        for (size_t i = rows - 1; i > 0; i--) {
            size_t j = rnd() % (i + 1);
            int64_t t = tmp[i]; tmp[i] = tmp[j]; tmp[j] = t;
        }
        memcpy(k ? dst : src, tmp, N * sizeof(int64_t));
    }
}
static inline uint64_t word(uint64_t row, uint64_t w) { return (row << 32) ^ (w * 0x9e3779b1ull) ^ 0x5a5a; }

/* ---------------- UCX plumbing ---------------- */
static ucp_context_h ctx;
static ucp_worker_h wk;
static int efd = -1;
static ucp_ep_h ep;
static volatile int ep_failed;
static ucp_conn_request_h conn_req;

static void init_ucx(int rma) {
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                      .features = UCP_FEATURE_TAG | (rma ? UCP_FEATURE_RMA : 0) | (SPIN ? 0 : UCP_FEATURE_WAKEUP)};
    ucp_config_t *cfg;
    CHK(ucp_config_read(NULL, NULL, &cfg), "config");
    CHK(ucp_init(&p, cfg, &ctx), "init");
    ucp_config_release(cfg);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    CHK(ucp_worker_create(ctx, &wp, &wk), "worker");
    if (!SPIN) CHK(ucp_worker_get_efd(wk, &efd), "efd");
}
/* one progress step: spin, or sleep on the event fd when nothing happened */
static void step(void) {
    if (ucp_worker_progress(wk)) return;
    if (SPIN) return;
    ucs_status_t s = ucp_worker_arm(wk);
    if (s == UCS_ERR_BUSY) return;
    CHK(s, "arm");
    struct pollfd pf = {.fd = efd, .events = POLLIN};
    poll(&pf, 1, 100);
}
static void err_cb(void *arg, ucp_ep_h e, ucs_status_t st) {
    (void)arg; (void)e;
    fprintf(stderr, "[%d] ep error: %s\n", getpid(), ucs_status_string(st));
    ep_failed = 1;
}
static void fill_ep_params(ucp_ep_params_t *e) {
    e->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    e->err_mode = ERRPEER ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    e->err_handler.cb = err_cb;
    e->err_handler.arg = NULL;
}
static void wait_req(void *r, const char *what) {
    if (r == NULL) return;
    if (UCS_PTR_IS_ERR(r)) DIE("%s: %s", what, ucs_status_string(UCS_PTR_STATUS(r)));
    double t0 = now();
    while (ucp_request_check_status(r) == UCS_INPROGRESS) {
        step();
        if (now() - t0 > 30) DIE("[%d] %s: no completion after 30 s", getpid(), what);
    }
    ucs_status_t s = ucp_request_check_status(r);
    ucp_request_free(r);
    CHK(s, what);
}
static void *tsend(uint64_t tag, void *buf, size_t len) {
    ucp_request_param_t p = {.op_attr_mask = 0};
    return ucp_tag_send_nbx(ep, buf, len, tag, &p);
}
static void *trecv(uint64_t tag, uint64_t mask, void *buf, size_t len) {
    ucp_request_param_t p = {.op_attr_mask = 0};
    return ucp_tag_recv_nbx(wk, buf, len, tag, mask, &p);
}
/* a small tag message, waiting for it */
static void tsend_wait(uint64_t tag, void *buf, size_t len) { wait_req(tsend(tag, buf, len), "tag send"); }
static void trecv_wait(uint64_t tag, uint64_t mask, void *buf, size_t len) { wait_req(trecv(tag, mask, buf, len), "tag recv"); }

/* ---------------- raw TCP ---------------- */
static int raw_consumer(int lfd, char *buf, size_t nbytes, double *gbps, double *cpu) {
    int c = accept(lfd, NULL, NULL);
    if (c < 0) DIE("accept");
    for (size_t r = 0; r <= REPS; r++) {
        double t = now(), c0 = cpu_s();
        if (send(c, "g", 1, 0) != 1) DIE("send go");
        size_t got = 0;
        while (got < nbytes) {
            ssize_t k = recv(c, buf + got, nbytes - got, 0);
            if (k <= 0) DIE("recv");
            got += k;
        }
        if (r) { gbps[r - 1] = nbytes / (now() - t) / 1e9; *cpu += cpu_s() - c0; }
    }
    send(c, "q", 1, 0);
    close(c);
    return 0;
}
static void raw_producer(char *buf, size_t nbytes, double *cpu) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(PORT)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    while (connect(s, (void *)&a, sizeof a) < 0) usleep(1000);
    char g;
    /* RAW_CHUNK: bytes per send() (default 1 MiB, the bench's ceiling) */
    size_t chunk = getenv("RAW_CHUNK") ? strtoull(getenv("RAW_CHUNK"), 0, 0) : (1u << 20);
    /* RAW_CORK=1: TCP_CORK on (full frames only), off after each transfer */
    int cork = getenv("RAW_CORK") && atoi(getenv("RAW_CORK"));
    /* RAW_NODELAY=1: TCP_NODELAY on, as UCX sets it */
    if (getenv("RAW_NODELAY") && atoi(getenv("RAW_NODELAY"))) { int one = 1; setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); }
    for (size_t r = 0; r <= REPS; r++) {
        if (recv(s, &g, 1, 0) != 1) DIE("recv go");
        double c0 = cpu_s();
        if (cork) { int one = 1; setsockopt(s, IPPROTO_TCP, TCP_CORK, &one, sizeof one); }
        for (size_t off = 0; off < nbytes; off += chunk) {
            size_t len = nbytes - off < chunk ? nbytes - off : chunk, sent = 0;
            while (sent < len) {
                ssize_t k = send(s, buf + off + sent, len - sent, 0);
                if (k <= 0) DIE("send");
                sent += k;
            }
        }
        if (cork) { int zero = 0; setsockopt(s, IPPROTO_TCP, TCP_CORK, &zero, sizeof zero); }
        if (r) *cpu += cpu_s() - c0;
    }
    recv(s, &g, 1, 0);
    close(s);
}

/* ---------------- put path ---------------- */
struct rkey_msg { uint64_t scratch, flags, pool; uint32_t len; char rkey[4096]; };

/* PUT_CORK=1: TCP_CORK on the producer's connected TCP sockets (UCX's), so puts of one
 * segment leave as full frames; "pushed" (cork off and on again) after each segment's
 * puts and flush, and while draining. UCX has no such setting: this finds the sockets. */
static int cork_fds[16], ncork;
static void cork_find(void) {
    for (int fd = 3; fd < 1024 && ncork < 16; fd++) {
        int type = 0, proto = 0; socklen_t l = sizeof type;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &l) || type != SOCK_STREAM) continue;
        l = sizeof proto;
        if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &proto, &l) || proto != IPPROTO_TCP) continue;
        struct sockaddr_storage a; l = sizeof a;
        if (getpeername(fd, (void *)&a, &l)) continue;
        int one = 1;
        if (setsockopt(fd, IPPROTO_TCP, TCP_CORK, &one, sizeof one) == 0) cork_fds[ncork++] = fd;
    }
    fprintf(stderr, "[%d] corked %d tcp sockets\n", getpid(), ncork);
}
static void cork_push(void) {
    int zero = 0, one = 1;
    for (int i = 0; i < ncork; i++) {
        setsockopt(cork_fds[i], IPPROTO_TCP, TCP_CORK, &zero, sizeof zero);
        setsockopt(cork_fds[i], IPPROTO_TCP, TCP_CORK, &one, sizeof one);
    }
}

static void conn_cb(ucp_conn_request_h r, void *arg) { (void)arg; conn_req = r; }

static int escape2(void) { return getenv("ESCAPE") && atoi(getenv("ESCAPE")) == 2; }
static void put_consumer(double *gbps, double *cpu, long *bad_tagonly) {
    init_ucx(!escape2());
    /* landing scratch + one 64-byte flag line per scratch slot, registered for remote writes */
    size_t sbytes = NSEG * SEG + NSEG * 64;
    char *scratch = huge_alloc(sbytes);
    volatile uint64_t *flags = (volatile uint64_t *)(scratch + NSEG * SEG);
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                             UCP_MEM_MAP_PARAM_FIELD_PROT,
                               .address = scratch, .length = sbytes,
                               .prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE |
                                       UCP_MEM_MAP_PROT_REMOTE_WRITE};
    ucp_mem_h mh;
    void *rk = NULL; size_t rklen = 0;
    if (!escape2()) {
        CHK(ucp_mem_map(ctx, &mp, &mh), "mem_map");
        CHK(ucp_rkey_pack(ctx, mh, &rk, &rklen), "rkey_pack");
    }
    char *pool = huge_alloc(2 * N * PAGE);
    int64_t *src = malloc(N * 8), *dst = malloc(N * 8), *tmp = malloc(2 * N * 8);

    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(PORT)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ucp_listener_params_t lp = {.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
                                .sockaddr = {.addr = (void *)&a, .addrlen = sizeof a},
                                .conn_handler = {.cb = conn_cb}};
    ucp_listener_h l;
    CHK(ucp_listener_create(wk, &lp, &l), "listener");
    ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    CHK(ucp_listener_query(l, &la), "listener_query");
    int port = ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
    if (write(port_pipe[1], &port, sizeof port) != sizeof port) DIE("port pipe");
    while (!conn_req) step();
    ucp_ep_params_t e = {.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST, .conn_request = conn_req};
    fill_ep_params(&e);
    CHK(ucp_ep_create(wk, &e, &ep), "ep_create(server)");
    struct rkey_msg m = {.scratch = (uintptr_t)scratch, .flags = (uintptr_t)flags, .pool = (uintptr_t)pool, .len = rklen};
    if (rklen > sizeof m.rkey) DIE("rkey too long");
    memcpy(m.rkey, rk, rklen);
    tsend_wait(TAG(T_RKEY), &m, sizeof m);
    if (getenv("ESCAPE") && atoi(getenv("ESCAPE"))) {
        double t0 = now();
        while (!ep_failed && now() - t0 < 2) step();
        while (now() - t0 < 2) step();
        fprintf(stderr, "[%d] ESCAPE: pool slot 0 word 0 = %#lx (%s)\n", getpid(), (unsigned long)*(uint64_t *)pool,
                *(uint64_t *)pool == 0xdeadbeefcafef00dull ? "WRITTEN outside the registered region" : "untouched");
        exit(0);
    }

    size_t nseg = (N + PPS - 1) / PPS;
    uint64_t *done_buf = calloc(NSEG, 8);
    void **done_req = calloc(NSEG, sizeof(void *));
    uint64_t credit_msg[64];
    void *credit_req[64] = {0};
    long bad = 0;
    double c0 = 0;
    for (size_t r = 0; r <= REPS; r++) {
        draw(src, dst, tmp);
        for (size_t i = 0; i < N; i++) memset(pool + dst[i] * PAGE, 0, PAGE); /* verify every byte */
        for (size_t k = 0; k < NSEG; k++) flags[k * 8] = UINT64_MAX;
        c0 = cpu_s();
        double t = now();
        uint64_t go = r;
        tsend_wait(TAG(T_GO), &go, 8);
        size_t next = 0; /* next segment to scatter, in order */
        /* done messages: one receive posted per scratch slot (tag carries the segment) */
        if (MODE != M_FENCEFLAG)
            for (size_t k = 0; k < NSEG && k < nseg; k++)
                done_req[k] = trecv(TAG(T_DONE) | k, ~0ull, &done_buf[k], 8);
        while (next < nseg) {
            size_t slot = next % NSEG;
            int ready;
            if (MODE == M_FENCEFLAG) {
                ready = flags[slot * 8] == next;
            } else {
                void *q = done_req[slot];
                ready = q == NULL || ucp_request_check_status(q) != UCS_INPROGRESS;
                if (ready && q) { CHK(ucp_request_check_status(q), "done recv"); ucp_request_free(q); }
                if (ready && done_buf[slot] != next) DIE("done for segment %lu, expected %lu", (unsigned long)done_buf[slot], (unsigned long)next);
            }
            if (!ready) {
                step();
                if (ep_failed) DIE("consumer: ep failed");
                if (now() - t > 20) DIE("[%d] consumer: rep %zu segment %zu/%zu not signalled after 20 s", getpid(), r, next, nseg);
                continue;
            }
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            size_t i0 = next * PPS, i1 = i0 + PPS < N ? i0 + PPS : N;
            char *s = scratch + slot * SEG;
            if (MODE == M_TAGONLY) /* was the whole segment there when its tag arrived? */
                for (size_t i = i0; i < i1; i++)
                    if (*(uint64_t *)(s + (i - i0) * PAGE + PAGE - 8) != word(src[i], PAGE / 8 - 1)) { bad++; break; }
            for (size_t i = i0; i < i1; i++) memcpy(pool + dst[i] * PAGE, s + (i - i0) * PAGE, PAGE);
            /* the slot is free again: the producer may write segment next + NSEG into it */
            if (next + NSEG < nseg) {
                if (MODE != M_FENCEFLAG)
                    done_req[slot] = trecv(TAG(T_DONE) | slot, ~0ull, &done_buf[slot], 8);
                size_t ci = next % 64;
                if (credit_req[ci]) wait_req(credit_req[ci], "credit send");
                credit_msg[ci] = next + NSEG;
                credit_req[ci] = tsend(TAG(T_CREDIT), &credit_msg[ci], 8);
                if (UCS_PTR_IS_ERR(credit_req[ci])) DIE("credit send");
            } else if (MODE != M_FENCEFLAG) {
                done_req[slot] = NULL;
            }
            next++;
        }
        double dt = now() - t;
        if (r) { gbps[r - 1] = N * PAGE / dt / 1e9; *cpu += cpu_s() - c0; }
        for (int ci = 0; ci < 64; ci++) if (credit_req[ci]) { wait_req(credit_req[ci], "credit send"); credit_req[ci] = NULL; }
        /* verify every byte of every page */
        for (size_t i = 0; i < N; i++) {
            uint64_t *p = (uint64_t *)(pool + dst[i] * PAGE);
            for (size_t w = 0; w < PAGE / 8; w++)
                if (p[w] != word(src[i], w)) DIE("rep %zu page %zu (src %ld -> slot %ld) word %zu wrong", r, i, (long)src[i], (long)dst[i], w);
        }
    }
    *bad_tagonly = bad;
    uint64_t end = 0;
    tsend_wait(TAG(T_END), &end, 8);
    trecv_wait(TAG(T_END), ~0ull, &end, 8);
    if (rk) ucp_rkey_buffer_release(rk);
    ucp_listener_destroy(l);
}

static void put_producer(double *cpu) {
    init_ucx(1);
    char *store = huge_alloc(2 * N * PAGE);
    for (size_t r = 0; r < 2 * N; r++) {
        uint64_t *p = (uint64_t *)(store + r * PAGE);
        for (size_t w = 0; w < PAGE / 8; w++) p[w] = word(r, w);
    }
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = store, .length = 2 * N * PAGE};
    ucp_mem_h mh;
    CHK(ucp_mem_map(ctx, &mp, &mh), "mem_map store");
    uint64_t one = 1; /* unused */
    (void)one;
    int64_t *src = malloc(N * 8), *dst = malloc(N * 8), *tmp = malloc(2 * N * 8);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(PORT)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ucp_ep_params_t e = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR,
                         .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                         .sockaddr = {.addr = (void *)&a, .addrlen = sizeof a}};
    fill_ep_params(&e);
    if (read(port_pipe[0], &PORT, sizeof PORT) != sizeof PORT) DIE("port pipe");
    a.sin_port = htons(PORT);
    CHK(ucp_ep_create(wk, &e, &ep), "ep_create(client)");
    struct rkey_msg m;
    trecv_wait(TAG(T_RKEY), ~0ull, &m, sizeof m);
    ucp_rkey_h rkey;
    if (escape2()) { /* the consumer registered nothing: forge a key from our own registration */
        void *fk; size_t fl;
        CHK(ucp_rkey_pack(ctx, mh, &fk, &fl), "forge rkey_pack");
        memcpy(m.rkey, fk, fl);
        fprintf(stderr, "[%d] ESCAPE forged a %zu-byte rkey\n", getpid(), fl);
    }
    CHK(ucp_ep_rkey_unpack(ep, m.rkey, &rkey), "rkey_unpack");
    if (getenv("PUT_CORK") && atoi(getenv("PUT_CORK"))) cork_find();
    if (getenv("ESCAPE") && atoi(getenv("ESCAPE"))) {
        /* outside the registered scratch: into the consumer's pool, slot 0 (never registered) */
        ucp_request_param_t ep0 = {.op_attr_mask = 0};
        static uint64_t mark[8] = {0xdeadbeefcafef00dull};
        void *q = ucp_put_nbx(ep, mark, sizeof mark, m.pool, rkey, &ep0);
        fprintf(stderr, "[%d] ESCAPE put to pool %#lx: %s\n", getpid(), (unsigned long)m.pool,
                UCS_PTR_IS_ERR(q) ? ucs_status_string(UCS_PTR_STATUS(q)) : "posted");
        if (!UCS_PTR_IS_ERR(q)) wait_req(q, "escape put");
        void *f = ucp_ep_flush_nbx(ep, &ep0);
        wait_req(f, "escape flush");
        fprintf(stderr, "[%d] ESCAPE flush completed\n", getpid());
    }
    size_t nseg = (N + PPS - 1) / PPS;
    void **reqs = malloc(sizeof(void *) * (N + 4 * nseg));
    uint64_t *seqv = calloc(nseg, 8), *donev = calloc(nseg, 8);
    void **flushq = calloc(nseg, sizeof(void *));
    void **donereq = calloc(nseg, sizeof(void *));
    ucp_request_param_t pp = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH, .memh = mh};
    ucp_request_param_t fp = {.op_attr_mask = 0};
    double c0 = 0;
    for (size_t r = 0; r <= REPS; r++) {
        draw(src, dst, tmp);
        uint64_t go;
        trecv_wait(TAG(T_GO), ~0ull, &go, 8);
        c0 = cpu_s();
        size_t nreq = 0, reaped = 0, credits = NSEG, fl_done = 0;
        uint64_t credit_buf;
        void *creq = nseg > NSEG ? trecv(TAG(T_CREDIT), ~0ull, &credit_buf, 8) : NULL;
        double tgo = now();
        size_t posted = 0; /* segments whose puts (and flush) are posted */
        /* completed flushes, in order: each one's "segment done" tag (the consumer's
         * signal that the segment's bytes are in its scratch) */
#define REAP_FLUSHES()                                                                    \
        while (MODE == M_FLUSH && fl_done < posted) {                                     \
            void *q_ = flushq[fl_done];                                                   \
            if (q_ && ucp_request_check_status(q_) == UCS_INPROGRESS) break;              \
            if (q_) { CHK(ucp_request_check_status(q_), "flush"); ucp_request_free(q_); } \
            donev[fl_done] = fl_done;                                                     \
            donereq[fl_done] = tsend(TAG(T_DONE) | (fl_done % NSEG), &donev[fl_done], 8); \
            fl_done++;                                                                    \
        }
        for (size_t s = 0; s < nseg; s++) {
            while (s >= credits) { /* wait for the consumer to free the slot */
                if (now() - tgo > 20) DIE("[%d] producer: rep %zu no credit for segment %zu after 20 s (flushes done %zu)", getpid(), r, s, fl_done);
                if (creq == NULL || ucp_request_check_status(creq) != UCS_INPROGRESS) {
                    /* NULL: ucp_tag_recv_nbx completed at once (the message was there) */
                    if (creq) { CHK(ucp_request_check_status(creq), "credit recv"); ucp_request_free(creq); }
                    if (credit_buf != credits) DIE("credit %lu, expected %lu", (unsigned long)credit_buf, (unsigned long)credits);
                    credits++;
                    creq = credits < nseg ? trecv(TAG(T_CREDIT), ~0ull, &credit_buf, 8) : NULL;
                    continue;
                }
                step();
                REAP_FLUSHES();
                if (ep_failed) DIE("producer: ep failed");
            }
            size_t slot = s % NSEG, i0 = s * PPS, i1 = i0 + PPS < N ? i0 + PPS : N;
            uint64_t base = m.scratch + slot * SEG;
            for (size_t i = i0; i < i1;) { /* one put per run of adjacent store rows */
                size_t j = i + 1;
                while (j < i1 && src[j] == src[j - 1] + 1) j++;
                void *q = ucp_put_nbx(ep, store + src[i] * PAGE, (j - i) * PAGE, base + (i - i0) * PAGE, rkey, &pp);
                if (UCS_PTR_IS_ERR(q)) DIE("put: %s", ucs_status_string(UCS_PTR_STATUS(q)));
                if (q) reqs[nreq++] = q;
                i = j;
            }
            if (MODE == M_FLUSH) {
                void *q = ucp_ep_flush_nbx(ep, &fp);
                if (UCS_PTR_IS_ERR(q)) DIE("flush: %s", ucs_status_string(UCS_PTR_STATUS(q)));
                flushq[s] = q;
            } else if (MODE == M_FENCEFLAG) {
                CHK(ucp_worker_fence(wk), "fence");
                seqv[s] = s;
                void *q = ucp_put_nbx(ep, &seqv[s], 8, m.flags + slot * 64, rkey, &fp);
                if (UCS_PTR_IS_ERR(q)) DIE("flag put: %s", ucs_status_string(UCS_PTR_STATUS(q)));
                if (q) reqs[nreq++] = q;
            } else {
                donev[s] = s;
                void *q = tsend(TAG(T_DONE) | slot, &donev[s], 8);
                if (UCS_PTR_IS_ERR(q)) DIE("done send");
                donereq[s] = q;
            }
            /* reap local completions and completed flushes (in order) without waiting */
            ucp_worker_progress(wk);
            while (reaped < nreq && ucp_request_check_status(reqs[reaped]) != UCS_INPROGRESS) {
                CHK(ucp_request_check_status(reqs[reaped]), "put");
                ucp_request_free(reqs[reaped++]);
            }
            posted = s + 1;
            cork_push();
            REAP_FLUSHES();
        }
        /* drain: every flush completed and signalled, every request freed */
        double t0 = now();
        while (MODE == M_FLUSH && fl_done < nseg) {
            void *q = flushq[fl_done];
            if (q && ucp_request_check_status(q) == UCS_INPROGRESS) {
                cork_push();
                step();
                if (ep_failed) DIE("producer: ep failed");
                if (now() - t0 > 20) DIE("flush of segment %zu: no completion after 30 s", fl_done);
                continue;
            }
            if (q) { CHK(ucp_request_check_status(q), "flush"); ucp_request_free(q); }
            donev[fl_done] = fl_done;
            donereq[fl_done] = tsend(TAG(T_DONE) | (fl_done % NSEG), &donev[fl_done], 8);
            fl_done++;
        }
        for (; reaped < nreq; reaped++) { cork_push(); wait_req(reqs[reaped], "put"); }
        cork_push();
        for (size_t s = 0; s < nseg; s++) if (donereq[s]) { wait_req(donereq[s], "done send"); donereq[s] = NULL; }
        if (credits < nseg && nseg > NSEG) DIE("credit receive left over");
        if (r) *cpu += cpu_s() - c0;
    }
    uint64_t end;
    trecv_wait(TAG(T_END), ~0ull, &end, 8);
    tsend_wait(TAG(T_END), &end, 8);
    ucp_rkey_destroy(rkey);
}

/* putspike attack PORT ADDR: connect to a UCX listener on 127.0.0.1:PORT ($ATTACK_HOST if set; error handling
 * on, like the plane's tcp endpoints), forge an rkey (packed from a registration of our
 * own: on tcp it carries nothing the target checks), put 64 bytes of 0xdeadbeefcafef00d
 * at ADDR of the target and flush. For checking that a consumer that registered nothing
 * (no RMA feature) is written anyway (attack_plane.py). */
static int attack(int port, uint64_t addr) {
    SPIN = 0; ERRPEER = 1;
    init_ucx(1);
    static uint64_t mark[8] = {0xdeadbeefcafef00dull, 0xdeadbeefcafef00dull, 0xdeadbeefcafef00dull,
                               0xdeadbeefcafef00dull, 0xdeadbeefcafef00dull, 0xdeadbeefcafef00dull,
                               0xdeadbeefcafef00dull, 0xdeadbeefcafef00dull};
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = mark, .length = sizeof mark};
    ucp_mem_h mh;
    CHK(ucp_mem_map(ctx, &mp, &mh), "mem_map");
    void *fk; size_t fl;
    CHK(ucp_rkey_pack(ctx, mh, &fk, &fl), "rkey_pack");
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (getenv("ATTACK_HOST") && inet_pton(AF_INET, getenv("ATTACK_HOST"), &a.sin_addr) != 1)
        DIE("ATTACK_HOST: not an IPv4 address");
    ucp_ep_params_t e = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR,
                         .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                         .sockaddr = {.addr = (void *)&a, .addrlen = sizeof a}};
    fill_ep_params(&e);
    CHK(ucp_ep_create(wk, &e, &ep), "ep_create");
    ucp_rkey_h rkey;
    CHK(ucp_ep_rkey_unpack(ep, fk, &rkey), "rkey_unpack");
    ucp_request_param_t p0 = {.op_attr_mask = 0};
    wait_req(ucp_put_nbx(ep, mark, sizeof mark, addr, rkey, &p0), "put");
    wait_req(ucp_ep_flush_nbx(ep, &p0), "flush");
    fprintf(stderr, "attack: put of 64 bytes at %#lx flushed\n", (unsigned long)addr);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "attack")) return attack(atoi(argv[2]), strtoull(argv[3], 0, 0));
    if (argc != 9) DIE("usage: putspike PAGE N REPS flush|fenceflag|tagonly|raw peer|none spin|block NSEG SEG");
    PAGE = strtoull(argv[1], 0, 0); N = strtoull(argv[2], 0, 0); REPS = strtoull(argv[3], 0, 0);
    MODE = !strcmp(argv[4], "flush") ? M_FLUSH : !strcmp(argv[4], "fenceflag") ? M_FENCEFLAG
         : !strcmp(argv[4], "tagonly") ? M_TAGONLY : !strcmp(argv[4], "raw") ? M_RAW : -1;
    if (MODE < 0) DIE("bad mode");
    ERRPEER = !strcmp(argv[5], "peer"); SPIN = !strcmp(argv[6], "spin");
    NSEG = strtoull(argv[7], 0, 0); SEG = strtoull(argv[8], 0, 0);
    if (SEG % PAGE || NSEG < 1 || NSEG > 64) DIE("SEG must be a multiple of PAGE, 1 <= NSEG <= 64");
    PPS = SEG / PAGE;
    rs = 42;
    double *gbps = calloc(REPS, sizeof(double));
    int pfd[2];
    if (pipe(pfd)) DIE("pipe");
    int lfd = -1;
    if (MODE == M_RAW) { /* bind first, so the child knows the port */
        lfd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (bind(lfd, (void *)&a, sizeof a) || listen(lfd, 1)) DIE("bind");
        socklen_t al = sizeof a;
        getsockname(lfd, (void *)&a, &al);
        PORT = ntohs(a.sin_port);
    } else {
        PORT = 0; /* the listener picks one */
        if (pipe(port_pipe)) DIE("pipe");
    }
    pid_t child = fork();
    /* PIN=1: consumer on CPU 1, producer on CPU 0 (their threads, UCX's async thread too) */
    if (getenv("PIN") && atoi(getenv("PIN"))) {
        cpu_set_t cs;
        CPU_ZERO(&cs);
        CPU_SET(child == 0 ? 0 : 1, &cs);
        if (sched_setaffinity(0, sizeof cs, &cs)) DIE("sched_setaffinity");
    }
    if (child == 0) {
        double cpu = 0;
        if (MODE == M_RAW) {
            char *buf = huge_alloc(N * PAGE);
            memset(buf, 1, N * PAGE);
            raw_producer(buf, N * PAGE, &cpu);
        } else {
            put_producer(&cpu);
        }
        if (write(pfd[1], &cpu, sizeof cpu) != sizeof cpu) _exit(3);
        _exit(0);
    }
    double cpu = 0;
    long bad = 0;
    if (MODE == M_RAW) {
        char *buf = huge_alloc(N * PAGE);
        raw_consumer(lfd, buf, N * PAGE, gbps, &cpu);
    } else {
        put_consumer(gbps, &cpu, &bad);
    }
    double pcpu = -1;
    int st;
    if (read(pfd[0], &pcpu, sizeof pcpu) != sizeof pcpu) pcpu = -1;
    waitpid(child, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) DIE("producer failed (status %d)", st);
    double tot = 0, lo = 1e9, hi = 0, sorted[256];
    size_t nr = REPS < 256 ? REPS : 256;
    for (size_t i = 0; i < nr; i++) { sorted[i] = gbps[i]; tot += N * PAGE / (gbps[i] * 1e9); if (gbps[i] < lo) lo = gbps[i]; if (gbps[i] > hi) hi = gbps[i]; }
    for (size_t i = 0; i < nr; i++) for (size_t j = i + 1; j < nr; j++) if (sorted[j] < sorted[i]) { double t = sorted[i]; sorted[i] = sorted[j]; sorted[j] = t; }
    double med = nr % 2 ? sorted[nr / 2] : (sorted[nr / 2 - 1] + sorted[nr / 2]) / 2;
    /* CPU: seconds over the timed repeats (raw: whole run incl. warm-up rep), per second of transfer */
    double wall = tot; /* CPU seconds over the timed repeats / their wall time */
    printf("%s page=%zu n=%zu %s/%s nseg=%zu seg=%zu: median %.2f GB/s (%.2f-%.2f) cpu cons %.0f%% prod %.0f%%%s",
           argv[4], PAGE, N, argv[5], argv[6], NSEG, SEG, med, lo, hi, 100 * cpu / wall, 100 * pcpu / wall,
           MODE == M_TAGONLY ? "" : "\n");
    if (MODE == M_TAGONLY) printf(" incomplete-at-signal segments: %ld\n", bad);
    return 0;
}
