"""UCX implementation of the DataPlane, on ``ucxx`` (``pip install disagg[ucx]``).

Design choice, by channel (measured, below):

- ``shm``, producer StoreRows of a host store: one-sided *reads by the consumer*
  ("RMA (one-sided reads)"): the producer registers its store slab once (``ucp_mem_map``,
  remote read), sends per batch a header naming the slab row of every page plus the
  packed rkey; the consumer checks the batch like any other, then pulls every run of
  rows straight into its slots with ``ucp_get_nbx`` (cma: one ``process_vm_readv`` per
  run, one copy) posted from a C loop (``_ucxrma.c`` via ``ucx_rma.py``), and
  acknowledges the batch once every read completed. A store the producer placed with
  ``register_source`` lives in memory UCX allocated (shared memory): the consumer maps
  it (``ucp_rkey_ptr``) and copies the pages with the C row copy instead, one memcpy
  per row ("Mapped stores"); the gets remain for every other store.
- ``tcp`` (and rows that are not StoreRows, CUDA rows, a receiver that does not offer
  RMA, or ``_ucxrma`` not built): tagged messages received *straight into the
  destination rows* or into scratch (below). UCX's tcp transport has no get (``ucx_info
  -d``: put_zcopy only), so a pull would go through UCX's software RMA emulation; the
  one-copy alternative, the producer *writing* with ``ucp_put_nbx`` (tcp put_zcopy) into
  the consumer's slots, needs the consumer's pool registered for remote writes, which
  no longer lets the receiver enforce its slot rules or ``abort`` (the producer's writes
  land from the consumer's own progress, wherever the producer aims), and in the spike
  (/scratch/ucx/spike_put.py: 16 puts of 64 KiB random rows into random slots over a
  listener endpoint, error handling on) ``ucp_ep_flush_nbx`` never completed; 256 MiB
  runs never finished. Not pursued: tcp keeps the tag path. Session 10 spike
  (docs/spikes/ucx-put/NOTES.md): put + flush does work over tcp once both workers keep
  progressing, but one ``sendmsg`` per page (``ucp_put_nbx`` takes one contiguous buffer)
  holds 64 KiB pages at 0.40-0.67 of raw TCP against the tag path's 0.68-0.79; and the
  pool is exposed over tcp anyway (see "Exposure").

Exposure (session 10). UCX's tcp transport executes a peer's put at any address of the
process, registered or not (its put carries the address; the "rkey" it checks is empty),
and UCX's rendezvous sends every large tag message as such puts, so it cannot simply be
turned off (``UCX_TCP_PUT_ENABLE=n``: the tag path falls to 0.14-0.35 of raw TCP). Every
worker also listens with that transport on every network device. So a process with a UCX
plane took memory writes from any host that could reach it: ``tests/security/
test_ucx_exposure.py`` has a peer in another network namespace overwrite a consumer's
page slot through the plane's listener. Each plane's UCX context is now kept to what it
serves (``_exposure_config``): ``shm`` loads no tcp transport (worker-address endpoints on
one host need none), ``tcp`` runs it only on the device that owns its bind address
(``lo`` for the default ``tcp://127.0.0.1:0``); the same peer's put is then refused. An
operator's ``UCX_TLS`` / ``UCX_NET_DEVICES`` win. Session 11: whoever could reach the
bind device (other local users on loopback; the network of a non-loopback bind) could
still write, so every ``tcp`` plane (CUDA ones too) now also runs ``TCP_HARDENING`` (the put refused;
active-message rendezvous in 2 MiB segments, as fast as the put one in 5 bench A/B
pairs of session 10) unless the operator set any of its settings. Its receivers say
``tcpam=1`` in their endpoint; a hardened sender refuses an endpoint without it at once
(an earlier receiver's 8 KiB UCX segments never take 2 MiB fragments: the push would
only miss its deadline), an earlier sender still pushes to a hardened receiver
(tests/transport/test_ucx_tcp_protocol.py). Left: ucxx 0.52 binds the connection
listener itself to every address (no host argument; a peer that connects through it
finds no tcp device of ours to reach); ``shm`` and ``auto`` planes keep the put
rendezvous (same host: cma, cuda_ipc). ``bench transfer`` A/B of the tcp plane on ``lo``
only against every device: no difference beyond noise (64 KiB 2.6-3.2 GB/s both).

Why reads by the consumer and not writes by the producer on shm: the consumer writes
only its own slots, after its ``ReceiverBook`` checked them (bounds, promised slots, each
once), so every receiver rule and ``abort`` hold unchanged, and only the producer's store
is exposed (read-only); a push model would expose the consumer's page pool to writes
(over tcp UCX exposed all of it regardless, until "Exposure" above).
Measured on the 2-core box (same bench as below): cma reads move 64 KiB pages at
6.6-7.5 GB/s, 256 KiB at 8.7-9.5, against 2.8-4.2 / 3.7-4.4 through tag messages +
scratch + scatter, and against NIXL's one-sided writes of the same pages, 3.5-4.1 /
4.1-5.6 (full numbers in "RMA (one-sided reads)").

Tag path, first measurements (2 cores, loopback, 128 MiB of scattered pages, ``python -m
disagg.bench transfer``): a plain ucxx 64 MiB tag send/recv between two processes reaches
4.5-4.7 GiB/s over tcp (``python -m ucxx.benchmarks.send_recv -l ucxx-core --progress-mode
blocking -n 67108864``); this plane first reached 1.4-2.3 GB/s over tcp and 3.6-5.1 GB/s
over shared memory. What separated it from the library was Python work, not the wire:
torch's CPU ``index_copy_`` scattering packed segments at 0.6 GB/s (now numpy, ~8 GB/s), a
probe per pending segment per progress loop (now one masked probe per arrived message),
and a busy-spinning progress thread competing with the peer process for 2 cores (now
blocking progress on the worker's event fd).

Wire of the tag path (all tagged messages on one UCX worker per plane):

- Headers travel under tag ``_HDR_TAG``: 4-byte little-endian length + a msgpack
  ``PageBatch`` or ``TransferDone`` (protocol/messages.py, unchanged).
- Each PageBatch's payload (host rows; CUDA rows: see "CUDA memory") is cut into
  *segments* by ``segments()``, a function of the header alone, so both sides agree without saying more: a run of at least
  ``DIRECT_MIN`` bytes is its own segment (split at ``SEG_BYTES``), smaller runs are
  packed together up to ``SEG_BYTES``. Segment ``k`` of a transfer goes under tag
  ``_data_tag(key, transfer_id, k)``: top bit set, 63 bits of BLAKE2b keyed with the
  transfer's token (16 random bytes only the consumer and the producer it authenticated
  know). Headers are checked against the token, and so, through their tags, are payload
  segments: a peer that can reach the endpoint and knows the transfer id but not the
  token cannot name a segment the receiver waits for, so its messages are discarded.
  The sender posts a whole push's messages back to back.
- The receiver takes arrived data messages with one masked probe
  (``tag_probe(remove=True)`` over every tag with the top bit), looks the tag up among
  the segments announced by accepted headers, and only then posts the receive: it knows
  the sender's length first, so a receive is only ever posted for a message that has
  arrived with exactly the announced size (ucxx has no request cancel, so a receive
  posted ahead could not be revoked by ``abort``). A run segment for a single
  contiguous region lands zero-copy in the page rows; other segments land in a reusable
  scratch buffer and are scattered with numpy (over tcp with large segments: straight
  into the slots as iov receives, "Scatter-gather receives over tcp"). Messages under unknown tags (a refused
  batch, a foreign sender) are received into a throw-away buffer.
- A transfer ends with a TransferDone header; the receiver reports DONE once every
  segment it announced has completed and the page counts agree.

Shared memory (``shm`` channel), chosen by measurement (2 cores, ``disagg bench transfer
--transports ucx-shm``, 256 MiB of random-slot pages into a torch pool; py-spy and
per-call timers in both processes). Python is not where the time goes: the progress
threads spent <5% of a transfer in Python; the sender's ``worker.progress()`` (UCX's
rendezvous "zero-copy flushed write to remote" over ``cma``, i.e. ``process_vm_writev``
into the receiver's buffer) ran at 5.4 GB/s, and the receiver's numpy scatter at ~6.3
GB/s. CMA pins the *remote* pages: into huge-page memory (numpy's big arrays, like the
scratch buffers) it copies at memcpy speed (13 GB/s), into a torch pool's 4 KiB pages at
5.2-9 GB/s. Hence on ``shm`` every run is packed into ``SEG_BYTES`` segments
(``SHM_DIRECT_MIN``: no segment lands in the rows directly) that land in the huge-page
scratch and are scattered, and a scratch freed by a scatter is handed to the next arrived
segment before the next scatter, so the sender's copy into it overlaps this thread's
scatters (before: the thread scattered every completed segment, then posted receives, so
the two processes copied in turn). Back-to-back A/B runs at 256 KiB-4 MiB pages: 0.29-0.41
of memcpy before, 0.33-0.59 after; 64 KiB (already packed) unchanged at ~0.3-0.4 (the box
was shared with other test runs, so every figure is noisy).

Two more things decide CMA's speed (``process_vm_writev`` timed on its own via ctypes,
256 MiB in 16 MiB calls): the destination's page size (4 KiB pages 5.9-6.6 GB/s, huge
pages 11.3-12.6, memcpy 12-13) and the *relative* alignment of source and destination:
the kernel's ``rep movsb`` copy runs at 6.8-9 GB/s into huge pages when the two addresses
differ modulo 64, 11.3-12.2 when they agree. numpy's big arrays start 16 bytes into a
page and torch's 64 bytes, so the old numpy scratch made every copy from a torch store
misaligned. The scratch now comes from ``hostmem.empty`` (2 MiB-aligned huge pages). And
a receiver whose host regions all come from ``hostmem.empty`` (huge pages: the bench's
pool, an operator's CPU pool) says so in its endpoint (``ucx+shm://<address>?direct=1``):
a sender that sees it cuts host batches with ``DIRECT_MIN`` instead and sends their
headers under ``_HDR_DIRECT_TAG`` (so the receiver cuts them the same way, whatever
endpoint string the sender used), and runs of 1 MiB or more land in the rows with one
copy. ``disagg bench transfer --transports ucx-shm``, hostmem store and pool, 5-7 runs
each: 1 MiB pages 6.5-8.5 GB/s packed -> 9.2-11.3 direct, 4 MiB 6.9-8.5 -> 10.0-11.7
(0.72-0.87 of memcpy). At 16-256 KiB (still packed) 4.1-8.7 GB/s (0.30-0.63) against
2.5-6.6 (0.20-0.50) before (numpy scratch, and a numpy store, which happened to agree
with it modulo 64): medians 1.05-1.15x, within this box's noise. From a torch store
(the producer's, before hostmem) the old scratch was misaligned: 3.1-6.7 GB/s.

What limits it now (``perf record -e cpu-clock`` of both processes): packed runs are two
copies, CMA into the scratch on the sender's core (~60% of it in ``_copy_from_iter``) and
the scatter on the receiver's (~70% in ``memmove``), both cores busy; direct runs are one
CMA copy on the sender's progress thread (~85% of a core), the receiver idle. One copy
for small pages needs CMA straight into the slots with an iovec per page (timed via
ctypes into huge pages: 5.8 GB/s at 16 KiB, 9.8 at 64 KiB, 13 from 256 KiB). UCX 1.21
does not do that through its tag API even when asked through libucp directly (ucx_iov.py:
an IOV receive is answered with sysv copy-in copy-out pieces, fast when both cores are free,
collapsing to 2-3 GB/s when a third thread takes one); an RMA get into an iov of the slots
is one copy but measured no better than the scratch path at 64-256 KiB.

Sender, store rows on the tag path (a receiver without ``rma=2``, or tcp;
``accepts_store_rows``; bench changed at f2b6b52 to draw the N source
rows at random from a 2N-row store and to time the producer's gather). ``post_push``
takes ``StoreRows`` of a host slab and plans the same batches and segments as before
(the wire is unchanged; the receiver cannot tell): a segment whose pages are one span of
the slab goes as a view; on ``shm`` a scattered one goes as ONE scatter-gather message
from the rows where they lie (``ucx_iov``: ``ucp_tag_send_nbx`` with ``UCP_DATATYPE_IOV``
through ctypes on the ucxx endpoint's ``ucp_ep_h``; off, or libucp not as expected:
gather into the send ring); over tcp (and ``ucx+addr``) a numpy ``take`` per segment into
the send ring (below), except where the context has large tcp segments ("Scatter-gather
sends over tcp"). Why not iov over tcp with UCX's default tcp settings:
that endpoint (error handling on) sends an iov message in 8 KiB copy-in pieces, 0.19-0.45
of raw TCP at 64 KiB against 0.35-0.69 gathered. Why not a one-copy iov *receive*: UCX
1.21 answers an IOV receive buffer with "fragmented copy-in copy-out" through the sysv
FIFO (two copies in lock step), and an IOV send on shm likewise (``UCX_PROTO_INFO=used``:
"rendezvous data send from iov[255] ... fragmented copy-in copy-out, sysv"); details and
spike numbers in ucx_iov.py. ``disagg bench transfer --transports ucx-shm,ucx-tcp
--page-sizes 64KiB,256KiB,1MiB,4MiB --total 256MiB --repeats 5``, A/B back to back
(``DISAGG_UCX_IOV=0`` for B), GB/s (ratio of the row's ceiling):

- before (torch gather of ``materialize()`` in the timed window, ~2.3 GB/s): shm
  2.13/1.63/2.33/2.27 (0.15/0.13/0.17/0.17); tcp 1.46/1.21/1.78/1.80 (0.35/0.33/0.41/0.45)
- shm iov sends, 3 runs: 64 KiB 3.74-4.00 (0.28-0.33), 256 KiB 3.84-4.60 (0.28-0.35), 1 MiB
  6.34-8.19 (0.48-0.66), 4 MiB 8.47-10.47 (0.62-0.77); shm numpy gather instead:
  2.71/2.45/7.73/11.0 (0.19/0.17/0.60/0.82)
- tcp numpy gather, 3 runs: 1.36-1.91 (0.36-0.69), 1.58-1.77 (0.40-0.51), 2.71-3.82
  (0.77-0.96), 2.80-3.58 (0.67-1.05)

Segments over tcp (session 9; ``TCP_SEG_BYTES``, ``_TCP_SEG_QUERY``, ``_HDR_TCP_SEG_TAG``,
``_scatter_host``, ``GatherSeg.gather_into``). ``perf record -e cpu-clock -g -a`` of a
64 KiB-page run showed the user copies costing as much as the kernel's socket copies
(memmove 12-13% of both cores on each side against ``_copy_from_iter`` 14% /
``_copy_to_iter`` 11%) and the sender's core the busier (~88% of a core, the receiver's
~66%). Two changes: (1) the gather into the send ring and the scatter out of scratch use
the C row copy (one memcpy per row, 1 thread: 2 threads measured worse, 2.66 against
2.85 GB/s), which for full 16 MiB segments also means non-temporal stores; (2) a tcp
receiver offers ``seg=2m`` in its endpoint, and a sender that sees it cuts packed
segments at 2 MiB and sends the headers under ``_HDR_TCP_SEG_TAG`` (older peers: no
query, so 16 MiB segments under ``_HDR_TAG``, which this receiver still takes), so the
gather's writes and the kernel's reads of a send buffer, and the kernel's writes and the
scatter's reads of a scratch buffer, meet in L2/L3 instead of memory. In-pair A/B
(/scratch/tcp2/h.py: one process pair, 256 MiB pushes of random 64 KiB rows into random
slots, modes alternating, 8-9 transfers each, median GB/s; raw TCP 3.5-4.5): numpy
16 MiB 2.59-2.71, C row copy 16 MiB 2.91-2.99, 2 MiB segments 3.15; 256 KiB pages numpy
16 MiB 2.92, C row copy 16 MiB 3.08-3.18, 4 MiB 3.17, 2 MiB 3.56 (8 MiB 2.94, 1 MiB and
512 KiB worse: 2.0/1.4 at 64 KiB, the per-message rendezvous; 8 or 16 buffers in flight
instead of 4 no better). Not kept: a gather thread that fills the ring ahead of the sends
(2.66 against 3.09 GB/s, 4 MiB segments), non-temporal stores in the scatter at 2-4 MiB
(within noise). ``flock /tmp/bench.lock disagg bench transfer --transports ucx-tcp
--page-sizes 64KiB,256KiB,1MiB --total 256MiB --repeats 5``, 2 A/B pairs, GB/s (ratio):
before 64 KiB 2.60/2.21 (0.69/0.59), 256 KiB 2.82/2.34 (0.67/0.64); after 64 KiB
3.21/3.27 (0.74/0.78), 256 KiB 3.43/2.46 (0.82/0.60); 1 MiB pages (direct runs) take
neither path. What limits it now: the sender's core (gather + ``_copy_from_iter`` +
loopback softirq); 0.9 needs the gather off it, which UCX's tcp (no zero-copy iov send,
no get) does not offer with its default tcp settings (it does with large tcp segments:
"Scatter-gather sends over tcp").

Scatter-gather sends over tcp (session 11; ``tcp_large_segments``, ``tcp_iov_default``,
``tcp_iov_sends``, ``DISAGG_UCX_TCP_IOV``). With the hardened tcp settings ("Exposure":
``TCP_HARDENING``, a tcp plane's own default since this session; an operator's form is
``UCX_TCP_PUT_ENABLE=n UCX_RNDV_SCHEME=am UCX_TCP_TX_SEG_SIZE=2m UCX_TCP_RX_SEG_SIZE=2m``)
UCX 1.21 sends an iov tag message zero-copy from the iov: ``UCX_PROTO_INFO=used`` on a
listener endpoint (error handling on, ``tcp/lo``), 2 MiB messages: contiguous "rendezvous
zero-copy" then "rendezvous data send from host memory ... zero-copy"; 32 x 64 KiB and
8 x 256 KiB iov the same ("... from iov[32] ... zero-copy", am_zcopy of up to
``UCX_TCP_MAX_IOV`` (6) entries per fragment, i.e. ``writev`` from the store rows). With
the defaults (put rendezvous, 8 KiB segments) and with ``RNDV_SCHEME=am`` in 8 KiB
segments the iov's data goes "fragmented copy-in copy-out" above 16 KiB (the 8 KiB
pieces above); the rendezvous scheme and the segment size decide it, ``TCP_PUT_ENABLE``
does not. So a tcp plane whose context has ``RNDV_SCHEME=am`` and a tcp send segment of
at least ``TCP_SEG_BYTES`` (read from the config dict it was made with, else the
environment) sends scattered StoreRows segments (still cut at 2 MiB, same wire) as iov
messages instead of gathering them into the send ring: the gather copy leaves the
sender's busy core. The ring stays for everything else (UCX's default tcp settings,
``DISAGG_UCX_TCP_IOV=0``, ``DISAGG_UCX_IOV=0`` or ``ucx_iov`` unavailable, ``ucx+addr``);
``DISAGG_UCX_TCP_IOV=1`` forces iov sends. Measured on the 2-core box (docs/spikes/
ucx-tcp-iov/): in one process pair (``inpair.py``: 256 MiB pushes of random rows of a
2N-row hugepage store into random slots, modes alternating with a raw TCP stream, 8
transfers each, 3 invocations; medians), GB/s (ratio of raw TCP in the same invocation):

- 64 KiB: defaults/ring 3.13/3.02/3.22 (0.76/0.76/0.84); hardened/ring 3.00/2.75/3.12
  (0.72/0.70/0.82); hardened/iov 3.44/3.28/3.47 (0.83/0.83/0.91): +11-19% over the ring
- 256 KiB: defaults/ring 3.30/3.14/2.94 (0.89/0.76/0.80); hardened/ring 3.21/3.22/3.02
  (0.86/0.77/0.82); hardened/iov 3.57/3.57/3.44 (0.96/0.86/0.93): +11-14%
- also tried: iov with 16 MiB segments (sender ignoring ``seg=2m``): 64 KiB 3.03-3.07,
  256 KiB 3.49-3.67, no better than 2 MiB; iov with ``UCX_TCP_MAX_IOV=64`` (more rows per
  ``writev``): 64 KiB 3.39-3.51 (as 6), 256 KiB 3.59-4.04 (0.97-1.07; +5-13% over 6): so
  a tcp plane sets it (``TCP_TUNING``) unless the operator did.

``disagg bench transfer --transports ucx-tcp --page-sizes 64KiB,256KiB,1MiB --total 256MiB
--repeats 5`` (separate processes per row, raw TCP measured before each row; this box's
raw TCP moved 2.4-4.1 GB/s between runs, so ratios scatter), 4 rounds alternating:
defaults 64 KiB median 2.60 GB/s (ratio 0.71, 0.52-0.78), 256 KiB 2.95 (0.76, 0.67-1.11);
hardened/ring 2.85 (0.72, 0.65-0.80), 3.01 (0.76, 0.62-0.87); hardened/iov 2.81 (0.96,
0.75-1.02), 3.12 (0.90, 0.81-0.99); 1 MiB pages (direct runs, views: no gather either
way) medians 3.34/2.91/3.78. After the change (``DISAGG_UCX_TCP_IOV=0`` for the ring), 3
rounds: defaults 3.03 (0.73, 0.69-0.84) / 2.96 (0.80, 0.75-0.85) / 3.42; hardened/ring
2.97 (0.76, 0.38-0.87) / 2.34 (0.59, 0.57-2.40) / 3.70; hardened/iov 3.19 (0.86,
0.79-1.29) / 3.00 (0.85, 0.62-0.88) / 4.04. The in-pair figures are the ones to trust.

Scatter-gather receives over tcp (session 11; ``tcp_iov_recvs``, ``tcp_iov_recv_default``,
``DISAGG_UCX_TCP_IOV_RECV``, ``_batch_iov``, ``_rx_iov``). Under the same settings the
receiver's copies were: the kernel's into UCX's 2 MiB tcp receive buffer, UCX's unpack of
each active-message fragment into the posted buffer (the scratch), and the C row copy
out of it. A receive whose buffer is an iov of the slots (``ucp_tag_msg_recv_nbx`` with
``UCP_DATATYPE_IOV``) is unpacked straight into them: ``UCX_PROTO_INFO=used`` on the
receiver, "rendezvous data fetch into iov[32] host memory from host ... zero-copy",
exactly as for a contiguous buffer (no copy-in copy-out pieces: that was shm's sysv
FIFO, ucx_iov.py). So a tcp plane under those settings (``DISAGG_UCX_TCP_IOV_RECV=0``
turns it off, ``=1`` on under an operator's protocol) computes, when it accepts a host
batch, the (address, length) entries of every page's slot in every region
(``ucx_iov.page_iov``, one vectorised call per batch, from slots the book has just
checked), and receives each packed segment (and a run into a group of several regions)
as one iov receive: it looks at the arrived message first (libucp probe without
remove), and only a segment with entries, of a live transfer, with exactly the
announced length, is taken and posted (``ucx_iov.tag_recv_exact``); anything else goes
the ucxx way as before (scratch for device slots, in place for a run into one region,
discard, or the length mismatch that fails the transfer). A message longer than its iov
could only end in UCX's truncation error (``UCS_ERR_MESSAGE_TRUNCATED``, refused at
once for a rendezvous; test_ucx_iovrecv.py), never past the entries. A posted receive
cannot be taken back (``ucp_request_cancel`` reaches only receives still waiting for a
match; these are matched), so it counts in ``Rx.inflight`` until UCX completes it, and
``abort`` waits for it; one that outlives the wait (a stalled producer) is ended by
severing (below). Opt-in in session 11 for want of that.

Severing (session 12; ``UcxDataPlane.abort``, ``_sever``, ``sever_wait_s``). Receives
straight into slots (iov receives; runs of 1 MiB+ landing in place, on every channel)
can outlive an abort's wait when the producer stalls (stopped, or a partition UCX has
not noticed yet); resumed, it would finish them into slots the engine may have reused.
So when writes outlive ``abort_wait_s`` on the tcp channel, the plane force-closes
every accepted endpoint on its progress thread (ucxx ``close_blocking``: accepted
endpoints have error handling, so ucxx closes with ``UCP_EP_CLOSE_FLAG_FORCE`` and then
lets go of the UCP handle), which ends their matched receives with an error within
0.04-0.27 s (about 60 receives of 2 MiB; docs/spikes/ucx-tcp-iov/forceclose.py); what
the producer sends after resuming meets a closed connection and lands nowhere. Then
``abort`` waits again (``sever_wait_s``) and returns what is left (0 in every run so
far). UCX does not say which connection a matched receive came over, so every
producer's connection goes: their transfers under way fail (the consumer's failure rule
recomputes) and each producer reconnects on its next push. (Session 11 tried ucxx's
non-blocking ``close()``, which leaves the receives running, and ``ucp_ep_close_nbx``
through libucp, after which ucxx hung closing the plane.) Worker-address channels
(shm, auto) have no accepted endpoints to sever: there a stuck write stays reported
and the consumer stops reusing slots ("stuck writes"). In-pair (``inpair.py``, modes C64 = iov sends + scratch, R64 = iov sends + iov
receives, 6-8 invocations of 10 transfers each, medians per invocation; docs/spikes/
ucx-tcp-iov/NOTES.md): 64 KiB 2.81-3.67 -> 2.70-4.12 GB/s, median gain +15% (-4% in
the one invocation where the whole box was slow; ratio of raw TCP 0.80-0.94 -> 0.80-1.05,
mostly ~1.0); 256 KiB 2.70-3.82 -> 3.78-4.32, +8-41%; the consumer's CPU per GB 5-15%
lower. (Building the entries per segment in Python instead
of per batch ate the whole gain.)

Tried for tcp in session 6 and not merged (branch ``ucx-tcp``: ``_ucxtag.c``, the
spike and its notes in ``docs/spikes/ucx-tcp/``): one tag message per run of 256 KiB or more, posted
straight from the store rows and received straight into the slots, both loops in C (probe
with remove, lookup in a table filled only from accepted headers, exact length, unknown
tags drained). It keeps one copy per side, but every message adds about four small
loopback packets of rendezvous handshake, ~15 us of kernel time per side: 64 KiB
0.31-0.62 of raw TCP against 0.51-0.58 packed; in the plane, ``disagg bench transfer
--transports ucx-tcp``, A/B in 3 pairs, 256 KiB 1.35-2.58 GB/s against 2.19-2.48 and
1 MiB 3.14-4.19 against 2.76-3.60: no reliable gain for the code it adds.
``UCX_TCP_RX_SEG_SIZE=8K`` moved the spike's 256 KiB from 2.04 to 2.97 GB/s and is the
thing to settle next (many back-to-back runs) before trying again.

Send ring (``GatherSeg``, ``_tx_pump``). The tcp gather used to run up front on the
caller's thread into freshly allocated memory (np.take into fresh buffers: 0.5-4.6 GB/s,
page faults). Now a scattered segment is planned as a ``GatherSeg`` and gathered by the
progress thread right before it is posted, into one of ``_SEND_BUFS`` (4) ``SEG_BYTES``
buffers per plane (``hostmem.empty``, allocated lazily and prefaulted once), one gather
per loop turn so UCX progresses segment k between gathers, a buffer reused only once its
send request completed. A push whose sends fail or hit the deadline hands its buffers
still in flight to a zombie list (never reused until UCX completes them; the ring may
allocate replacements meanwhile). A push waits (under its deadline) while all buffers are
in flight, also when another push holds them. ``np.take(..., mode="clip")`` into the
buffer: 11-12 GB/s (numpy's default bounds check buffers ``out``: 4.3); column spans by a
fancy-index copy per span (~8 GB/s). Same bench, 64 KiB/256 KiB pages (1 MiB and up are
direct runs, sent as views, unchanged), 5 runs each, before and after interleaved:

- tcp: 64 KiB 1.20-1.94 GB/s (0.30-0.56 of raw TCP, median 1.81) -> 2.12-2.73 (0.51-0.66,
  median 2.22); 256 KiB 1.44-1.89 (0.40-0.88, median 1.82) -> 2.15-3.08 (0.55-0.70 and one
  1.30 against a 1.9 GB/s ceiling, median 2.43)
- shm, ring (``DISAGG_UCX_IOV=0``) against iov sends, 8 runs each, half of them run in
  each order: 64 KiB 3.77-4.72 (median 4.13) vs 2.95-4.77 (3.91); 256 KiB 3.80-5.17 (4.60)
  vs 3.19-4.82 (4.39). No clear margin (the ring's floor is higher: the iov's lock-step
  copy-in copy-out stalls when a third thread takes a core), so shm keeps iov sends and
  uses the ring only where they are off or unavailable.

What limits the packed sizes (64-256 KiB) now: three copies on shm (UCX packs the iov into
the FIFO, unpacks into the scratch, numpy scatters; with the ring: gather, CMA, scatter),
and on tcp the sender's one progress thread doing gather + socket send copies in turn
(on 2 cores both processes are busy, so the gather of segment k+1 overlaps the kernel's
side of segment k, not the receiver's copies).

Endpoints (``endpoint`` property, carried unchanged by the control Push message):

- ``ucx+tcp://host:port?seg=2m``: a UCX listener (TCP; endpoint error handling on, so a
  dead peer fails the requests in flight); ``seg=2m``: packed segments of
  ``TCP_SEG_BYTES`` ("Segments over tcp"; older senders ignore it).
- ``ucx+shm://<hex worker address>``: endpoints made from the worker address with error
  handling off, the only way UCX uses shared memory / CMA here (deps.md pitfall 3;
  "Peer failures on shm"). A peer that dies mid-transfer is then noticed by the
  deadline only (or, on the RMA path, by a failed read). ``rma=2`` (query) once the receiver reads StoreRows batches
  itself, from version-2 headers ("RMA (one-sided reads)"); senders that know only
  version 1 (``rma=1``) ignore it and send tag messages. ``?direct=1``
  once every registered host region is huge-page memory from ``hostmem.empty`` (see
  "Shared memory"); older senders ignore the query and keep packing.

RMA (one-sided reads; ``ucx_rma.py``, ``_ucxrma.c``). Offered by a ``shm`` receiver whose
registered regions are all host memory, when ``ucx_rma.available()`` (the C loop is
built, libucp as mirrored, ``DISAGG_UCX_RMA`` not ``0``): its endpoint carries ``rma=2``
and its UCX context has the RMA feature. A ``shm`` producer that sees it cuts the host
``StoreRows`` of a push into batches (``_plan_rma``, "Batches of an RMA push" below)
and sends each as ONE header under ``_HDR_RMA_TAG`` (tag 0, in the header mask, so
headers and TransferDone keep their order): version 2 (``_rma_frame``), a
length-prefixed ``_RMA_FIXED`` block (magic ``RMA2``, transfer, lease, group, page
size, batch number, page count, the slab's address, rows, stride and width), the token,
the packed rkey of the slab, the producer's own worker-address endpoint, the column
spans, and the destination slot and slab row of every page as int64 arrays. No payload
message follows. A header of another version is refused by name (``_rma_refuse``:
counted and logged; a version-1 header, which still parses far enough to be
authenticated, also fails its transfer and its push with "RMA header version 1 is not
supported (this plane reads version 2)"); peers of different versions never get there,
as each offers or looks for its own ``rma=`` query and otherwise uses tag messages.
The slab is registered on first use by the progress thread
(``_rma_reg``: keyed by address and length, the tensor kept alive while mapped, the
least recently used of more than ``_RMA_REGS`` unmapped when no active push reads it)
and unmapped on close.

The receiver (``_rx_rma``) authenticates the header and checks the whole batch before a
single read is posted: the book's slot checks (``accept_slots`` on the header's slot
array: bounds, promised slots, each once), and the source description (``_rma_check``:
rows inside the slab, columns inside a row and adding up to the page size, a host
group, a worker-address endpoint). It connects
back to the producer (cached, error handling off like every shm endpoint: a producer
that dies during the reads fails them, "Peer failures on shm"), unpacks the
rkey (cached per endpoint and key, destroyed on close or when the endpoint is
replaced), builds the read list with numpy (``ucx_rma.op_lists``: a page cut at column
and region boundaries, reads that continue one another on both sides merged, so a run
of rows into a run of slots is one read), and the batch's readers post it from the C
loop ("Reader threads", below; the progress thread does not sleep while it has reads to
claim or in flight: cma reads progress in worker progress, not on the event fd). A
batch's pages count as landed only once every reader of it finished (nothing left to
claim, its own reads completed) and every read completed with UCS_OK; a failed or
refused read, on any reader, fails the transfer.
Then the receiver acknowledges the batch to the producer under ``_ack_tag`` (keyed with
the token like the data tags: a stranger cannot forge one, which would make the
producer release rows still being read), with an error text when it failed or was
refused. The producer sends its TransferDone only after every batch was acknowledged,
so a receiver can only end DONE after all its reads completed while the producer still
held the rows; a producer that gives up (deadline, close) sends no TransferDone, and a
read that then sees reused rows belongs to a transfer that can only fail. A producer
that dies mid-transfer fails the reads (cma: ``ESRCH``) or, if they had completed, leaves
the transfer without its TransferDone until its deadline: typed failures, no page of a
DONE transfer is wrong (tests/transport/test_ucx_rma.py).

What is exposed to whom (details in ucx_rma.py): a consumer that received an RMA header
(which goes only to the endpoint the consumer's control Push named, authenticated by the
transfer's token) holds the rkey of the producer's whole store slab, read-only, as long
as the producer keeps it mapped: the trust model of NIXL and of the ipc plane's shared
store. Nothing of the consumer is exposed. The receiver connects back to the endpoint
an authenticated header names (only worker addresses are accepted).

Measured (``flock /tmp/bench.lock disagg bench transfer --transports ucx-shm,ucx-tcp,nixl,
mooncake --page-sizes 64KiB,256KiB,1MiB,4MiB --total 256MiB --repeats 5``, random rows of a
2N-row hugepage store into random slots of a hugepage pool, 3 runs each, GB/s and ratio
of the row's memcpy ceiling; before = tag path, i.e. ``DISAGG_UCX_RMA=0``):

- shm before (tag path: iov sends, scratch, numpy scatter; 2 runs + the session's
  first): 64 KiB 2.83-4.20 (0.21-0.31), 256 KiB 3.66-4.44 (0.26-0.33), 1 MiB 8.24-8.79
  (0.53-0.66), 4 MiB 8.49-9.87 (0.64-0.69); NIXL in the same runs 3.40-4.06, 4.89-5.63,
  5.28-6.37, 5.57-6.12.
- shm RMA, 3 runs: 64 KiB 5.11-6.74 (0.36-0.47), 256 KiB 8.02-8.92 (0.57-0.69), 1 MiB
  9.68-11.01 (0.72-0.77), 4 MiB 9.71-10.93 (0.71-0.81); NIXL in the same runs 3.43-3.77,
  3.74-5.30, 4.21-5.61, 5.49-5.99: faster than NIXL at every size in every run.
- tcp (tag path, unchanged) in the same runs: 2.07-2.37 (0.58-0.62 of raw TCP),
  2.07-2.43 (0.53-0.61), 2.72-4.35, 2.39-4.85; Mooncake 1.39-1.52, 2.43-2.53, 2.02-2.24,
  1.86-1.94 (a tie at 256 KiB, ahead elsewhere).

What limited it with one reader (the figures above): every copy is one
``process_vm_readv`` per run, made by the consumer's progress thread on one core (the
producer's core idles), and UCX's cma serves one operation per ``ucp_worker_progress``
(``UCX_CMA_TX_QUOTA=1``; 8 measured worse: 4.8/6.4 against 5.3/7.3 GB/s at 64/256 KiB).
The medium's ceiling for that, measured in the same run (/scratch/ucx/rma_bench.py: the
plane pulling 256 MiB of random rows into random slots, 10 reps, next to the same pages
read by a ctypes loop of raw ``process_vm_readv``, one call per page, in the consumer):
64 KiB plane 5.9 (4.7-6.0) GB/s against raw 7.1 (5.5-7.4); 256 KiB 7.6 (7.5-7.7) against
10.1 (9.5-11.1), i.e. 0.75-0.83 of one core's per-page cma. Hence the reader threads.

Reader threads (``rma_readers``, ``DISAGG_UCX_RMA_READERS``; default 2 where the process
may run on 2 or more CPUs, else 1). A consumer reads a batch with ``rma_readers``
threads: its progress thread and ``rma_readers - 1`` reader lanes (``_ReadLane``, made on
the first RMA batch), each lane a thread with its own UCX worker on the plane's context,
its own endpoint to the producer and the producer's rkey unpacked on that endpoint (UCX
workers are single-threaded: a lane's worker, endpoints and keys are touched by its
thread only, and destroyed by it when the plane closes). The read list of a batch
(``ucx_rma.RmaShared``; a merged read longer than ``_RMA_MAX_READ`` is cut so a long run
is shared too) has one atomic cursor: every reader claims ``_RMA_SLICE`` bytes of reads
at a time in the C loop (``_ucxrma.pull``, GIL released), posts them, and progresses its
own worker until they completed before it claims more (cma queues a get and copies it
in a later progress call: a reader that claimed ahead of its copies would hold reads
the others could have taken; measured: without that wait the progress thread ran out
of reads to claim at +14 ms of a 1 MiB-page transfer while the lane copied its backlog
until +25 ms). So the list is shared out as it goes, whatever each reader's speed (a
core taken by something else just reads less), and ends within one slice on every
reader. Lanes claim until the list is exhausted; the progress thread at most
``_RMA_TURN`` bytes per loop turn (it still serves headers and acknowledgements), and
only after it has checked and handed out every header that arrived. A
batch under ``_RMA_SPLIT_MIN`` bytes per reader stays on the progress thread. Each
reader reports its share once it found nothing to claim and its reads completed
(``_rma_done``: the first failure kept, a failure moves the cursor to the end so the
others stop); the last one wakes the progress thread, which lands and acknowledges the
batch as before: a batch is acknowledged only once ALL its reads, on every worker,
completed. ``abort``/deadline: readers skip a batch whose transfer ended and stop
claiming its reads; ``abort`` still waits for the reads under way (``Rx.inflight`` is
released only after every reader finished). Close: the cursors are stopped, each lane
ends its share, destroys its keys, closes its endpoints and drops its worker, and is
joined before the progress thread's own teardown.

Measured, 2-core box, A/B back to back (``DISAGG_UCX_RMA_READERS=1`` for the old
behaviour; ``flock /tmp/bench.lock disagg bench transfer --transports ucx-shm
--page-sizes 16KiB,64KiB,256KiB,1MiB,4MiB --total 256MiB --repeats 5``, 5 pairs, ratio
of the row's memcpy ceiling, GB/s in brackets):

- 1 reader: 16 KiB 0.17-0.21 (2.2-2.9), 64 KiB 0.42-0.49 (5.6-7.0), 256 KiB 0.54-0.66
  (7.1-9.1), 1 MiB 0.65-0.94 (8.7-10.2), 4 MiB 0.55-1.01 (7.6-11.5)
- 2 readers: 16 KiB 0.25-0.35 (3.2-4.6), 64 KiB 0.58-0.71 (6.7-8.7), 256 KiB 0.66-0.86
  (8.8-10.7), 1 MiB 0.83-1.09 (11.1-13.6), 4 MiB 0.72-0.99 (9.6-13.8)

The plane's own view, same pages without the bench (/scratch/ucxshm/rb.py: 10 pulls of
256 MiB, time from the first header to the last read): 64 KiB 9.2-11.8 GB/s against
6.5-7.3 with one reader, 256 KiB 11.4-14.4 against 8.9-9.6, 1 MiB 13.8-14.5 against
10.0-10.8.

What limits it now (``perf record -e cpu-clock -a`` of a 64 KiB-page pull with 2
readers, /scratch/ucxshm/rb.py): the copies (``_copy_to_iter``) take ~45% of both
cores, the kernel's per-call cma work (pinning and unpinning the remote pages, the
ptrace access check) ~10%, UCX ~4%, Python ~14% (the consumer's progress loop and header
checks, ~1 ms per 2048-page batch, and the producer's planning), idle ~11% (mostly the
fixed part of a transfer: ~1.5 ms from go to the first header at 64 KiB, ~0.5 ms from
the last read to DONE through the acknowledgement and TransferDone). A plain C loop of
per-page ``process_vm_readv`` in two threads (/scratch/ucxshm/rawv.py) moves 64 KiB
pages at 12.1-14.3 GB/s, 256 KiB at 13-14.6, 16 KiB at 6.0-7.8 (16 pages per call: 9.8),
so per-page cma through UCX on both cores is within ~15% of what the medium gives;
what is left at 64-256 KiB is UCX's request per page, the Python around each batch, and
the fixed per-transfer round trips.

Batches of an RMA push (session 7). A timeline of both processes (/scratch/shm7/prof.py:
each stamps CLOCK_MONOTONIC events, 256 MiB of random 64 KiB rows into random slots)
showed where the fixed part went with version-1 headers (msgpack runs, batches of 2048
runs): the bench's go reached the producer after 0.4-0.6 ms, planning took 0.9 ms (0.56
of it building and encoding runs), the consumer started on the first header 1.7-2.2 ms
after go and spent ~0.9 ms on it (msgpack decode 0.15-0.3, run expansion 0.3, read
list 0.2-0.35) before the first read, at 2.6-3.6 ms; its second header cost the progress
thread another ~0.9 ms of not reading. Now (version 2) a header carries the slots and
rows as int64 arrays, so planning is a slice per batch (~0.2 ms for 4096 pages) and a
batch is checked from views of the header (~0.1 ms per 1000 pages plus ~0.2 ms fixed);
the push's first batch is ``_RMA_FIRST_PAGES`` pages, each next one ``_RMA_RAMP`` times
larger up to ``_RMA_MAX_PAGES`` (64 KiB pages: 64, 1024, 3008); and the progress thread
checks and hands out every header that has arrived before it takes its own reading
turn (``_rx_rma`` no longer reads; ``_rma_reap`` does), so a lane ends one batch and
finds the next one queued. Reads start 1.0-1.9 ms after go (of which ~0.5 ms is the
bench's pipe). The progress thread reads up to ``_RMA_TURN`` = 16 MiB per loop turn
(was 8). Measured, each knob against the defaults in one process pair, transfers
interleaved (prof.py ``CFGS``, 15-20 transfers each): on a loaded box (other helpers'
work) at 64 KiB 9.00 GB/s against 8.39 without the small first batch, 8.74 with 8 MiB
turns, 8.84 with a ramp of 4; on a quiet box every variant within 1-2% at 64 KiB-1 MiB
(a small first batch matters only while checking a header is slow). Three readers
instead of two (sweep of 3 rounds): 256 KiB 9.5-11.7 against 10.4-13.6, 64 KiB no
better. Version 1 against version 2 in alternating process pairs (prof.py, 20
transfers each): 64 KiB 9.32/10.36/9.60/9.60 GB/s against 10.56/10.40/11.81/10.66
(version 2 ahead in every round, ~+10%); 256 KiB 13.06/13.24/11.68/11.50/9.50 against
13.25/13.42/10.74/10.47/10.04 (no difference beyond the noise).
In the bench (``flock /tmp/bench.lock disagg bench transfer --transports ucx-shm
--page-sizes 64KiB,256KiB,1MiB --total 256MiB --repeats 5``, 8 pairs, A = version 1 in
a copy of the tree, B = this, alternating order; ratio of the row's memcpy ceiling,
range and median, GB/s median): 64 KiB A 0.53-0.66 (0.60, 7.7) B 0.54-0.78 (0.61,
8.2); 256 KiB A 0.49-0.96 (0.80, 10.4) B 0.64-0.84 (0.74, 9.5); 1 MiB A 0.80-1.10
(0.95, 11.7) B 0.81-1.20 (1.00, 13.3): no difference this box resolves in the bench
(its rows vary 1.5x between runs; 10 earlier pairs with 8 MiB turns and a 1 MiB first
batch likewise). One thing the bench adds that prof.py does not (a 64 KiB transfer
there takes ~32 ms against ~25 here): with ``OMP_NUM_THREADS=1`` in the bench's
environment, 2 runs each, 64 KiB went 0.59/0.54 -> 0.69/0.71 and 256 KiB 0.83/0.71 ->
0.83/0.91: torch's intra-op threads (the consumer checks each transfer with a torch
index of the pool) spin on this 2-core box while the reader threads copy.

What limits it now (``perf record -e cpu-clock -F 4999 -a -g`` over 2.5 s of 64 KiB
pulls, /scratch/shm7/perf.sh): ``_copy_to_iter`` 51% of both cores, idle 11% (the fixed
start and end of each transfer, and rb.py's checks between them), the kernel's per-call
cma work ~8% (``__get_user_pages``, ``unpin_user_pages``, the ptrace check, and BPF
hooks of this sandbox on every syscall), UCX ~4.5%, Python ~7%. Two threads copying at
once already share this box's memory bandwidth with each other (raw per-page
``process_vm_readv`` on 2 threads, 11.7 GB/s in the same session, is about one
memcpy), so reaching 0.9 of memcpy needs the per-page reads at raw speed with nothing
fixed around them: fewer calls (several pages per ``process_vm_readv``, which UCX's get
does not do for scattered remote rows) rather than less Python.

The three "What limits it now" notes above describe the get path, which since session 8
moves only stores that are not mapped (below).

Mapped stores (session 8; ``register_source``, ``ucx_rma.allocate``/``rkey_ptr``,
``_rma_mapped``/``_rma_copy``; ``DISAGG_UCX_MAPPED=0`` turns it off on both sides).
UCX maps a peer's memory into this process where its memory domain can (``sysv`` /
``posix``: ``ucp_rkey_ptr``, what UCX's own "rndv rkey_ptr" protocol uses), but only
for memory UCX allocated itself. So ``register_source`` (called by ``ProducerService``
and the bench for any plane that has it) copies a host store slab into memory from
``ucp_mem_map(ALLOCATE)`` (here sysv, 4 KiB pages: no hugetlb on this box) and returns a
tensor of the same shape and dtype over it; that registration is found by ``_rma_reg``
for every push from the slab (its rkey packed once, never evicted) and is freed only
once the plane closed and no tensor over it is left (``ucx_rma.release_when_unused``:
a finalizer holding the UCX context; nothing at interpreter exit, where UCX then warns
"destroying inuse region"). A consumer, after the batch's usual checks (the book's
slots, ``_rma_check``), asks ``ucp_rkey_ptr`` for the slab's local address (per key:
a failure, e.g. a store that is not UCX-allocated, is remembered and the batch read
with gets as before). UCX only adds an offset, it checks no bounds: the shared mapping
that holds the address is found once per key in /proc/self/maps, and every batch's
whole slab ``[base, base + (nrows - 1) * stride + width)`` must lie inside it, else
the transfer fails naming the range and nothing is read (nor fetched with gets). The
pages are then copied on the progress thread by ``_rowcopy`` (one memcpy per row and
column piece, non-temporal stores from 16 MiB, ``page_copy.HOST_THREADS`` threads from
``_MAPPED_THREADS_MIN`` bytes, GIL released), and the batch lands and is acknowledged
right after, exactly as a finished read (``_rma_finish``): the producer reuses no row
before the copy is complete, and ``abort`` waits for it (``Rx.inflight``). Nothing
goes to the reader lanes: the copy already uses every core (2 here; a lane would add
a wake-up, not a core), and the timeline below shows no gap worth filling. UCX
attaches the segment read-write: a consumer holding the key could write the producer's
store (this code only reads it), the same trust as cma, whose reads reach any of the
producer's memory.

First touches: a fresh mapping of the producer's store costs the consumer a page fault
per 4 KiB page, ~1.7 us each in this VM (/scratch/mapped/t3.py, 512 MiB: a copy
through a cold mapping 2.3 GB/s, through a populated one 13.0-14.1), which the bench's
random rows kept paying (each repeat draws half its rows from pages no earlier repeat
touched: timeline of 64 KiB transfers, ms per 256 MiB, repeat 0-7: 68, 42, 27, 21, 20,
21, 17, 17). So when a key is first mapped, a background thread (``_Populator``) maps
the segment's pages with ``madvise(MADV_POPULATE_READ)``, 32 MiB a call (~0.7 us a
page: 94 ms for 512 MiB), while the copies go on (a page they reach first just faults);
it stops when the key is destroyed. After: 89 (the first, populating), 21, 22, 22, 23,
22, 34, 22 ms in the same timeline on a busier box. What remains of a 64 KiB transfer
(/scratch/mapped/prof.py: go to DONE ~20-22 ms): the copies themselves (~19-20 ms at
13-14 GB/s, 3 batches of 64, 1024 and 3008 pages back to back, <1 ms between them),
~1 ms from go to the first header (the bench's pipe, planning), ~0.2 ms from the last
copy to DONE.

Measured (``flock /tmp/bench.lock disagg bench transfer --transports ucx-shm,ipc-shm
--page-sizes 64KiB,256KiB,1MiB --total 256MiB --repeats 5``, A/B back to back, B with
``DISAGG_UCX_MAPPED=0``, ratio of the row's memcpy ceiling, GB/s in brackets):

- mapped (A), 5 pairs (3 with A first, 2 with B first): 64 KiB 0.81-1.12 (median 0.98;
  10.9-15.6 GB/s, median 13.2), 256 KiB 1.16-1.33 (1.30; 13.3-18.0, 15.5), 1 MiB
  1.04-1.29 (1.18; 13.1-17.3, 14.5); ipc-shm in the same runs 1.10-1.23, 1.24-1.42,
  1.23-1.72.
- gets (B): 64 KiB 0.67-0.76 (median 0.73; 8.1-11.0 GB/s, median 9.5; one 1.31 against
  a 8.4 GB/s ceiling left out), 256 KiB 0.82-0.94 (0.89; 10.4-13.2, 11.9), 1 MiB
  0.73-0.97 (0.95; 9.9-13.7, 12.8).
- the populator's share (a copy of the tree with ``_Populator.start`` a no-op against
  this, ``--transports ucx-shm``, 2 pairs): 64 KiB 0.82/0.95 -> 1.18/0.91, 256 KiB
  0.93/0.93 -> 1.15/1.19, 1 MiB 1.10/1.17 -> 1.20/1.09.

What limits it now: the copy itself, at about what ``_rowcopy`` gives the ipc plane from
its /dev/shm store (both a memcpy per row on 2 threads with non-temporal stores; the
ratios above 1 are the ceiling's single plain memcpy); the low 64 KiB runs are those where
the box was busy (the same run's ipc row dropped too, or the populator still ran into
the timed repeats). Left: ~1 ms per transfer before the first copy (a 64 KiB transfer is
~20 ms), and 4 KiB source pages (no hugetlb here: ``UCX_SYSV_HUGETLB_MODE`` could give 2
MiB pages where the kernel has them, untried).

CUDA memory (``cuda=True``): regions may be CUDA tensors and source rows CUDA rows. A
sender with CUDA rows uses *whole* batches: the header goes under ``_HDR_WHOLE_TAG``
(the header tags are taken with one masked probe, so headers and TransferDone keep
their order) and the batch's payload follows as ONE message (up to ``BATCH_BYTES``),
its rows gathered with one batched ``index_select`` (``pages.gather_rows``), or sent in
place when they are one range; one stream sync per push. The receiver takes it with an
exact-tag probe right after accepting the header (the copy overlaps decoding the next
header), straight into the device rows when the batch is one run of a contiguous
region, else into one of ``_BIG_BUFS`` lazily allocated device scratch buffers per
device, scattered with one batched ``index_copy_`` per region (``pages.scatter_rows``)
on the plane's own stream. Scatters are not waited for one by one: an event per scatter
is polled, pages count as landed (and the scratch is reused, and ``abort`` stops
waiting) only once it has passed, and the thread syncs outstanding scatters before it
sleeps. While CUDA requests are in flight the thread keeps progressing instead of
sleeping on the event fd (UCX polls cuda_ipc completions; poll() cannot sleep < 1 ms).
Host rows into CUDA regions keep the segmented wire (device scratch of ``SEG_BYTES``).
Batch planning is vectorised (``_batches``: a Python step per batch, not per run).
UCX needs ``cuda_ipc`` (same node) and ``cuda_copy`` in ``UCX_TLS``: unset (all
transports) is right; an explicit list lacking them gets them added (without cuda_ipc
UCX stages device memory through host at ~0.5 GB/s, deps.md §8). Use worker-address
endpoints (``shm``/``auto``) so cuda_ipc is reachable. The progress thread makes the
device's context current before creating the UCX context. Checked on an H200 (tests
``test_cuda_*``, byte-exact; ``UCX_PROTO_INFO=y``: "rendezvous zero-copy flushed write
to remote, cuda_ipc/cuda"): bench ``ucx-cuda``, 1 GiB, 46/189/259 GB/s at 64 KiB/1 MiB/
4 MiB pages (was 11/20/40 at 256 MiB) against a ~2 TB/s D2D copy (0.02/0.10/0.13x). In
isolation on that GPU a 1 GiB gather runs at 1.66-1.81 TB/s and a 1 GiB ``index_copy_``
scatter at 1.67-1.79 TB/s (not the ~380 GB/s of deps.md §8), so each of gather, send and
scatter is roughly one D2D copy: ~0.33x is the ceiling of this pipeline, and the gap to
it is fixed per-transfer cost (~2 ms: 256 MiB of 4 MiB pages still takes 2.5 ms) and
Python per run (msgspec decode of tuples, ``accept_batch``: ~1 us a run, 16k runs at 64
KiB), not the copy engine.

Threads: one progress thread owns the worker and makes every UCX call; the caller's
threads only queue work and read state, so ``poll`` never blocks on the network. The
thread sleeps in ``poll()`` on the worker's event fd and a wake-up pipe whenever UCX has
nothing ready (blocking progress), also with data in flight (not while it has RMA reads
to claim or in flight: cma progresses only in worker progress). A consumer's reader
lanes ("Reader threads") each own one more worker and make every call on it; they hand
results back through ``_rma_done`` (under ``_rma_lock``) and the wake-up pipe.

Peer failures on shm (session 9; ``ucx_rma.guard_cma``, ``_ucxrma.c`` ``cma_handler``).
Why shm endpoints run without UCX error handling: with ``UCP_ERR_HANDLING_MODE_PEER``
UCX 1.21 selects no shared-memory lane at all. sysv and posix lack "peer failure"
(``ucx_info -d``: "error handling: ep_check"; only cma and tcp have it) and cma has no
active messages, so ``ucx_info -e -u rte`` shows a single ``tcp/lo`` lane (``-D shm``:
"no active messages transport ... sysv/memory - no peer failure handler"), and gets
become "software emulation, tcp/lo" (``UCX_PROTO_INFO=y``). Measured with PEER on both
shm endpoint sites (``disagg bench transfer --transports ucx-shm --page-sizes
64KiB,256KiB,1MiB --total 256MiB --repeats 5``): with ``DISAGG_UCX_MAPPED=0`` (gets)
0.64/0.43/0.69 GB/s (0.05/0.03/0.06 of memcpy) against 10.6-14.5 GB/s without; the
mapped store is unaffected (18.5/14.9/24.3 GB/s: ``ucp_rkey_ptr`` needs no lane), but
the get path is the one that needs the fix. Without error handling, a cma copy that
fails (``process_vm_readv`` of a producer killed mid-read: ESRCH) is "unhandled" in
UCP, and ``uct_cma_ep_tx_error`` logs it at FATAL, which UCS's default log handler turns
into abort(): the consumer died (SIGABRT, exit -6) in 7 of 15 timed kills
(``/scratch/flk/t.py`` on the get path). Everything else on that path is UCX's ordinary
error path (the scopy transport completes the get with UCS_ERR_IO_ERROR), so the plane
installs, once per process, a UCS log handler that takes exactly cma_ep.c's FATAL
messages (counted, printed, dispatch stopped): the read fails, the batch and its
transfer FAIL with "RMA read from <producer endpoint> failed: ucs_status -3
(UCS_ERR_IO_ERROR); latest cma failure here: process_vm_readv(pid=...) returned -1: No
such process", and the consumer serves the next transfer
(tests/transport/test_ucx_peer_death.py: a deterministic mid-read kill, 16 timed kills
with every consumer exiting 0, and the handler's scope: a FATAL message from any other
file still aborts). ``DISAGG_UCX_CMA_GUARD=0`` restores the abort (the deterministic
test then dies with -6, 3 of 3). The handler costs nothing on the hot path (UCS calls
it only for a message being logged); same bench, 2 A/B pairs each, guard on against
``DISAGG_UCX_CMA_GUARD=0``, GB/s at 64 KiB/256 KiB/1 MiB: gets 10.6-11.2/12.9-13.1/
14.5-14.6 against 10.4-12.1/13.3-16.4/14.1-14.3; mapped 14.8-15.5/14.4-17.3/18.0-19.7
against 14.6-16.0/17.4-17.9/20.0-23.0 (memcpy ceilings 11.8-14.4: within this box's
noise). A producer's pid reused by another process before
the consumer's read would be read without error; such pages could count as landed, but
the transfer can only FAIL (no TransferDone comes from a dead producer).
A batch whose transfer ended (failed, expired, aborted) while reads of it were under
way never holds the progress thread on the oldest batch (``_rma_reap`` takes a turn at
the oldest live batch and at every ended one, which only reaps), so a producer that
died or stopped with reads in flight cannot wedge the transfers of other producers
(tests/transport/test_ucx_peer_death.py: with the first batch's share made never to
complete, the next producer's transfer missed its deadline with 0 of 48 pages before,
lands byte-exact now). Every get on shm is "zero-copy, cma/memory" (``UCX_PROTO_INFO=y``,
0..inf; UCX splits it into 512 KiB ``process_vm_readv`` calls) and a failed cma copy
completes its request with an error (scopy's tx progress), so no request to a dead
producer was seen hanging; the "missed its deadline with 0 of 48 pages" failures under
load were the test's: its deadline ran from ``expect`` while the producer process was
still starting (stats: no RMA header accepted, ``rejected_late``). Under load a reader
lane can also make its endpoint only after the producer died: the transfer then fails
with "RMA reads from <producer> failed: UCXXShmemSegmentError" (its shm segment is
gone). Not done: a lane still waits for every request of its share of a batch before it
takes its next one (needs force-closing the endpoint to release requests that never
complete; none seen).

The mirror image, on the shm *tag* path (``DISAGG_UCX_RMA=0``; also without ``_ucxrma``,
but the guard lives there, so without it the abort stays): a contiguous payload message (a run of store
rows sent as a view, or a segment gathered into the send ring) is a rendezvous the
*producer* completes with ``process_vm_writev`` into the consumer's receive buffer, and a
consumer killed under it made UCX abort the producer (2 of 2 runs, fourth session). The
same file and call site log it (``uct_cma_ep_tx_error`` serves both directions), so the
guard takes it: ``ucp_ep_set_failed`` only flags that endpoint failed (error mode none:
nothing else is purged), the send completes with UCS_ERR_IO_ERROR, and the push FAILS at
once with "send to <consumer endpoint> failed: UCXXIOError: Input/output error; latest cma
failure here: process_vm_writev(pid=...) returned -1: No such process" (``_cma_note``);
the plane closes that endpoint (UCX logs "error during flush: Connection reset by remote
peer" at ERROR, not fatal) and the same producer serves new consumers byte-exact
(tests/transport/test_ucx_peer_death.py: the producer SIGSTOPped before the consumer's
first ready-to-receive, the consumer killed and reaped, the producer resumed, for view
and ring segments, producer aborted (-6) 4 of 4 with ``DISAGG_UCX_CMA_GUARD=0``; 16 timed
kills of consumers of one producer: 8 failed on the cma write, 5 at the deadline (killed
before a ready-to-receive was sent), 3 finished first; without the guard the producer
died at the third kill). iov sends of scattered rows on shm go through the sysv FIFO
(copy-in copy-out, no cma) and never met this.

Safety (same contract as ZmqDataPlane, enforced by the shared ``ReceiverBook``): every
slot of a batch is checked before any receive is posted (bounds, the slots the transfer
was promised, each once, page counts); only expected transfers with matching lease id
and token are accepted; ``abort`` fails the transfer, stops new receives for it, and
waits for the receives already matched to finish, so no byte of it is written afterwards.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from .. import hostmem
from ..pages import gather_rows, scatter_rows
from ..protocol import messages as m
from ..protocol.errors import ProtocolError
from . import page_copy, ucx_iov, ucx_rma
from .dataplane import (
    DataPlane,
    RegionSpec,
    RowsSource,
    StoreRows,
    TransferState,
    TransferStatus,
    check_store_rows,
    gather_pages,
)
from .receiver import BookedReceiver, Group, ReceiverBook, Rx, build_groups, runs_slots

# ucxx reads this at import. Caller-set values win.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

try:
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array
except Exception as exc:  # pragma: no cover - exercised only without ucxx
    raise ImportError(
        f"the UCX data plane needs ucxx (`pip install disagg[ucx]`, i.e. ucxx-cu12): {exc}"
    ) from exc

log = logging.getLogger(__name__)

SEG_BYTES = 16 << 20  # largest payload message: few large messages beat many small
# ... except over tcp, where packed segments are cut at TCP_SEG_BYTES when the receiver
# offers it (``_TCP_SEG_QUERY``; headers under ``_HDR_TCP_SEG_TAG``): the sender's gather
# into a 2 MiB send buffer and the kernel's copy out of it, and the kernel's copy into a
# 2 MiB scratch and the scatter out of it, then meet in cache ("Segments over tcp")
TCP_SEG_BYTES = 2 << 20
# Runs at least this big go zero-copy into the rows; smaller ones are packed into segments.
# Measured over tcp on the 2-core box: 256 KiB pages each sent as its own message moved
# 2.3-2.4 GB/s, packed 3.1-3.2 GB/s (the extra receive-side copy costs less than a
# message per page); from 1 MiB, direct wins.
DIRECT_MIN = 1 << 20
# ... except to a tcp receiver that takes packed segments as iov receives (no copy
# either way): there only runs longer than a segment go alone, so 1 MiB pages travel
# two to a message. In one process pair, 1 MiB pages, 3 invocations of 8 transfers:
# +16/+14/+22% (medians 3.97/3.48/3.80 -> 4.61/3.97/4.63 GB/s; raw TCP 3.57-3.99)
TCP_PACK_DIRECT_MIN = TCP_SEG_BYTES + 1
# ... except over shared memory, where every run is packed (see "Shared memory" above)
SHM_DIRECT_MIN = 1 << 62
RUNS_PER_BATCH = 2048  # keeps headers ~<32 KiB
BATCH_BYTES = 256 << 20
_SCRATCH_BUFS = 4  # scratch segments in flight at once (each SEG_BYTES)
# Send ring: gathered segments in flight at once, per plane (each SEG_BYTES, huge pages,
# prefaulted once). Per plane, not per peer, so memory stays bounded (64 MiB) whatever
# the fan-out; one progress thread gathers them all, and 4 segments in flight cover
# more than a link's bandwidth-delay (the receiver takes 4 at a time too). A push that
# finds the ring taken and has no send of its own in flight gets a one-off buffer
# (``_ring_take``), so a peer that stopped reading cannot stall pushes to other peers.
_SEND_BUFS = 4
_HDR_TAG = 1  # header of a batch whose payload follows in segments (host rows)
_HDR_WHOLE_TAG = 2  # header of a batch whose payload follows as one message (CUDA rows)
# header of a host batch cut with DIRECT_MIN on shm (the receiver's endpoint said its
# rows are huge pages: "Shared memory"), so the receiver cuts it the same way
_HDR_DIRECT_TAG = 3
# header of a host batch cut into TCP_SEG_BYTES segments (the receiver's tcp endpoint
# offered it), so the receiver cuts it the same way
_HDR_TCP_SEG_TAG = 4
# header of a host batch cut into TCP_SEG_BYTES segments with every run up to
# TCP_SEG_BYTES packed (TCP_PACK_DIRECT_MIN; the receiver's endpoint said _TCP_IOV_RX_QUERY)
_HDR_TCP_PACK_TAG = 5
_HDR_MASK_TAGS = 7  # the header tags are probed with one mask, so they stay in order
# the runs a header's tag says were sent alone (else the receiver's channel's own)
_HDR_DIRECT_MIN = {_HDR_DIRECT_TAG: DIRECT_MIN, _HDR_TCP_PACK_TAG: TCP_PACK_DIRECT_MIN}
_TCP_SEG_QUERY = "seg=2m"  # on a ucx+tcp endpoint: headers under _HDR_TCP_SEG_TAG are cut
# on a ucx+tcp endpoint: this receiver's UCX takes tcp segments of TCP_SEG_BYTES or more
# (TCP_HARDENING, or an operator's UCX_TCP_RX_SEG_SIZE). A sender with larger than UCX's
# default send segments sends active-message fragments that big, which a receiver with
# UCX's 8 KiB segments never takes (its pushes would only miss their deadline): it
# refuses an endpoint without this at once ("Exposure").
_TCP_AM_QUERY = "tcpam=1"
# on a ucx+tcp endpoint: this receiver takes packed segments for every group as iov
# receives straight into the slots (``tcp_iov_recvs``, host regions only), so a packed
# run costs it no copy and a sender packs runs up to TCP_SEG_BYTES (headers under
# _HDR_TCP_PACK_TAG) instead of sending each run of DIRECT_MIN+ as its own message
_TCP_IOV_RX_QUERY = "iovrx=1"
_SHM_DIRECT_QUERY = "direct=1"  # on a ucx+shm endpoint: runs may land in the rows
# header of a batch whose pages the receiver reads itself (one-sided, ``ucp_get_nbx``
# from the sender's registered store rows: "RMA"); in the header mask, so in order
_HDR_RMA_TAG = 0
# on an endpoint: the receiver reads StoreRows batches itself, from headers of this
# version ("rma=1" was version 1: a producer that knows only one of the two versions
# sends that receiver tag messages instead, so mismatched peers still work)
_RMA_QUERY = "rma=2"
_RMA_VERSION = 2
_RMA_MAGIC = b"RMA2"  # b"RMA" + the version digit: a header of another version is refused
# pages per RMA batch (16 bytes each in the header, slot + row: 64 KiB); the first batch
# of a push is _RMA_FIRST_PAGES pages and each next one _RMA_RAMP times the one before,
# so the consumer starts reading a small batch while it checks the larger ones (what a
# batch costs the consumer to check grows with its pages, not its bytes: "Batches of an
# RMA push" in the module docstring)
_RMA_MAX_PAGES = 4096
_RMA_FIRST_PAGES = 64
_RMA_RAMP = 16
_RMA_REGS = 8  # producer: store slabs kept registered (least recently used ones unmapped)
_RMA_RKEYS = 64  # consumer: unpacked remote keys kept
_RMA_ROUNDS = 64  # worker progress calls per loop turn while reads are in flight
# Reader threads ("Reader threads" in the module docstring): the readers of a batch claim
# its reads about _RMA_SLICE bytes at a time from a shared cursor; a merged read longer
# than _RMA_MAX_READ is cut (so one long run is shared too); the progress thread posts
# at most _RMA_TURN bytes per loop turn (it has headers and acknowledgements to serve);
# a batch smaller than _RMA_SPLIT_MIN per reader is read by the progress thread alone
# (waking a lane costs more than it saves)
_RMA_SLICE = 256 << 10
_RMA_MAX_READ = 2 << 20
_RMA_TURN = 16 << 20
_RMA_SPLIT_MIN = 256 << 10
_RMA_READERS_ENV = "DISAGG_UCX_RMA_READERS"
# The mapped path ("Mapped stores"): ``0`` turns it off on both sides (register_source
# keeps the store where it is; a consumer never maps a producer's memory)
_MAPPED_ENV = "DISAGG_UCX_MAPPED"
# tcp senders: ``1``/``0`` forces scatter-gather sends of store rows on or off (default:
# on where the context has large tcp segments, ``tcp_large_segments``)
_TCP_IOV_ENV = "DISAGG_UCX_TCP_IOV"
# tcp receivers: ``1``/``0`` forces scatter-gather receives of packed segments into host
# slots on or off (default: on where the context has large tcp segments)
_TCP_IOV_RECV_ENV = "DISAGG_UCX_TCP_IOV_RECV"
_MAPPED_THREADS_MIN = 8 << 20  # a mapped copy this big uses HOST_THREADS threads
_POPULATE_CHUNK = 32 << 20  # a mapped segment's pages are mapped ahead this much a call
# acknowledgement of an RMA batch, consumer -> producer: bit 62 set, top bit clear (not a
# data tag, not a header tag), 62 bits of a keyed hash like the data tags
_ACK_BIT = 1 << 62
_BIG_BUFS = 2  # whole-batch device scratch buffers per device (receive k+1, scatter k)
_BIG_ALIGN = 2 << 20
_HDR_MAX = 1 << 20
_IDLE_WAIT_S = 0.05
_BUSY_WAIT_S = 0.002  # safety net only: UCX signals the event fd when work arrives
_DATA_BIT = 1 << 63
_U64 = (1 << 64) - 1
_ABORT_WAIT_S = 5.0


def _tag_key(token: bytes) -> bytes:
    return token if len(token) <= 64 else hashlib.blake2b(token).digest()


def _data_tag(key: bytes, transfer_id: int, seq: int) -> int:
    """The tag of segment ``seq`` of a transfer: top bit set, 63 bits of a keyed hash
    (BLAKE2b keyed with the transfer's token, ``_tag_key``) of (transfer id, seq). Only
    the consumer and the producer it authenticated know the token, so nobody else can
    name a segment the receiver is waiting for, even knowing endpoint and transfer id."""
    msg = struct.pack("<QQ", transfer_id & _U64, seq & _U64)
    digest = hashlib.blake2b(msg, key=key, digest_size=8).digest()
    return _DATA_BIT | (int.from_bytes(digest, "little") & (_DATA_BIT - 1))


def _ack_tag(key: bytes, transfer_id: int, batch: int) -> int:
    """The tag of the consumer's acknowledgement of RMA batch ``batch`` of a transfer
    (keyed like ``_data_tag``, so only the consumer holding the token can name it: a
    forged acknowledgement could make the producer release rows still being read)."""
    msg = struct.pack("<QQQ", transfer_id & _U64, batch & _U64, 0xAC4)
    digest = hashlib.blake2b(msg, key=key, digest_size=8).digest()
    return _ACK_BIT | (int.from_bytes(digest, "little") & (_ACK_BIT - 1))


@dataclass(frozen=True)
class Segment:
    """One payload message: ``runs`` of (dst_start, count), ``first`` = index of its
    first page within the batch; ``direct`` when it is a single big run."""

    runs: tuple[tuple[int, int], ...]
    first: int
    pages: int
    direct: bool


def segments(
    runs: Sequence[tuple[int, int]],
    page_bytes: int,
    direct_min: int = DIRECT_MIN,
    seg_bytes: int = SEG_BYTES,
) -> list[Segment]:
    """Cut a batch's runs into payload messages of at most ``seg_bytes`` (or one page)
    each (both sides call this on the header, with the channel's ``direct_min``:
    ``DIRECT_MIN``, or ``SHM_DIRECT_MIN`` on shm; and ``seg_bytes``: ``SEG_BYTES``, or
    ``TCP_SEG_BYTES`` for a header under ``_HDR_TCP_SEG_TAG``)."""
    out: list[Segment] = []
    per_seg = max(1, seg_bytes // page_bytes)
    packed: list[tuple[int, int]] = []
    packed_first = packed_pages = 0
    page = 0

    def flush() -> None:
        nonlocal packed, packed_pages
        if packed:
            out.append(Segment(tuple(packed), packed_first, packed_pages, False))
        packed, packed_pages = [], 0

    for start, count in runs:
        if count * page_bytes >= direct_min:
            flush()
            done = 0
            while done < count:
                take = min(per_seg, count - done)
                out.append(Segment(((start + done, take),), page + done, take, True))
                done += take
        else:
            if packed_pages + count > per_seg:
                flush()
            done = 0
            while count - done > per_seg:  # a long run (shm packs them too): full pieces
                out.append(Segment(((start + done, per_seg),), page + done, per_seg, False))
                done += per_seg
            if not packed:
                packed_first = page + done
            packed.append((start + done, count - done))
            packed_pages += count - done
        page += count
    flush()
    return out


# UCX's default rendezvous collapses to ~0.5 GB/s over tcp with ucxx (deps.md pitfall
# 1): every plane's context names its scheme (not the environment, which child processes
# would inherit as if an operator had set it). A tcp plane's protocol does without
# the tcp put ("Exposure"): UCX's tcp transport refuses peers' puts, large messages go by
# active-message rendezvous, in 2 MiB socket segments (8 KiB ones hold that scheme at
# ~1 GB/s: docs/perf/ucx-tcp-env-sweep-session7).
RNDV_SCHEME = "put_zcopy"
TCP_HARDENING = {
    "TCP_PUT_ENABLE": "n",
    "RNDV_SCHEME": "am",
    "TCP_TX_SEG_SIZE": "2m",
    "TCP_RX_SEG_SIZE": "2m",
}
# ... and, unless the operator set it, up to 64 iov entries per tcp writev (UCX's default
# 6): an iov send of scattered store rows ("Scatter-gather sends over tcp") then writes
# ~60 rows per call (in-pair, 256 KiB pages: +5-13%; 64 KiB: no change). Not part of the
# protocol: either side may set it alone.
TCP_TUNING = {"TCP_MAX_IOV": "64"}


def _exposure_config(channel: str, bind_host: str | None) -> dict[str, str]:
    """Per-plane UCX settings (the context's ``config_dict``) that keep its tcp transport
    off networks it was not asked to serve and refuse peers' writes ("Exposure" in the
    module docstring). UCX's tcp transport accepts one-sided writes (its put, which its
    put rendezvous uses for every large message) at any address of the process from any
    peer that can reach its sockets, registered memory or not, and every worker opens
    such a socket on every network device. So: ``shm`` planes load no tcp transport at
    all (they need none: worker-address endpoints on one host), ``tcp`` planes only on
    the device that owns their bind address (loopback by default), and turn the put off
    (``TCP_HARDENING``), CUDA planes too: whether a process has CUDA (``cuda=None``
    follows torch) must not change its wire protocol, and across hosts UCX moves device
    memory through host staging under either scheme (one GPU's processes use ``shm`` or
    ``auto``: cuda_ipc puts, kept). An operator's own ``UCX_TLS`` / ``UCX_NET_DEVICES`` win,
    and any of ``TCP_HARDENING``'s settings in the environment means the operator chose
    the protocol: none of them is set here then (no mix of theirs and ours can run the
    put rendezvous with the put refused: 0.14-0.35 of raw TCP)."""
    out: dict[str, str] = {}
    operator_protocol = any(f"UCX_{k}" in os.environ for k in TCP_HARDENING)
    if not operator_protocol:
        out["RNDV_SCHEME"] = RNDV_SCHEME
    if channel == "shm" and not os.environ.get("UCX_TLS"):
        out["TLS"] = "^tcp"
    if channel == "tcp":
        if not os.environ.get("UCX_NET_DEVICES"):
            device = _net_device(bind_host or "127.0.0.1")
            if device is not None:
                out["NET_DEVICES"] = device
        if not operator_protocol:
            out.update(TCP_HARDENING)
        out.update({k: v for k, v in TCP_TUNING.items() if f"UCX_{k}" not in os.environ})
    return out


def _ucx_setting(name: str, config: Mapping[str, str]) -> str | None:
    """The value UCX takes for its setting ``name`` (without ``UCX_``) in a context made
    with ``config`` as its config dict: the dict's (``ucp_config_modify`` is applied after
    the environment is read) else the ``UCX_<name>`` environment variable, else None."""
    if name in config:
        return config[name]
    return os.environ.get("UCX_" + name)


def _ucx_bytes(text: str | None) -> int | None:
    """A UCX memory-units value (``2m``, ``2M``, ``2MB``, ``65536``, ``inf``) in bytes;
    None when absent or unreadable."""
    if text is None:
        return None
    t = text.strip().lower().removesuffix("b")
    if t in ("inf", "infinity", "auto"):
        return None if t == "auto" else 1 << 62
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        return int(float(t) * scale)
    except ValueError:
        return None


UCX_TCP_SEG_DEFAULT = 8 << 10  # UCX 1.21's tcp TX/RX_SEG_SIZE


def _tcp_seg(name: str, config: Mapping[str, str]) -> int:
    """UCX's tcp segment setting ``name`` (``TCP_TX_SEG_SIZE`` / ``TCP_RX_SEG_SIZE``) in a
    context made with ``config``, in bytes."""
    return _ucx_bytes(_ucx_setting(name, config)) or UCX_TCP_SEG_DEFAULT


def tcp_large_segments(config: Mapping[str, str]) -> bool:
    """Whether a UCX context made with ``config`` (its config dict; the environment fills
    in the rest) sends large tcp messages as active messages in large segments: the
    rendezvous scheme ``am`` and a tcp send segment (``TCP_TX_SEG_SIZE``) of at least
    ``TCP_SEG_BYTES``. That is the hardened tcp setting ("Exposure": ``UCX_TCP_PUT_ENABLE
    =n UCX_RNDV_SCHEME=am UCX_TCP_TX_SEG_SIZE=2m UCX_TCP_RX_SEG_SIZE=2m``), under which
    UCX 1.21 sends an iov message's rendezvous data zero-copy from the iov
    (``UCX_PROTO_INFO``: "rendezvous data send from iov[32] ... zero-copy"); with the
    defaults (put rendezvous, or 8 KiB segments) it is "fragmented copy-in copy-out"."""
    if (_ucx_setting("RNDV_SCHEME", config) or "").strip().lower() != "am":
        return False
    seg = _ucx_bytes(_ucx_setting("TCP_TX_SEG_SIZE", config))
    return seg is not None and seg >= TCP_SEG_BYTES


def _switch_or_large_segments(env: str, config: Mapping[str, str]) -> bool:
    """``env`` (``1``/``0``) when set, else ``tcp_large_segments(config)``."""
    forced = os.environ.get(env, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return tcp_large_segments(config)


def tcp_iov_default(config: Mapping[str, str]) -> bool:
    """Whether a tcp plane whose UCX context was made with ``config`` sends scattered
    StoreRows segments as iov messages (else gathers them into the send ring):
    ``DISAGG_UCX_TCP_IOV`` ``1``/``0`` when set, else ``tcp_large_segments(config)``.
    ``ucx_iov`` must also be available (``DISAGG_UCX_IOV=0`` turns it off everywhere)."""
    return _switch_or_large_segments(_TCP_IOV_ENV, config)


def tcp_iov_recv_default(config: Mapping[str, str]) -> bool:
    """Whether a tcp plane whose UCX context was made with ``config`` receives packed
    segments for host slots as iov messages straight into the slots (else into scratch,
    then the C row copy): ``DISAGG_UCX_TCP_IOV_RECV`` ``1``/``0`` when set, else
    ``tcp_large_segments(config)`` (the hardened setting, where UCX unpacks each fragment
    into the posted iov: "rendezvous data fetch into iov[32] ... zero-copy"). Safe by
    default since ``abort`` severs the producers' connections when such receives outlive
    its wait ("Severing"): a stalled producer that resumes cannot reach reused slots."""
    return _switch_or_large_segments(_TCP_IOV_RECV_ENV, config)


def _net_device(host: str) -> str | None:
    """The network device that owns IPv4 ``host`` (a name or address): ``lo`` for
    loopback. None for a wildcard bind (every device, as asked) or an address no device
    here holds (then UCX keeps its default, every device, and a warning says so)."""
    if host in ("", "*", "0.0.0.0", "::", "[::]"):
        return None
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = ""
    if addr.startswith("127."):
        return "lo"
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sk:
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(sk.fileno(), _SIOCGIFADDR, req)
            except OSError:  # no IPv4 address on that device
                continue
        if addr and socket.inet_ntoa(got[20:24]) == addr:
            return name
    log.warning(
        "UCX tcp plane bound to %s: no network device here holds that IPv4 address, so "
        "UCX's tcp transport serves every device (set UCX_NET_DEVICES to restrict it)",
        host,
    )
    return None


_SIOCGIFADDR = 0x8915


def _cuda_env() -> None:
    """UCX must be allowed cuda_ipc (same node) and cuda_copy, or it stages CUDA memory
    through host buffers at ~0.5 GB/s (deps.md §8). Unset ``UCX_TLS`` (all transports)
    includes them; an explicit list without them gets them added."""
    tls = os.environ.get("UCX_TLS")
    if not tls or tls.startswith("^") or tls == "all":
        return
    names = [t.strip() for t in tls.split(",") if t.strip()]
    missing = [t for t in ("cuda_ipc", "cuda_copy") if t not in names and "cuda" not in names]
    if missing:
        os.environ["UCX_TLS"] = ",".join(names + missing)
        log.info("UCX_TLS=%s lacked %s for CUDA memory: added", tls, ",".join(missing))


def _arange(n: int) -> np.ndarray:
    """``0 .. n-1`` as int64 (the packed side of a row copy), read-only and shared."""
    if n > _ARANGE.shape[0]:
        return np.arange(n, dtype=np.int64)
    return _ARANGE[:n]


_ARANGE = np.arange(SEG_BYTES // 4096 + 1, dtype=np.int64)
_ARANGE.flags.writeable = False


def _scatter_host(grp: Group, seg: Segment, packed: np.ndarray) -> None:
    """Land a segment received into host scratch (``packed``: its pages back to back)
    in its slots: a group of one contiguous host region with the C row copy where it
    is built (one memcpy per page, GIL released, every slot checked against the region
    again; "Segments over tcp"), else ``Group.scatter`` (numpy)."""
    pb = grp.page_bytes
    src = packed.reshape(seg.pages, pb)
    slots = runs_slots(seg.runs)
    rc = page_copy._rowcopy
    d = grp.direct
    if rc is not None and d is not None:
        d2 = d.reshape(d.shape[0], -1)
        if d2.shape[1] == pb and d2.strides[1] == 1:
            rc.copy_rows(
                d2.ctypes.data, int(d2.shape[0]), int(d2.strides[0]), src.ctypes.data,
                seg.pages, pb, pb, _arange(seg.pages), slots.astype(np.int64, copy=False), 1,
            )  # fmt: skip
            return
    grp.scatter(slots, src)


def _frame(msg: m.Message) -> np.ndarray:
    body = m.encode(msg)
    return np.frombuffer(struct.pack("<I", len(body)) + body, dtype=np.uint8)


# ================================== receiver state =====================================
@dataclass
class _UcxRx(Rx):
    seq: int = 0  # next segment sequence number
    queued: int = 0  # segments announced, receive not yet posted


@dataclass
class _PendingSeg:
    """A segment announced by an accepted header, waiting for its message to arrive;
    ``whole``: the batch's entire payload in one message (any size, CUDA senders)."""

    rx: _UcxRx
    group: int
    tag: int
    seg: Segment
    nbytes: int
    whole: bool = False
    slots: np.ndarray | None = None  # destination slot of each page (whole batches)
    # its pages' (address, length) entries in the slots, when it is to be received as
    # an iov straight into them (``_rx_iov``), and the group whose memory they name
    iov: np.ndarray | None = None
    owner: Any = None


@dataclass
class _Scatter:
    """A device scatter launched from scratch on the plane's stream, not yet finished:
    its pages count as landed (and the scratch is reused) once ``event`` has passed."""

    event: Any
    p: _PendingSeg
    scratch: torch.Tensor
    pool: list[torch.Tensor]


def default_rma_readers() -> int:
    """How many threads copy an RMA batch on the consumer (the progress thread plus
    ``n - 1`` lanes, each with its own UCX worker): ``DISAGG_UCX_RMA_READERS`` when set
    (an integer >= 1), else 2 where this process may run on 2 or more CPUs, 1 otherwise
    (module docstring, "Reader threads")."""
    raw = os.environ.get(_RMA_READERS_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{_RMA_READERS_ENV} must be an integer >= 1, not {raw!r}")
        return n
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return 2 if cpus >= 2 else 1


@dataclass(eq=False)
class _RmaRead:
    """An accepted RMA batch whose reads are in flight: its pages land (and the
    producer is told, under ``ack_tag`` on ``ep``) once every reader that took part
    (``left`` of them still reading: the progress thread and, for a split batch, every
    lane) found nothing left to claim and its own reads completed. ``shared``: the read
    list and its cursor; ``mine``: the progress thread's share (None once finished).
    ``left``, ``error`` (the first failure) and ``posted`` change under the plane's
    ``_rma_lock``."""

    rx: _UcxRx
    group: int
    pages: int
    nbytes: int
    ack_tag: int
    ep: Any
    endpoint: str
    packed: bytes  # the producer's packed key: lanes unpack it on their own endpoints
    shared: ucx_rma.RmaShared
    left: int
    mine: ucx_rma.RmaPull | None = None
    error: str | None = None
    posted: int = 0


def _cma_note(seen: int) -> str:
    """The latest cma failure this process took (``ucx_rma.guard_cma``: a peer that died
    during a cma copy), as a note for a failed send's error text, if one was taken after
    ``seen`` (the count when the push started); else "". On the shm tag path the
    producer writes rendezvous payloads with ``process_vm_writev``: a consumer killed
    under it fails the send with UCS_ERR_IO_ERROR, and this names the call, the
    consumer's pid and errno."""
    n, last = ucx_rma.cma_failures()
    return f"; latest cma failure here: {last}" if n > seen and last else ""


def _pull_error(endpoint: str, pull: ucx_rma.RmaPull) -> str | None:
    """The failure of a reader's finished share, or None when all of it landed. A cma
    copy that failed (the producer died or unmapped its store: ``ucx_rma.guard_cma``)
    ends as UCS_ERR_IO_ERROR; the latest such failure's text (it names the call, the
    producer's pid and errno) is appended."""
    if pull.ok:
        return None
    why = f"RMA read from {endpoint} failed: {ucx_rma.status_text(pull.status)}"
    n, last = ucx_rma.cma_failures()
    if n and last:
        why += f"; latest cma failure here: {last}"
    return why


class _ReadLane:
    """A reader thread of the consumer with its own UCX worker on the plane's context
    ("Reader threads" in the module docstring): takes the split batches the progress
    thread hands it (``submit``), in order, and claims and reads their reads alongside
    the other readers (``ucx_rma.RmaPull``: the C loop, GIL released) through its own
    endpoint to the producer and a remote key unpacked on it (both cached like the
    progress thread's), then reports its share (``done``). Its worker, endpoints and
    keys are only ever touched by its thread (UCX workers are single-threaded);
    ``close`` stops it, and the thread destroys its keys, closes its endpoints and drops
    its worker before it ends."""

    def __init__(
        self,
        ctx: Any,
        done: Callable[[_RmaRead, int, str | None], None],
        stats: Counter[str],
        index: int,
    ) -> None:
        self._ctx = ctx
        self._done = done
        self._stats = stats
        self._todo: deque[_RmaRead] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"disagg-ucx-read{index}", daemon=True
        )
        self._thread.start()
        self._ready.wait(30.0)
        if self._error is not None or not self._ready.is_set():
            self.close()
            raise RuntimeError(f"UCX reader thread failed to start: {self._error}")

    def submit(self, read: _RmaRead) -> None:
        """Take part in ``read`` (its ``left`` counts this lane)."""
        with self._cond:
            self._todo.append(read)
            self._cond.notify()

    def close(self) -> None:
        """Stop (stop the batches' cursors first: a share under way ends with its
        slice) and wait for the thread; batches it never took are reported skipped."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(10.0)
        if self._thread.is_alive():
            log.warning("UCX reader thread did not end within 10 s")
        while self._todo:
            self._done(self._todo.popleft(), 0, "data plane closed")

    def _run(self) -> None:
        try:
            worker = ucx_api.UCXWorker(self._ctx)
        except BaseException as exc:  # reported to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        eps: dict[str, Any] = {}
        dead: list[Any] = []
        rkeys: dict[tuple[str, bytes], tuple[Any, int]] = {}
        try:
            while True:
                with self._cond:
                    while not self._todo and not self._stop:
                        self._cond.wait(_IDLE_WAIT_S)
                    if self._stop:
                        return
                    read = self._todo.popleft()
                posted, error = self._read(worker, eps, dead, rkeys, read)
                self._done(read, posted, error)
        except Exception:
            log.exception("UCX reader thread died")
        finally:
            for key in list(rkeys):
                ucx_rma.destroy(rkeys.pop(key)[1])
                self._stats["rma_lane_rkey_destroy"] += 1
            for ep in list(eps.values()) + dead:
                try:
                    if ep.alive:
                        ep.close()
                except Exception:
                    pass
            try:
                worker.progress()
            except Exception:
                pass
            eps.clear()
            dead.clear()
            del worker

    def _read(
        self,
        worker: Any,
        eps: dict[str, Any],
        dead: list[Any],
        rkeys: dict[tuple[str, bytes], tuple[Any, int]],
        read: _RmaRead,
    ) -> tuple[int, str | None]:
        """This lane's share of ``read``: (reads posted, failure or None). Nothing to
        do when every read was claimed already, the batch failed, or its transfer
        ended (aborted, expired: nothing would count its pages)."""
        sh = read.shared
        if sh.claimed or read.error is not None or read.rx.state.final:
            return 0, None
        try:
            ep = eps.get(read.endpoint)
            if ep is None or not ep.alive:
                if ep is not None:
                    dead.append(ep)
                    for k in [k for k, (e, _) in rkeys.items() if e is ep]:
                        ucx_rma.destroy(rkeys.pop(k)[1])
                        self._stats["rma_lane_rkey_destroy"] += 1
                u = urlsplit(read.endpoint)
                addr = ucx_api.UCXAddress.create_from_buffer(
                    bytes.fromhex(u.netloc or u.path.lstrip("/"))
                )
                ep = ucx_api.UCXEndpoint.create_from_worker_address(worker, addr, False)
                eps[read.endpoint] = ep
            key = (read.endpoint, read.packed)
            got = rkeys.get(key)
            if got is None:
                if len(rkeys) >= _RMA_RKEYS:
                    for k in list(rkeys)[:8]:
                        ucx_rma.destroy(rkeys.pop(k)[1])
                        self._stats["rma_lane_rkey_destroy"] += 1
                got = (ep, ucx_rma.unpack(ep.handle, read.packed))
                self._stats["rma_lane_rkey_unpack"] += 1
                rkeys[key] = got
            pull = ucx_rma.RmaPull(sh, ep.handle, got[1])
            wh = worker.handle
            pull.step(wh)
            while pull.drive(wh, _RMA_ROUNDS):
                if self._stop:
                    log.warning("closing with %d RMA reads still in flight", pull.left)
                    return pull.posted, "data plane closed"
        except Exception as exc:
            sh.stop()
            return 0, f"RMA reads from {read.endpoint} failed: {type(exc).__name__}: {exc}"
        self._stats["rma_lane_reads"] += pull.posted
        return pull.posted, _pull_error(read.endpoint, pull)


class _Populator:
    """Maps the pages of producers' mapped segments into this process ahead of the
    copies, on a background thread, ``_POPULATE_CHUNK`` bytes per ``madvise`` call
    (``ucx_rma.populate``; "Mapped stores": a first touch of each 4 KiB page of a fresh
    mapping costs ~1.7 us here, a populate ~0.7 us, and without it the copies ran at
    2.3 GB/s through a fresh 512 MiB mapping). Copies do not wait for it: a page they
    reach first simply faults. ``cancel`` (before the key that holds the mapping is
    destroyed) returns only once no call on that range is under way."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held during each madvise call
        self._jobs: dict[Any, list[int]] = {}  # key -> [next address, end]
        self._thread: threading.Thread | None = None
        self.populated = 0  # bytes

    def start(self, key: Any, start: int, end: int) -> None:
        with self._lock:
            self._jobs[key] = [start, end]
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="disagg-ucx-populate", daemon=True
                )
                self._thread.start()

    def cancel(self, key: Any) -> None:
        with self._lock:
            self._jobs.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                key, job = next(iter(self._jobs.items()))
                at, end = job
                stop = min(end, at + _POPULATE_CHUNK)
                err = ucx_rma.populate(at, stop)
                if err or stop >= end:
                    del self._jobs[key]
                    if err:
                        log.debug("populating a mapped store: errno %d (left to faults)", err)
                else:
                    job[0] = stop
                self.populated += stop - at
            time.sleep(0)  # let the copies' thread take the GIL between chunks


class _MappedRangeError(ValueError):
    """An RMA batch whose slab lies (partly) outside the producer's mapped segment."""


def _mapped_copy(
    grp: Group, hdr: RmaHeader, ptr: int, pieces: list[tuple[int, int, int, int]]
) -> None:
    """Copy a batch's pages from the producer's slab mapped at ``ptr`` (rows and
    columns checked against the slab, the slab against the mapping) into its slots of
    ``grp`` (checked by the book): per piece (a column span of the row into one region,
    ``ucx_rma.page_pieces``) one C row copy (``_rowcopy``, which checks every index
    against its side's rows again), else ``page_copy.copy_indexed`` on views."""
    rows, slots = hdr.rows, hdr.slots
    nbytes = int(slots.size) * hdr.page_bytes
    rc = page_copy._rowcopy
    threads = 1
    if nbytes >= _MAPPED_THREADS_MIN:
        threads = min(page_copy.HOST_THREADS, len(os.sched_getaffinity(0)))
    for soff, reg, doff, plen in pieces:
        dst = grp.regions[reg].tensor
        if rc is not None:
            rc.copy_rows(
                dst.data_ptr() + doff, dst.shape[0], dst.stride(0),
                ptr + soff, hdr.nrows, hdr.stride, plen, rows, slots, threads,
            )  # fmt: skip
            continue
        span = (hdr.nrows - 1) * hdr.stride + plen
        flat = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(ptr + soff))
        src = np.lib.stride_tricks.as_strided(flat, (hdr.nrows, plen), (hdr.stride, 1))
        page_copy.copy_indexed(
            dst[:, doff : doff + plen],
            torch.from_numpy(slots.copy()),
            torch.from_numpy(src),
            torch.from_numpy(rows.copy()),
        )


# Version 2 (``_RMA_MAGIC``): the batch's identity and source description in a fixed
# block, then token, packed rkey, producer endpoint, column spans, and the destination
# slot and slab row of every page as little-endian int64 arrays (no msgpack: its runs
# cost ~0.5 ms per 2048 pages to build, encode, decode and expand, "Batches of an RMA
# push"). Version 1 (``b"RMA1"``: a 44-byte block, a msgpack PageBatch, ...) shared only
# the 4-byte magic's place: ``_rma_refuse`` recognises it by that.
_RMA_FIXED = struct.Struct("<4sQQIQIIQQQQHHHH")
_RMA1_FIXED = struct.Struct("<4sIQQQQIHHI")  # version 1's block, to name its batch


class RmaVersionError(ValueError):
    """An RMA header of a version this plane does not read (``version``: the digit
    after b"RMA", or None when even that is not one)."""

    def __init__(self, version: int | None) -> None:
        self.version = version
        super().__init__(
            f"RMA header version {version if version is not None else '?'} is not "
            f"supported (this plane reads version {_RMA_VERSION})"
        )


@dataclass(frozen=True)
class RmaHeader:
    """Parsed RMA batch header (version 2): the batch's identity (transfer, lease,
    token, layer group, page size, batch number), authenticated and checked like any
    other batch, and where its pages go and come from: page ``i`` lands in slot
    ``slots[i]`` and lies at the producer in row ``rows[i]`` of a slab of ``nrows``
    rows of ``stride`` bytes at ``base`` (``width`` bytes of each readable), each page
    the column spans ``cols``; ``rkey`` packed by the producer; ``endpoint`` where to
    reach it (reads and the acknowledgement)."""

    transfer_id: int
    lease_id: int
    token: bytes
    group: int
    page_bytes: int
    batch: int
    base: int
    nrows: int
    stride: int
    width: int
    rkey: bytes
    endpoint: str
    cols: tuple[tuple[int, int], ...]
    slots: np.ndarray
    rows: np.ndarray

    def identity(self) -> m.PageBatch:
        """The batch as a PageBatch for the book's authentication (transfer, lease,
        token); its slots travel in ``slots``, not as runs (left empty here)."""
        return m.PageBatch(
            transfer_id=self.transfer_id,
            lease_id=self.lease_id,
            token=self.token,
            group=self.group,
            runs=[],
            page_bytes=self.page_bytes,
        )


def _rma_frame(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    page_bytes: int,
    batch: int,
    base: int,
    nrows: int,
    stride: int,
    width: int,
    rkey: bytes,
    endpoint: str,
    cols: tuple[tuple[int, int], ...],
    slots: np.ndarray,
    rows: np.ndarray,
) -> np.ndarray:
    """The length-prefixed version-2 header of one RMA batch (``RmaHeader``)."""
    ep = endpoint.encode()
    if len(slots) != len(rows):
        raise ValueError(f"{len(slots)} slots for {len(rows)} source rows")
    fixed = _RMA_FIXED.pack(
        _RMA_MAGIC,
        transfer_id,
        lease_id,
        group,
        page_bytes,
        batch,
        len(slots),
        base,
        nrows,
        stride,
        width,
        len(token),
        len(rkey),
        len(ep),
        len(cols),
    )
    body = b"".join(
        (
            fixed,
            token,
            rkey,
            ep,
            np.asarray(cols, dtype="<u8").tobytes(),
            np.ascontiguousarray(slots, dtype="<i8").tobytes(),
            np.ascontiguousarray(rows, dtype="<i8").tobytes(),
        )
    )
    return np.frombuffer(struct.pack("<I", len(body)) + body, dtype=np.uint8)


def _rma_parse(body: bytes) -> RmaHeader:
    """Parse a version-2 RMA header: ``RmaVersionError`` for another version's,
    ValueError when malformed. Vectorised: the slots and rows are views of ``body``."""
    if len(body) < 4 or body[:3] != b"RMA":
        raise ValueError("not an RMA header")
    if body[:4] != _RMA_MAGIC:
        v = body[3:4]
        raise RmaVersionError(int(v) if v.isdigit() else None)
    if len(body) < _RMA_FIXED.size:
        raise ValueError("short RMA header")
    (_, tid, lease, group, pb, batch, n, base, nrows, stride, width, tlen, klen, elen, ncols) = (
        _RMA_FIXED.unpack_from(body)
    )
    at = _RMA_FIXED.size
    if len(body) != at + tlen + klen + elen + 16 * ncols + 16 * n:
        raise ValueError("RMA header lengths disagree")
    token = body[at : at + tlen]
    at += tlen
    rkey = body[at : at + klen]
    at += klen
    endpoint = body[at : at + elen].decode()
    at += elen
    colv = np.frombuffer(body, dtype="<u8", count=2 * ncols, offset=at).reshape(-1, 2)
    at += 16 * ncols
    slots = np.frombuffer(body, dtype="<i8", count=n, offset=at).astype(np.int64, copy=False)
    rows = np.frombuffer(body, dtype="<i8", count=n, offset=at + 8 * n).astype(np.int64, copy=False)
    cols = tuple((int(o), int(c)) for o, c in colv.tolist())
    return RmaHeader(
        tid,
        lease,
        token,
        group,
        pb,
        batch,
        base,
        nrows,
        stride,
        width,
        rkey,
        endpoint,
        cols,
        slots,
        rows,
    )


def _rma1_identity(body: bytes) -> tuple[m.Message, int, str] | None:
    """(PageBatch, batch number, producer endpoint) of a version-1 header, enough to
    refuse it by name to an authenticated producer; None when it does not parse."""
    try:
        _, hlen, _, _, _, _, batch, klen, elen, _ = _RMA1_FIXED.unpack_from(body)
        at = _RMA1_FIXED.size
        msg = m.decode(body[at : at + hlen])
        at += hlen + klen
        return msg, batch, body[at : at + elen].decode()
    except Exception:
        return None


@dataclass
class RmaBatch:
    """A plan entry of the producer: one batch the consumer reads from ``slab`` (a
    host store, registered on first use by the progress thread, which frames the header
    then: ``_tx_pump``): page ``i`` lands in slot ``slots[i]`` from slab row
    ``rows[i]``."""

    transfer_id: int
    lease_id: int
    token: bytes
    group: int
    page_bytes: int
    slab: np.ndarray
    owner: torch.Tensor
    slots: np.ndarray
    rows: np.ndarray
    cols: tuple[tuple[int, int], ...]
    batch: int
    ack_tag: int
    nbytes: int


# =================================== sender state ======================================
@dataclass
class PushHandle:
    """Sender-side handle returned by ``post_push``."""

    transfer_id: int
    endpoint: str
    deadline: float
    # (buffer: numpy, torch on a device, ucx_iov.IovBuf or GatherSeg; tag) in send order
    plan: list[tuple[Any, int]]
    pages: int
    keep: list[object]
    state: TransferState = TransferState.PENDING
    error: str | None = None
    nbytes: int = 0
    requests: list[Any] = field(default_factory=list)
    ep: Any = None  # the endpoint every message of this push goes to
    next: int = 0  # index in ``plan`` of the next message to post
    # (request, send buffer, from the ring?) of gathered segments not yet seen complete
    ring: list[tuple[Any, np.ndarray, bool]] = field(default_factory=list)
    # RMA batches: acknowledgement tags not yet received (the TransferDone, last in
    # ``plan``, is held back until none is left: the consumer may still be reading)
    acks: set[int] = field(default_factory=set)
    rma: bool = False
    cma_seen: int = 0  # cma failures taken in this process when the push started

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.error, self.pages, self.nbytes)


class UcxDataPlane(BookedReceiver, DataPlane):
    """Both DataPlane sides over UCX (see the module docstring).

    ``bind``: ``tcp://host:port`` (port 0 picks one) for the listener of the ``tcp``
    channel; ``advertise``: the address peers should use instead (``tcp://host[:port]``
    or a full ``ucx+...`` endpoint); ``channel``: ``tcp`` (listener), ``shm`` (worker
    address; shared memory between processes of one host), or ``auto`` (worker address;
    UCX picks shared memory locally and TCP otherwise). ``cuda``: accept CUDA regions and
    CUDA source rows (see "CUDA memory" in the module docstring); ``None`` turns it on when
    this process has already initialised CUDA. Use ``shm``/``auto`` for CUDA peers on one
    node: cuda_ipc needs worker-address endpoints. ``rma_readers``: threads that copy
    the one-sided reads of a batch as a consumer (the progress thread and
    ``rma_readers - 1`` reader lanes, each with its own UCX worker; "Reader threads" in
    the module docstring); ``None``: ``default_rma_readers()`` (``DISAGG_UCX_RMA_READERS``, else
    2 on a machine with 2 or more CPUs, else 1)."""

    # producers hand StoreRows of their host slab: a message of scattered rows leaves
    # from where they lie (shm, ucx_iov: one scatter-gather send) or is gathered into a
    # reusable send buffer just before it is posted (tcp), never gathered up front
    accepts_store_rows = True

    # wait() sleeps on the book's condition (notified as pages land and transfers end)
    # in short slices: the base class's backoff grows to 10 ms, a third of a 30 ms transfer
    wait_slice_s = _BUSY_WAIT_S * 5
    # after severing the producers' connections (abort), how long their receives may take
    # to end with an error (0.04-0.27 s measured for ~60 receives of 2 MiB)
    sever_wait_s = 2.0

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        advertise: str | None = None,
        channel: str = "tcp",
        cuda: bool | None = None,
        rma_readers: int | None = None,
    ) -> None:
        if channel not in ("tcp", "shm", "auto"):
            raise ValueError(f"channel must be tcp, shm or auto, not {channel!r}")
        if rma_readers is None:
            rma_readers = default_rma_readers()
        elif isinstance(rma_readers, bool) or not isinstance(rma_readers, int) or rma_readers < 1:
            raise ValueError(f"rma_readers must be an integer >= 1, not {rma_readers!r}")
        self.rma_readers = rma_readers
        self._mapped_on = os.environ.get(_MAPPED_ENV, "1") != "0"
        if cuda is None:
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda and not torch.cuda.is_available():
            raise RuntimeError("UcxDataPlane(cuda=True) but no CUDA device is available")
        self.channel = channel
        self._direct_min = SHM_DIRECT_MIN if channel == "shm" else DIRECT_MIN
        self.cuda = bool(cuda)
        self._cuda_device = torch.cuda.current_device() if self.cuda else -1
        self.stats: Counter[str] = Counter()
        self._book = ReceiverBook(self.stats, rx_factory=_UcxRx)
        # per registered group (set with book.groups, under book.lock): its CUDA device
        # (None: host) and, for one contiguous CUDA region, that region (runs land in it)
        self._gdev: list[torch.device | None] = []
        self._gdirect: list[torch.Tensor | None] = []
        self._dscratch: dict[torch.device, list[torch.Tensor]] = {}  # free device scratch
        self._big_free: dict[torch.device, list[torch.Tensor]] = {}  # whole-batch scratch
        self._big_count: Counter[torch.device] = Counter()  # allocated, free or in use
        self._scatters: deque[_Scatter] = deque()  # launched device scatters, in order
        self._streams: dict[torch.device, Any] = {}  # device scatter streams
        self._pending: dict[int, _PendingSeg] = {}  # by data tag
        self._held: deque[tuple[Any, _PendingSeg]] = deque()  # arrived, awaiting scratch
        self._stop = threading.Event()
        self._jobs: deque[Callable[[], None]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._endpoint = ""
        self._shm_direct = False  # every host region is huge pages: ask for direct runs
        # UCX tcp segments of this context (set by _setup): receive ones of TCP_SEG_BYTES
        # or more (say _TCP_AM_QUERY), send ones bigger than UCX's default (need it)
        self._tcp_rx_large = False
        self._tcp_tx_large = False
        # RMA: the context has it and the channel is shm (set by _setup); the receiver
        # reads StoreRows batches itself while every registered region is host memory
        self._rma = False
        self._rma_rx_ok = False
        # say _TCP_IOV_RX_QUERY: iov receives on and every registered region host memory
        self._iov_rx_ok = False
        # pushes to ucx+tcp endpoints send scattered StoreRows segments as iov messages
        # (set by _setup from the context's settings: ``tcp_iov_default``)
        self.tcp_iov_sends = False
        # a tcp receiver posts packed segments for host slots as iov receives into the
        # slots (set by _setup: ``tcp_iov_recv_default``; "Scatter-gather receives")
        self.tcp_iov_recvs = False
        self._bind = urlsplit(bind)
        self._advertise = advertise
        self._thread = threading.Thread(target=self._run, name="disagg-ucx", daemon=True)
        self._thread.start()
        self._ready.wait(30.0)
        if self._init_error is not None:
            raise RuntimeError(f"UCX data plane failed to start: {self._init_error}")
        if not self._ready.is_set():
            raise RuntimeError("UCX data plane did not start within 30 s")

    # ================================ receiver ==========================================
    @property
    def endpoint(self) -> str:
        query = []
        if self._shm_direct:
            query.append(_SHM_DIRECT_QUERY)
        if self._rma_rx_ok:
            query.append(_RMA_QUERY)
        if self.channel == "tcp":
            query.append(_TCP_SEG_QUERY)
            if self._tcp_rx_large:
                query.append(_TCP_AM_QUERY)
            if self._iov_rx_ok:
                query.append(_TCP_IOV_RX_QUERY)
        return f"{self._endpoint}?{'&'.join(query)}" if query else self._endpoint

    def register_regions(
        self, group_regions: Sequence[Sequence[RegionSpec | torch.Tensor]]
    ) -> None:
        specs = [
            [r if isinstance(r, RegionSpec) else RegionSpec(r) for r in g] for g in group_regions
        ]
        gdev: list[torch.device | None] = []
        gdirect: list[torch.Tensor | None] = []
        for g, regs in enumerate(specs):
            devs = {r.tensor.device for r in regs}
            if len(devs) > 1:
                raise ValueError(f"layer group {g} has regions on several devices: {devs}")
            dev = next(iter(devs), None)
            if dev is None or dev.type == "cpu":
                gdev.append(None)
                gdirect.append(None)
                continue
            if dev.type != "cuda":
                raise ValueError(f"layer group {g}: regions on {dev} (host or CUDA only)")
            if not self.cuda:
                raise ValueError("CUDA regions need a plane made with cuda=True")
            gdev.append(dev)
            one = len(regs) == 1 and regs[0].contiguous
            gdirect.append(regs[0].tensor if one else None)
            if dev not in self._dscratch:
                self._dscratch[dev] = [
                    torch.empty(SEG_BYTES, dtype=torch.uint8, device=dev)
                    for _ in range(_SCRATCH_BUFS)
                ]
                self._streams[dev] = torch.cuda.Stream(dev)
        groups = build_groups(specs)
        host = [r.tensor for g, regs in enumerate(specs) if gdev[g] is None for r in regs]
        with self._book.lock:
            self._book.groups = groups
            self._gdev, self._gdirect = gdev, gdirect
            self._shm_direct = (
                self.channel == "shm" and bool(host) and all(map(hostmem.is_huge, host))
            )
            self._rma_rx_ok = self._rma and all(d is None for d in gdev)
            self._iov_rx_ok = self.tcp_iov_recvs and all(d is None for d in gdev)

    # ================================= sender ===========================================
    def post_push(
        self,
        endpoint: str,
        transfer_id: int,
        lease_id: int,
        token: bytes,
        pages: Sequence[RowsSource],
        deadline_s: float = 30.0,
        caps: m.DataCaps | None = None,
    ) -> PushHandle:
        if not endpoint.startswith(("ucx+tcp://", "ucx+shm://", "ucx+addr://")):
            raise ValueError(f"not a UCX data endpoint: {endpoint!r}")
        plan: list[tuple[Any, int]] = []
        keep: list[object] = []
        npages = 0
        seq = 0
        # Over tcp with UCX's default tcp settings (and ucx+addr, which may be tcp) UCX
        # sends an iov message in 8 KiB copy-in pieces: there the C gather per segment
        # into the send ring is faster. With active-message rendezvous in large tcp
        # segments (``tcp_iov_sends``) UCX writes the iov straight from the rows
        # ("Scatter-gather sends over tcp" in the module docstring)
        shm = endpoint.startswith("ucx+shm://")
        tcp_iov = self.tcp_iov_sends and endpoint.startswith("ucx+tcp://")
        iov = (shm or tcp_iov) and ucx_iov.available()
        srcs: list[tuple[int, torch.Tensor | StoreRows, Sequence[int]]] = []
        for group, src, dst_slots in pages:
            if isinstance(src, StoreRows) and src.slab.device.type != "cpu":
                src = src.materialize()  # device slab: whole mode, one batched gather
            srcs.append((group, src, dst_slots))
        devices = {
            src.device
            for _, src, _ in srcs
            if isinstance(src, torch.Tensor) and src.device.type == "cuda"
        }
        if devices and not self.cuda:
            raise ValueError("CUDA source rows need a plane made with cuda=True")
        query = urlsplit(endpoint).query.split("&")
        direct = shm and _SHM_DIRECT_QUERY in query
        small = self.channel == "tcp" and _TCP_SEG_QUERY in query  # "Segments over tcp"
        pack = small and _TCP_IOV_RX_QUERY in query  # "Scatter-gather receives over tcp"
        # which runs go alone, and the header tag that tells the receiver so
        direct_min, hdr_tag = (
            (DIRECT_MIN, _HDR_DIRECT_TAG)
            if direct
            else (SHM_DIRECT_MIN, _HDR_TAG)
            if shm
            else (TCP_PACK_DIRECT_MIN, _HDR_TCP_PACK_TAG)
            if pack
            else (DIRECT_MIN, _HDR_TCP_SEG_TAG if small else _HDR_TAG)
        )
        if self._tcp_tx_large and endpoint.startswith("ucx+tcp://") and _TCP_AM_QUERY not in query:
            raise ValueError(
                f"the receiver's UCX tcp plane ({endpoint}) does not say {_TCP_AM_QUERY!r}: it "
                "predates this plane's tcp protocol (active-message rendezvous in 2 MiB "
                "segments, the tcp put off) and would never take its messages. Upgrade it, "
                "or start this side with UCX_TCP_PUT_ENABLE=y UCX_RNDV_SCHEME=put_zcopy (the "
                "earlier protocol, which lets peers write this process's memory) until then"
            )
        # One-sided: the receiver reads host StoreRows itself (module docstring, "RMA")
        rma = shm and self._rma and _RMA_QUERY in query
        batch = 0
        for group, rows, dst_slots in srcs:
            if rma and isinstance(rows, StoreRows):
                msgs, n, batch = _plan_rma(
                    transfer_id, lease_id, bytes(token), group, rows, dst_slots, batch, keep
                )
                plan.extend(msgs)
                npages += n
                continue
            msgs, n, seq = _plan_group(
                transfer_id,
                lease_id,
                bytes(token),
                group,
                rows,
                dst_slots,
                seq,
                keep,
                direct_min,
                hdr_tag,
                iov,
                TCP_SEG_BYTES if small else SEG_BYTES,
            )
            plan.extend(msgs)
            npages += n
        for dev in devices:  # the rows' producers and our gathers end before UCX reads
            torch.cuda.current_stream(dev).synchronize()
        done = m.TransferDone(transfer_id=transfer_id, lease_id=lease_id, token=bytes(token))
        plan.append((_frame(done), _HDR_TAG))
        handle = PushHandle(
            transfer_id, endpoint, time.monotonic() + deadline_s, plan, npages, keep
        )
        handle.rma = batch > 0
        if self._stop.is_set():
            handle.state, handle.error = TransferState.FAILED, "data plane closed"
        else:
            self._submit(lambda: self._tx_start(handle))
        return handle

    def poll_push(self, handle: PushHandle) -> TransferStatus:
        return handle.status()

    def abort(self, transfer_id: int, reason: str = "aborted") -> int:
        """Fail the transfer and wait (``abort_wait_s``) for its writes under way.

        Called by the consumer (any thread but the progress thread), once per transfer it
        gives up on. Writes that outlive the wait are receives UCX already matched, straight
        into slots (iov receives, runs landing in place): UCX cannot cancel them, and a
        stalled producer that resumes would finish them into slots the engine may reuse.
        On the tcp channel the plane then severs its producers' connections ("Severing"
        in the module docstring: every accepted endpoint force-closed, which ends those
        receives with an error and drops whatever that producer sends later) and waits
        again (``sever_wait_s``). Returns the writes still under way after that: 0 unless
        the plane could not sever (shm/auto channels, or UCX did not end them), in which
        case the caller must not reuse the slots."""
        left = self._book.abort(transfer_id, reason, self.abort_wait_s)
        if left and self._listener is not None and not self._stop.is_set():
            n = self._sever(f"transfer {transfer_id}: {left} writes outlived its abort")
            left = self._book.abort(transfer_id, reason, self.sever_wait_s)
            log.warning(
                "transfer %d: severed %d producer connections; %d writes left",
                transfer_id,
                n,
                left,
            )
        if left:
            log.warning("transfer %d: %d writes still in flight after abort", transfer_id, left)
        return left

    def _sever(self, why: str) -> int:
        """Force-close every accepted (producer) endpoint on the progress thread and wait
        for it; returns how many were closed. Every transfer still arriving over them fails
        (their receives end with an error), and their producers reconnect on their next
        push. Collateral by design: UCX does not say which connection a matched receive
        belongs to, and a stalled producer is rare next to a wrong token."""
        closed = [0]
        done = threading.Event()

        def job() -> None:
            eps = self._accepted[:]
            self._accepted.clear()
            for ep in eps:
                try:
                    # accepted endpoints have error handling: ucxx closes them with
                    # UCP_EP_CLOSE_FLAG_FORCE and then lets go of the UCP handle
                    if ep.alive:
                        ep.close_blocking()
                        closed[0] += 1
                except Exception:
                    log.exception("force-closing an accepted endpoint failed")
                self._dead_eps.append(ep)
            self.stats["severed"] += closed[0]
            log.warning("severed %d producer connections (%s)", closed[0], why)
            done.set()

        if threading.current_thread() is self._thread:
            job()
        else:
            self._submit(job)
            done.wait(10.0)
        return closed[0]

    def register_source(self, tensor: torch.Tensor) -> torch.Tensor:
        """Producer: put a host store slab where consumers on this host can map it
        ("Mapped stores" in the module docstring); returns the tensor to use from now
        on. On ``shm`` with RMA, a contiguous, unpinned host tensor is copied into
        memory UCX allocates (``ucp_mem_map`` with ALLOCATE: shared memory) and a tensor
        of the same shape and dtype over it is returned; that memory stays registered
        (rkey packed once, never evicted) and is freed only once this plane closed AND
        the returned tensor (every view of it) is gone, so the tensor never dangles.
        Anything else (tcp/auto, RMA unavailable, ``DISAGG_UCX_MAPPED=0``, CUDA, pinned
        or non-contiguous tensors, a failed allocation) returns ``tensor`` unchanged
        (logged at info): consumers then read it with gets as before. Call once per
        slab, at start-up (it copies the whole slab)."""
        why = None
        if not self._mapped_on:
            why = f"turned off by {_MAPPED_ENV}=0"
        elif self.channel != "shm":
            why = f"channel {self.channel} (mapped stores need shm)"
        elif not self._rma:
            why = f"UCX RMA unavailable ({ucx_rma.unavailable_reason()})"
        elif tensor.device.type != "cpu":
            why = f"a {tensor.device.type} tensor"
        elif tensor.dim() == 0 or tensor.numel() == 0 or not tensor.is_contiguous():
            why = "not a contiguous, non-empty tensor"
        elif tensor.is_pinned():
            why = "a pinned tensor (the copy would lose the pinning)"
        if why is None:
            try:
                return self._map_source(tensor)
            except Exception as exc:
                why = f"allocation failed: {type(exc).__name__}: {exc}"
        log.info("UCX register_source: store kept where it is: %s", why)
        return tensor

    def _map_source(self, tensor: torch.Tensor) -> torch.Tensor:
        """``register_source``'s allocation (on the progress thread) and copy."""
        nbytes = tensor.numel() * tensor.element_size()
        done = threading.Event()
        got: dict[str, Any] = {}

        def job() -> None:
            try:
                reg, buf = ucx_rma.allocate(self._ctx.handle, nbytes)
                # kept from here on: freed at close once the array is gone
                self._rma_alloc.append((reg, weakref.ref(buf)))
                self.stats["rma_mem_alloc"] += 1
                got["buf"] = buf
            except BaseException as exc:
                got["error"] = exc
            finally:
                done.set()

        if self._stop.is_set():
            raise RuntimeError("data plane closed")
        self._submit(job)
        while not done.wait(0.05):
            if not self._thread.is_alive():
                raise RuntimeError("data plane closed")
        if "error" in got:
            raise got["error"]
        flat = torch.from_numpy(np.ctypeslib.as_array(got.pop("buf")))
        out = flat.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    # ================================= common ===========================================
    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(10.0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _submit(self, job: Callable[[], None]) -> None:
        self._jobs.append(job)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # ============================ progress thread =======================================
    def _run(self) -> None:
        try:
            self._setup()
        except BaseException as exc:  # reported to the constructor
            self._init_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except Exception:
            log.exception("UCX data plane progress thread died")
        finally:
            self._teardown()

    def _setup(self) -> None:
        if self.cuda:
            _cuda_env()
            # UCX's cuda transports want the device's context current in the thread
            # that creates the context/worker and makes every UCX call (this one).
            torch.cuda.set_device(self._cuda_device)
            torch.empty(1, device=f"cuda:{self._cuda_device}")
        self._rma = self.channel == "shm" and ucx_rma.available()
        # A peer that dies during a cma copy (our reads on shm, or UCX's rendezvous
        # writes on the tag path) must fail the request, not abort this process: shm
        # endpoints run without UCX error handling ("Peer failures on shm").
        ucx_rma.guard_cma()
        features = [ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP]
        if self._rma:
            features.append(ucx_api.Feature.RMA)
        config = _exposure_config(self.channel, self._bind.hostname)
        self._tcp_rx_large = (
            self.channel == "tcp" and _tcp_seg("TCP_RX_SEG_SIZE", config) >= TCP_SEG_BYTES
        )
        self._tcp_tx_large = _tcp_seg("TCP_TX_SEG_SIZE", config) > UCX_TCP_SEG_DEFAULT
        self._ctx = ucx_api.UCXContext(config_dict=config, feature_flags=tuple(features))
        # decided from what this context was created with (the environment now and the
        # config dict passed), as UCX read it then
        self.tcp_iov_sends = self.channel != "shm" and tcp_iov_default(config)
        self.tcp_iov_recvs = (
            self.channel == "tcp" and tcp_iov_recv_default(config) and ucx_iov.available()
        )
        self._worker = ucx_api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self._eps: dict[str, Any] = {}  # sender endpoints by data endpoint string
        self._accepted: list[Any] = []  # endpoints the listener made (kept alive)
        self._dead_eps: list[Any] = []
        self._tx_active: list[PushHandle] = []
        self._raw_zombies: list[ucx_iov.RawRequest] = []  # failed pushes' iov sends
        # send ring (_ring_take): free buffers, how many exist (free or in flight), and
        # failed pushes' buffers UCX may still read (request, buffer, from the ring?)
        self._ring_free: list[np.ndarray] = []
        self._ring_count = 0
        self._ring_zombies: list[tuple[Any, np.ndarray, bool]] = []
        # (request, segment, scratch: np / torch / None, the free list it goes back to)
        self._rx_reqs: list[tuple[Any, _PendingSeg, Any, Any]] = []
        self._discards: list[Any] = []
        # RMA, producer: registered store slabs by (address, length), least recently
        # used first; acknowledgement tags awaited, by tag. Consumer: batches being read,
        # unpacked remote keys by (producer endpoint, packed key), acknowledgement sends
        self._rma_regs: dict[tuple[int, int], ucx_rma.Registration] = {}
        self._ack_wait: dict[int, PushHandle] = {}
        self._rma_reads: list[_RmaRead] = []
        self._rkeys: dict[tuple[str, bytes], tuple[Any, int]] = {}
        # Mapped stores: the producer's UCX-allocated store slabs (register_source), with
        # a weak reference to the byte array the returned tensor lives on; the consumer's
        # local mapping of each unpacked key (shared mapping [start, end), None where
        # ``rkey_ptr`` failed: read with gets), dropped with the key
        self._rma_alloc: list[tuple[ucx_rma.Registration, Any]] = []
        self._rkey_maps: dict[tuple[str, bytes], tuple[int, int] | None] = {}
        self._populator = _Populator()
        self._ack_sends: list[tuple[Any, np.ndarray]] = []
        # Reader lanes (made on the first RMA batch); _rma_lock guards each read's
        # ``left``, ``error`` and ``posted`` (changed by every reader)
        self._rma_lock = threading.Lock()
        self._lanes: list[_ReadLane] | None = None if self.rma_readers > 1 else []
        # 2 MiB-aligned huge pages (hostmem): CMA writes into them at memcpy speed, and
        # their rows agree modulo 64 with torch's stores and pools (numpy's start 16
        # bytes into a page, which made every CMA copy ~1.5x slower; "Shared memory")
        self._scratch_free = [hostmem.empty(SEG_BYTES).numpy() for _ in range(_SCRATCH_BUFS)]
        for b in self._scratch_free:
            b.fill(0)  # prefault once, not per transfer
        self._listener = None
        if self.channel == "tcp":
            host = self._bind.hostname or "127.0.0.1"
            self._listener = ucx_api.UCXListener.create(
                worker=self._worker, port=self._bind.port or 0, cb_func=self._on_connect
            )
            port = self._listener.port
            adv = self._advertise
            if adv and adv.startswith("ucx+"):
                self._endpoint = adv
            else:
                if adv:
                    a = urlsplit(adv)
                    host, port = a.hostname or host, a.port or port
                if host in ("0.0.0.0", "*", ""):
                    host = "127.0.0.1"
                self._endpoint = f"ucx+tcp://{host}:{port}"
        else:
            addr = self._worker.address.tobytes()
            scheme = "ucx+shm" if self.channel == "shm" else "ucx+addr"
            self._endpoint = f"{scheme}://{addr.hex()}"

    def _on_connect(self, conn_request: Any) -> None:
        assert self._listener is not None
        ep = self._listener.create_endpoint_from_conn_request(conn_request, True)
        self._accepted.append(ep)

    def _teardown(self) -> None:
        with self._book.lock:
            self._book.fail_all("data plane closed")
        for h in self._tx_active:
            self._tx_fail(h, "data plane closed")
        while self._jobs:
            self._jobs.popleft()  # queued pushes: their handles fail below via _stop
        for ep in list(self._eps.values()) + self._accepted:
            self._close_ep(ep)
        try:
            self._worker.cancel_inflight_requests()
            self._worker.progress()
        except Exception:
            pass
        self._rma_teardown()
        self._eps.clear()
        self._accepted.clear()
        self._listener = None

    def _loop(self) -> None:
        worker = self._worker
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        poller.register(worker.epoll_file_descriptor, select.POLLIN)
        last_sweep = 0.0
        while not self._stop.is_set():
            while self._jobs:
                self._jobs.popleft()()
            worker.progress()
            self._rx_headers()
            if self._ack_wait:
                self._rx_acks()
            self._rx_segments()
            self._rx_reap()
            if self._rma_reads or self._ack_sends:
                self._rma_reap()
            self._scatter_reap(block=False)
            tx_more = self._tx_reap()
            now = time.monotonic()
            if now - last_sweep > 0.01:
                last_sweep = now
                self._sweep(now)
            if self._jobs or tx_more:
                continue
            if self._scatters:  # short device work that does not signal the event fd
                self._scatter_reap(block=True)
                continue
            # cma reads progress in worker progress, not on the fd: keep going while
            # this thread has reads to claim or in flight; while only the lanes read,
            # sleep (the last reader of a batch wakes this thread: _rma_done)
            if any(r.mine is not None for r in self._rma_reads):
                continue
            # Blocking progress: sleep on the worker's event fd even with data in flight
            # (UCX signals it on every completion / arrival), so this thread never spins
            # against the peer process or the engine on a small host.
            busy = bool(self._rx_reqs or self._tx_active or self._pending or self._held)
            if self.cuda and (self._rx_reqs or self._tx_active):
                # cuda_ipc copy completions are polled by UCX, not signalled on the fd
                # (and poll() cannot sleep under 1 ms): keep progressing while requests
                # are in flight, yielding the GIL each turn
                time.sleep(0)
                continue
            if worker.arm():
                poller.poll((_BUSY_WAIT_S if busy else _IDLE_WAIT_S) * 1000)
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
        # pushes queued after the loop ended
        while self._jobs:
            self._jobs.popleft()()

    # ---------------------------------- receive -----------------------------------------
    def _rx_headers(self) -> None:
        worker = self._worker
        any_hdr = ucx_api.UCXXTag(0)
        mask = ucx_api.UCXXTagMask(_U64 ^ _HDR_MASK_TAGS)
        while True:
            probe = worker.tag_probe(any_hdr, mask, remove=True)
            if not probe.matched:
                return
            hdr_tag = int(probe.sender_tag.value)
            whole = hdr_tag == _HDR_WHOLE_TAG
            n = int(probe.length)
            buf = np.empty(max(n, 1), dtype=np.uint8)
            req = worker.tag_recv_with_handle(Array(buf), probe)
            while not req.completed:
                worker.progress()
            try:
                req.check_error()
            except Exception as exc:
                self.stats["rejected_header"] += 1
                log.debug("header receive failed: %s", exc)
                continue
            if n < 4 or n > _HDR_MAX or struct.unpack_from("<I", buf.data)[0] != n - 4:
                self.stats["rejected_BAD_FRAME"] += 1
                continue
            if hdr_tag == _HDR_RMA_TAG:
                self._rx_rma(buf[4:n].tobytes())
                continue
            try:
                msg = m.decode(buf[4:n].tobytes())
            except ProtocolError as e:
                self.stats["rejected_" + e.code.name] += 1
                continue
            self._rx_header(
                msg,
                whole,
                _HDR_DIRECT_MIN.get(hdr_tag),
                TCP_SEG_BYTES if hdr_tag in (_HDR_TCP_SEG_TAG, _HDR_TCP_PACK_TAG) else SEG_BYTES,
            )

    def _rx_header(
        self,
        msg: m.Message,
        whole: bool = False,
        direct_min: int | None = None,
        seg_bytes: int = SEG_BYTES,
    ) -> None:
        book = self._book
        with book.lock:
            rx = book.authenticate(msg)
            if rx is None:
                return  # its payload, if any, arrives under unknown tags: discarded
            assert isinstance(rx, _UcxRx)
            if isinstance(msg, m.TransferDone):
                book.on_done(rx, msg, rx.queued)
                book.cond.notify_all()
                return
            assert isinstance(msg, m.PageBatch)
            # Checked before it is cut into segments: the runs are bounded by the group
            # and by the pages still due, so a forged count cannot make it expand forever.
            why, slots, _ = book.accept_runs(rx, msg)
            if why is not None:
                # refused (the transfer is over): its segments arrive under unknown
                # tags and are discarded
                book.cond.notify_all()
                return
            assert slots is not None
            if whole:  # the whole batch in one message (the sender's rows are on a GPU)
                pages = int(slots.size)
                segs = [Segment(tuple(msg.runs[:1]), 0, pages, len(msg.runs) == 1)]
                if pages > 1 and pages * msg.page_bytes > BATCH_BYTES:
                    rx.seq += 1
                    book.fail(rx, f"batch of {pages * msg.page_bytes} bytes in one message")
                    book.cond.notify_all()
                    return
            else:
                dmin = self._direct_min if direct_min is None else direct_min
                segs = segments(msg.runs, msg.page_bytes, dmin, seg_bytes)
            seq0 = rx.seq
            rx.seq += len(segs)
            rx.queued += len(segs)
            key = _tag_key(rx.token)
            grp = book.groups[msg.group]
            iov = self._batch_iov(grp, msg, slots) if self.tcp_iov_recvs and not whole else None
            if not whole or len(msg.runs) == 1:
                slots = None  # the pending segment keeps slots only for a scattered whole batch
            for i, seg in enumerate(segs):
                tag = _data_tag(key, rx.transfer_id, seq0 + i)
                p = _PendingSeg(rx, msg.group, tag, seg, seg.pages * msg.page_bytes, whole, slots)
                if iov is not None and not (seg.direct and grp.direct is not None):
                    # (one run into one region lands in place through ucxx: contiguous)
                    p.iov = iov[seg.first : seg.first + seg.pages].reshape(-1, 2)
                    p.owner = grp
                self._pending[tag] = p
        if whole:  # start its receive now, not after every queued header is decoded
            self._rx_one(tag)

    # ------------------------------ receive: RMA ----------------------------------------
    def _rx_rma(self, body: bytes) -> None:
        """An RMA batch header: authenticate it, check the whole batch (slots by the
        book, the producer's rows and columns against the slab it describes) before any
        read is posted, then post one read per run (``ucx_rma.op_lists``: consecutive
        rows into consecutive slots merged) from the C loop. The pages land, and the
        producer is acknowledged, once every read completed (``_rma_reap``). A header
        of another version is refused by name (``_rma_refuse``)."""
        try:
            hdr = _rma_parse(body)
        except RmaVersionError as e:
            self._rma_refuse(body, e)
            return
        except Exception:  # anything malformed: never let it end this thread
            self.stats["rejected_BAD_FRAME"] += 1
            return
        book = self._book
        with book.cond:
            rx = book.authenticate(hdr.identity())
            if rx is None:
                return
            assert isinstance(rx, _UcxRx)
            ack = _ack_tag(_tag_key(rx.token), rx.transfer_id, hdr.batch)
            slots = hdr.slots  # int64, page order: checked here before any read
            why = self._rma_check(hdr)
            if why is None:
                end = int(slots.max()) + 1
                why = book.accept_slots(rx, hdr.group, hdr.page_bytes, slots, end)
            elif not rx.state.final:
                self.stats["rejected_batch"] += 1
                book.fail(rx, why)
            if why is not None:
                book.cond.notify_all()
                self._rma_ack(hdr.endpoint, ack, f"batch refused: {why}")
                return
            grp = book.groups[hdr.group]
            rx.inflight += 1
        pages = int(slots.size)
        try:
            pieces = ucx_rma.page_pieces(hdr.cols, [r.size for r in grp.regions])
            ep = self._connect(hdr.endpoint)
            rkey = self._rkey(hdr.endpoint, ep, hdr.rkey)
            ptr = self._rma_mapped(hdr, rkey) if self._mapped_on else None
        except _MappedRangeError as exc:  # a header past the producer's segment: no read
            self._rma_finish(rx, hdr.group, 0, 0, hdr.endpoint, ack, str(exc), refused=True)
            return
        except Exception as exc:
            why = f"RMA reads from {hdr.endpoint} failed: {type(exc).__name__}: {exc}"
            self._rma_finish(rx, hdr.group, 0, 0, hdr.endpoint, ack, why)
            return
        if ptr is not None:  # the producer's store is mapped here: copy, land, acknowledge
            self._rma_copy(rx, grp, hdr, ptr, pieces, ack)
            return
        lanes = self._rma_lanes()
        try:
            local, remote, length = ucx_rma.op_lists(
                hdr.base,
                hdr.stride,
                hdr.rows,
                [int(r.tensor.data_ptr()) for r in grp.regions],
                [int(r.tensor.stride(0)) for r in grp.regions],
                slots,
                pieces,
                _RMA_MAX_READ if lanes else None,
            )
            shared = ucx_rma.RmaShared(local, remote, length, _RMA_SLICE, grp.regions)
            mine = ucx_rma.RmaPull(shared, ep.handle, rkey)
        except Exception as exc:
            with book.cond:
                rx.inflight -= 1
                book.fail(rx, f"RMA reads from {hdr.endpoint} failed: {type(exc).__name__}: {exc}")
                book.cond.notify_all()
            self._rma_ack(hdr.endpoint, ack, "reads failed")
            return
        nbytes = pages * hdr.page_bytes
        helpers = lanes if nbytes >= _RMA_SPLIT_MIN * (len(lanes) + 1) else []
        read = _RmaRead(
            rx,
            hdr.group,
            pages,
            nbytes,
            ack,
            ep,
            hdr.endpoint,
            hdr.rkey,
            shared,
            1 + len(helpers),
            mine,
        )
        self.stats["rma_reads"] += int(local.size)
        self._rma_reads.append(read)
        # the lanes start on it now; this thread takes its turns from the loop
        # (``_rma_reap``), after it has checked and handed out every header that has
        # arrived, so a lane finds the next batch queued when it ends one
        for lane in helpers:
            lane.submit(read)

    def _rma_mapped(self, hdr: RmaHeader, rkey: int) -> int | None:
        """The local address of the producer's slab (``hdr.base``) where its memory is
        mapped here through the key (``ucp_rkey_ptr``: a store from the producer's
        ``register_source``, over shared memory), else None (read with gets). The
        mapping is looked up once per key (``ucx_rma.shared_mapping``) and every batch's
        slab, ``[base, base + (nrows - 1) * stride + width)``, must lie inside it:
        ``_MappedRangeError`` otherwise (UCX only adds an offset)."""
        key = (hdr.endpoint, hdr.rkey)
        span = self._rkey_maps.get(key)
        if span is None and key in self._rkey_maps:
            return None
        st, ptr = ucx_rma.rkey_ptr(rkey, hdr.base)
        if st != 0 or not ptr:
            self._rkey_maps[key] = None
            self.stats["rma_unmapped_keys"] += 1
            log.info("UCX: %s's store is not mapped here (ucs_status %d): gets", hdr.endpoint, st)
            return None
        end = ptr + (hdr.nrows - 1) * hdr.stride + hdr.width
        found = span if span is not None else ucx_rma.shared_mapping(ptr)
        if found is None or not (found[0] <= ptr and end <= found[1]):
            where = "no shared mapping" if found is None else f"[{found[0]:#x}, {found[1]:#x})"
            raise _MappedRangeError(
                f"RMA batch describes {hdr.nrows} rows of {hdr.width} bytes {hdr.stride} "
                f"apart at {hdr.base:#x} (here [{ptr:#x}, {end:#x})), outside the "
                f"producer's mapped segment ({where})"
            )
        if span is None:
            self._rkey_maps[key] = found
            self._populator.start(key, *found)  # only from a batch that fit it
        return ptr

    def _rma_copy(
        self,
        rx: _UcxRx,
        grp: Group,
        hdr: RmaHeader,
        ptr: int,
        pieces: list[tuple[int, int, int, int]],
        ack: int,
    ) -> None:
        """Copy a checked batch from the producer's mapped slab (``ptr``: its base
        here, bounds checked by ``_rma_mapped``) into its slots, then land it and
        acknowledge it: the copy is complete before the producer may reuse the rows.
        One C row copy per piece (``_rowcopy``: a memcpy per row, GIL released, threads
        for big batches), on this thread: ``abort`` waits for it (``rx.inflight``)."""
        pages = int(hdr.slots.size)
        nbytes = pages * hdr.page_bytes
        error = None
        if not rx.state.final:  # aborted or expired meanwhile: nothing would count it
            try:
                _mapped_copy(grp, hdr, ptr, pieces)
                self.stats["rma_mapped_batches"] += 1
                self.stats["rma_mapped_bytes"] += nbytes
            except Exception as exc:
                error = f"copy from {hdr.endpoint}'s mapped store failed: {exc}"
        self._rma_finish(rx, hdr.group, pages, nbytes, hdr.endpoint, ack, error)

    def _rma_finish(
        self,
        rx: _UcxRx,
        group: int,
        pages: int,
        nbytes: int,
        endpoint: str,
        ack: int,
        error: str | None,
        refused: bool = False,
    ) -> None:
        """A batch this thread took (``rx.inflight`` counts it) is over: its pages land
        when ``error`` is None and the transfer is still live, else the transfer fails
        with ``error`` (``refused``: counted as a rejected batch); the producer is told
        either way (``_rma_ack``)."""
        book = self._book
        with book.cond:
            if error is not None:
                if not rx.state.final:
                    if refused:
                        self.stats["rejected_batch"] += 1
                    book.fail(rx, error)
            elif rx.state.final:
                error = f"transfer {rx.transfer_id} ended: {rx.error}"
            else:
                book.landed(rx, group, pages, nbytes)
            rx.inflight -= 1
            book.maybe_finish(rx, rx.queued)
            book.cond.notify_all()
        self._rma_ack(endpoint, ack, error if not refused else f"batch refused: {error}")

    def _rma_check(self, hdr: RmaHeader) -> str | None:
        """What is wrong with an RMA batch's source description, or None: every read
        must lie inside the slab the producer registered, the columns must make a page of
        the batch's size, and the group must be host memory (reads into device memory
        are not done here: such a receiver does not offer RMA). The slots are the
        book's (``accept_slots``)."""
        if hdr.slots.size == 0:
            return "RMA batch of no pages"
        if int(hdr.rows.min()) < 0 or int(hdr.rows.max()) >= hdr.nrows:
            return f"RMA batch names source rows outside the producer's {hdr.nrows}"
        if hdr.width < 1 or hdr.stride < hdr.width:
            return f"RMA batch describes rows of {hdr.width} bytes {hdr.stride} apart"
        if not hdr.cols or any(o < 0 or c < 1 or o + c > hdr.width for o, c in hdr.cols):
            return f"RMA batch columns {hdr.cols} outside rows of {hdr.width} bytes"
        if sum(c for _, c in hdr.cols) != hdr.page_bytes:
            return f"RMA batch columns make {sum(c for _, c in hdr.cols)}-byte pages"
        if not 0 <= hdr.group < len(self._gdev):
            return None  # the book names this one
        if self._gdev[hdr.group] is not None:
            return f"RMA batch for group {hdr.group}, which lives in device memory"
        if not hdr.endpoint.startswith(("ucx+shm://", "ucx+addr://")):
            return "RMA batch names no worker-address endpoint to read from"
        return None

    def _rma_refuse(self, body: bytes, e: RmaVersionError) -> None:
        """An RMA header of another version: counted and logged; a version-1 header
        from an authenticated producer also fails its transfer, and its push, with the
        version named (the acknowledgement carries the text)."""
        self.stats["rejected_rma_version"] += 1
        log.warning("%s", e)
        got = _rma1_identity(body) if e.version == 1 else None
        if got is None:
            return
        msg, batch, endpoint = got
        book = self._book
        with book.cond:
            rx = book.authenticate(msg)
            if rx is None:
                return
            if not rx.state.final:
                book.fail(rx, str(e))
                book.cond.notify_all()
        if endpoint.startswith(("ucx+shm://", "ucx+addr://")):
            self._rma_ack(endpoint, _ack_tag(_tag_key(rx.token), rx.transfer_id, batch), str(e))

    def _rkey(self, endpoint: str, ep: Any, packed: bytes) -> int:
        """The unpacked remote key of ``packed`` on ``ep`` (cached; a key unpacked on an
        endpoint that was since replaced is destroyed and unpacked again)."""
        key = (endpoint, packed)
        got = self._rkeys.get(key)
        if got is not None:
            if got[0] is ep:
                return got[1]
            self._rkey_destroy(key)
        if len(self._rkeys) >= _RMA_RKEYS:
            busy = {id(r.ep) for r in self._rma_reads}
            for k in [k for k, (e, _) in self._rkeys.items() if id(e) not in busy][:8]:
                self._rkey_destroy(k)
        handle = ucx_rma.unpack(ep.handle, packed)
        self.stats["rma_rkey_unpack"] += 1
        self._rkeys[key] = (ep, handle)
        return handle

    def _rkey_destroy(self, key: tuple[str, bytes]) -> None:
        if self._rkey_maps.pop(key, None) is not None:  # its local mapping goes with it
            self._populator.cancel(key)
        _, handle = self._rkeys.pop(key)
        ucx_rma.destroy(handle)
        self.stats["rma_rkey_destroy"] += 1

    def _rma_ack(self, endpoint: str, tag: int, error: str | None) -> None:
        """Tell the producer an RMA batch is done with (its rows are no longer read):
        ``error`` None when every read landed. Best effort: a producer that never hears
        fails its push at its deadline, and without its TransferDone the transfer here
        cannot end DONE."""
        body = b"\x00" if error is None else b"\x01" + error.encode()[:512]
        buf = np.frombuffer(body, dtype=np.uint8).copy()
        try:
            ep = self._connect(endpoint)
            self._ack_sends.append((ep.tag_send(Array(buf), ucx_api.UCXXTag(tag)), buf))
        except Exception as exc:
            log.debug("RMA acknowledgement to %s failed: %s", endpoint, exc)

    def _rma_lanes(self) -> list[_ReadLane]:
        """The reader lanes (``rma_readers - 1``), made on first use; none when a lane
        cannot start (logged: this thread then reads everything, as with one reader)."""
        if self._lanes is None:
            self._lanes = []
            try:
                for i in range(self.rma_readers - 1):
                    self._lanes.append(_ReadLane(self._ctx, self._rma_done, self.stats, i))
            except Exception as exc:
                log.warning("UCX reader lanes: %s (reading on the progress thread)", exc)
                for lane in self._lanes:
                    lane.close()
                self._lanes = []
        return self._lanes

    def _rma_done(self, read: _RmaRead, posted: int, error: str | None) -> None:
        """A reader finished its share of ``read`` (``posted`` reads), on any thread:
        ``error`` None when all of it landed. The last one wakes the progress thread,
        which lands (or fails) the batch and acknowledges it (``_rma_reap``)."""
        with self._rma_lock:
            read.left -= 1
            read.posted += posted
            if error is not None and read.error is None:
                read.error = error
            last = read.left == 0
        if last and not self._stop.is_set():  # closing: the pipe may be gone
            self._wake()

    def _rma_step(self, read: _RmaRead) -> None:
        """The progress thread's turn at ``read``: claim and post up to ``_RMA_TURN``
        bytes of its reads (the post copies what completes in place), reap what
        completed, and report its share once nothing is left to claim and its own
        reads completed."""
        mine = read.mine
        if mine is None:
            return
        if read.error is not None or read.rx.state.final:
            read.shared.stop()  # nothing would count its pages: claim no more
        wh = self._worker.handle
        mine.step(wh, _RMA_TURN)
        if mine.drive(wh, 0 if mine.left == 0 else _RMA_ROUNDS) == 0 and mine.finished:
            read.mine = None
            self._rma_done(read, mine.posted, _pull_error(read.endpoint, mine))

    def _rma_reap(self) -> None:
        """Take a turn at the oldest *live* batch this thread still reads
        (``_rma_step``), and at every batch that is over for its transfer (failed,
        expired, aborted, or this thread's share failed: nothing more is claimed, only
        its reads under way are reaped); then land the batches every reader of which
        finished and acknowledge them. A failed read fails the transfer: its pages never
        count. Why not only the oldest: a batch whose transfer ended while its reads
        were under way (a producer that died or stopped) must never keep this thread
        from the later batches of other transfers ("Peer failures on shm")."""
        if self._ack_sends:
            self._ack_sends = [a for a in self._ack_sends if not a[0].completed]
        if not self._rma_reads:
            return
        live = False
        for r in self._rma_reads:
            mine = r.mine
            if mine is None:
                continue
            over = r.error is not None or r.rx.state.final or not mine.ok
            if over or not live:
                self._rma_step(r)
                live = live or not over
        still = []
        for r in self._rma_reads:
            if r.left:
                still.append(r)
                continue
            book = self._book
            error = None
            with book.cond:
                rx = r.rx
                if r.error is not None and not rx.state.final:
                    error = r.error
                    if r.posted < r.shared.total:
                        error += f" ({r.posted} of {r.shared.total} reads posted)"
                    book.fail(rx, error)
                elif rx.state.final:
                    error = f"transfer {rx.transfer_id} ended: {rx.error}"
                else:
                    book.landed(rx, r.group, r.pages, r.nbytes)
                rx.inflight -= 1
                book.maybe_finish(rx, rx.queued)
                book.cond.notify_all()
            self._rma_ack(r.endpoint, r.ack_tag, error)
        self._rma_reads = still

    def _rx_acks(self) -> None:
        """Producer: take arrived RMA acknowledgements (one masked probe each); an
        unknown one (forged, or for a push that already ended) is discarded."""
        worker = self._worker
        tag, mask = ucx_api.UCXXTag(_ACK_BIT), ucx_api.UCXXTagMask(_DATA_BIT | _ACK_BIT)
        while True:
            probe = worker.tag_probe(tag, mask, remove=True)
            if not probe.matched:
                return
            h = self._ack_wait.pop(int(probe.sender_tag.value), None)
            n = int(probe.length)
            if h is None or n < 1 or n > 4096:
                self._discard(probe)
                continue
            buf = np.empty(n, dtype=np.uint8)
            req = worker.tag_recv_with_handle(Array(buf), probe)
            while not req.completed:
                worker.progress()
            try:
                req.check_error()
            except Exception as exc:
                self._tx_fail(h, f"acknowledgement from {h.endpoint} failed: {exc}")
                continue
            h.acks.discard(int(probe.sender_tag.value))
            if buf[0] != 0:
                why = bytes(buf[1:]).decode(errors="replace")
                self._tx_fail(h, f"receiver {h.endpoint} failed the RMA batch: {why}")

    def _rma_reg(self, slab: np.ndarray, owner: torch.Tensor) -> ucx_rma.Registration:
        """The registration of a store slab (mapped on first use, kept: registered
        once; beyond ``_RMA_REGS`` slabs, the least recently used one no active push
        reads is unmapped)."""
        rows, stride = int(slab.shape[0]), int(slab.strides[0])
        base, length = int(slab.ctypes.data), (rows - 1) * stride + int(slab.shape[1])
        for got, _ in self._rma_alloc:  # a mapped store (register_source): kept, not LRU
            if got.address <= base and base + length <= got.address + got.length:
                return got
        key = (base, length)
        reg = self._rma_regs.pop(key, None)
        if reg is None:
            if len(self._rma_regs) >= _RMA_REGS:
                busy = {
                    int(e.slab.ctypes.data)
                    for h in self._tx_active
                    for e, _ in h.plan
                    if isinstance(e, RmaBatch)
                }
                for k in list(self._rma_regs):
                    if len(self._rma_regs) < _RMA_REGS:
                        break
                    if k[0] not in busy:
                        self._rma_regs.pop(k).close()
                        self.stats["rma_mem_unmap"] += 1
            reg = ucx_rma.register(self._ctx.handle, base, length, owner)
            self.stats["rma_mem_map"] += 1
        self._rma_regs[key] = reg  # most recently used last
        return reg

    def _rma_teardown(self) -> None:
        """Close: reads still in flight were cancelled with their endpoints (checked
        once here, freeing their requests); remote keys destroyed, slabs unmapped."""
        for r in self._rma_reads:
            r.shared.stop()  # readers claim nothing more
        for lane in self._lanes or ():
            lane.close()  # each lane ends its share, frees its keys, endpoints, worker
        self._lanes = []
        wh = self._worker.handle
        for r in self._rma_reads:
            if r.mine is not None and r.mine.drive(wh, 16):
                log.warning("closing with %d RMA reads still in flight", r.mine.left)
            with self._book.cond:
                r.rx.inflight -= 1
        self._rma_reads = []
        for key in list(self._rkeys):
            self._rkey_destroy(key)
        for reg in self._rma_regs.values():
            reg.close()
            self.stats["rma_mem_unmap"] += 1
        self._rma_regs.clear()
        # mapped stores: freed now where no tensor over them is left, else once the
        # last one is collected (the UCX context is kept alive for that unmap)
        kept = 0
        for reg, ref in self._rma_alloc:
            if ucx_rma.release_when_unused(reg, ref, self._ctx):
                self.stats["rma_mem_free"] += 1
            else:
                kept += 1
        if kept:
            log.info("UCX plane closed: %d mapped store(s) freed once their tensors go", kept)
        self._rma_alloc.clear()
        self._ack_wait.clear()

    def _rx_segments(self) -> None:
        """Post receives for announced segments whose messages have arrived: one masked
        probe per arrived message (never a probe per pending segment), headers first so
        a segment's header is always known when the segment is."""
        while self._held and self._post(*self._held[0]):
            self._held.popleft()
        worker = self._worker
        any_data, mask = ucx_api.UCXXTag(_DATA_BIT), ucx_api.UCXXTagMask(_DATA_BIT)
        while True:
            if self.tcp_iov_recvs:
                # look first (libucp, the message stays in UCX): a packed segment for
                # host slots is taken and received by _rx_iov; anything else by ucxx
                # below, through an exact-tag probe that takes this very message (the
                # first under its tag, as it is the first data message that arrived)
                seen = ucx_iov.probe_length(worker.handle, _DATA_BIT, _DATA_BIT)
                if seen is None:
                    return
                if self._rx_iov(*seen):
                    continue
                probe = worker.tag_probe(ucx_api.UCXXTag(seen[0]), remove=True)
            else:
                probe = worker.tag_probe(any_data, mask, remove=True)
            if not probe.matched:
                return
            pend = self._pending.pop(int(probe.sender_tag.value), None)
            if pend is None:  # a refused batch's payload, a stale or a foreign message
                self._discard(probe)
                continue
            if self._held or not self._post(probe, pend):
                self._held.append((probe, pend))  # the message waits in UCX for a buffer

    def _batch_iov(self, grp: Group, msg: m.PageBatch, slots: np.ndarray) -> np.ndarray | None:
        """The iov entries (``ucx_iov.page_iov``: [pages, regions, 2]) of an accepted
        batch's slots, in page order, when its group is host memory (else None: device
        slots keep the scratch path). One vectorised call per batch; each packed segment
        takes a view of its pages. ``slots``: the batch's slots, just checked against the
        group by the book (``accept_runs``): addresses are computed from checked slots only."""
        if any(r.tensor.device.type != "cpu" for r in grp.regions):
            return None
        if grp.page_bytes != msg.page_bytes:
            return None
        regions = [(r.tensor.data_ptr(), r.tensor.stride(0), r.size) for r in grp.regions]
        return ucx_iov.page_iov(regions, slots)

    def _rx_iov(self, tag: int, length: int) -> bool:
        """Receive an arrived data message (``tag``, ``length``: seen, not yet taken)
        straight into its slots when it is a segment with iov entries (``_batch_iov``) of
        a live transfer, with exactly the announced length: one iov receive
        (``ucx_iov.tag_recv_exact``), UCX unpacking each fragment into the rows (one user
        copy; no scratch, no scatter). False (nothing taken) for anything else, which
        ``_rx_segments`` hands to the ucxx path (scratch, in place, discard, or failing
        the transfer on a length mismatch).

        The slots were checked when the header was accepted, before this receive can be
        posted. Once posted, UCX cannot take it back (a matched receive is not
        cancellable: ``ucp_request_cancel`` only reaches receives still waiting for a
        match), so it counts in ``rx.inflight`` like any write into the regions:
        ``abort`` waits for it, and a transfer ends DONE only after it."""
        p = self._pending.get(tag)
        if p is None or p.iov is None or length != p.nbytes:
            return False
        book = self._book
        with book.cond:
            rx = p.rx
            if rx.state.final:
                return False  # discarded by the ucxx path
            buf = ucx_iov.IovBuf(p.iov, p.nbytes, p.owner)
            try:
                req = ucx_iov.tag_recv_exact(self._worker.handle, tag, buf)
            except Exception as exc:  # the message was taken: the transfer cannot end
                self._pending.pop(tag)
                rx.queued -= 1
                book.fail(rx, f"receive failed: {exc}")
                book.cond.notify_all()
                return True
            if req is None:  # not there after all (cannot happen on this thread)
                return False
            self._pending.pop(tag)
            rx.queued -= 1
            rx.inflight += 1
            self.stats["iov_recvs"] += 1
        self._rx_reqs.append((req, p, None, None))
        return True

    def _rx_one(self, tag: int) -> None:
        """Post the receive of one announced segment if its message has arrived (an
        exact-tag probe: nothing else is taken), so its transfer overlaps the decoding
        of the headers behind it."""
        if self._held:
            return
        probe = self._worker.tag_probe(ucx_api.UCXXTag(tag), remove=True)
        if not probe.matched:
            return
        pend = self._pending.pop(tag)
        if not self._post(probe, pend):
            self._held.append((probe, pend))

    def _post(self, probe: Any, p: _PendingSeg) -> bool:
        """Post the receive of an arrived segment (or discard it); False when it needs a
        scratch buffer and none is free."""
        book = self._book
        with book.cond:
            rx = p.rx
            live = not rx.state.final
            if live and int(probe.length) != p.nbytes:
                book.fail(
                    rx, f"segment of {probe.length} bytes where the batch announced {p.nbytes}"
                )
                live = False
            dst: Any = None
            pool: list[Any] | None = None
            if live:
                grp, dev = book.groups[p.group], self._gdev[p.group]
                start, count = p.seg.runs[0]
                if p.seg.direct and grp.direct is not None:  # host rows, in place
                    dst = grp.direct[start : start + count].reshape(-1)
                elif p.seg.direct and (ddst := self._gdirect[p.group]) is not None:
                    dst = ddst[start : start + count].reshape(-1)  # device rows, in place
                elif p.whole:
                    if dev is None:  # CUDA rows into host pages (staged by UCX): one-off
                        pool = []
                    else:
                        pool = self._big_pool(dev, p.nbytes)
                        if pool is None:
                            return False
                else:
                    pool = self._scratch_free if dev is None else self._dscratch[dev]
                    if not pool:
                        return False
            rx.queued -= 1
            if not live:
                self._discard(probe)
                book.cond.notify_all()
                return True
            scratch = None
            if pool is not None:
                scratch = pool.pop() if pool else np.empty(p.nbytes, dtype=np.uint8)
                dst = scratch[: p.nbytes]
            req = self._worker.tag_recv_with_handle(Array(dst), probe)
            rx.inflight += 1
        self._rx_reqs.append((req, p, scratch, pool))
        return True

    def _big_pool(self, dev: torch.device, nbytes: int) -> list[torch.Tensor] | None:
        """The free list of whole-batch device scratch with a buffer of at least
        ``nbytes`` at its end (allocated, or grown, while fewer than ``_BIG_BUFS`` exist
        or a free one is too small), or None when all are in use."""
        free = self._big_free.setdefault(dev, [])
        for i, b in enumerate(free):
            if b.numel() >= nbytes:
                free.append(free.pop(i))
                return free
        if free:  # too small: replace it with a bigger one
            free.pop(0)
            self._big_count[dev] -= 1
        if self._big_count[dev] >= _BIG_BUFS:
            return None
        size = -(-nbytes // _BIG_ALIGN) * _BIG_ALIGN
        free.append(torch.empty(size, dtype=torch.uint8, device=dev))
        self._big_count[dev] += 1
        return free

    def _sweep(self, now: float) -> None:
        """Deadlines; forget announced segments of transfers that ended (should their
        messages still come, they are discarded as unknown)."""
        book = self._book
        with book.cond:
            book.sweep(now)
            gone = [t for t, q in self._pending.items() if q.rx.state.final]
            for t in gone:
                self._pending.pop(t).rx.queued -= 1
            if gone:
                book.cond.notify_all()

    def _discard(self, probe: Any) -> None:
        """Receive a refused message somewhere harmless so it does not pile up (a
        longer one than SEG_BYTES ends truncated, which is as good)."""
        buf = np.empty(min(max(int(probe.length), 1), SEG_BYTES), dtype=np.uint8)
        self._discards.append((self._worker.tag_recv_with_handle(Array(buf), probe), buf))
        self.stats["discarded"] += 1

    def _rx_reap(self) -> None:
        if self._discards:
            self._discards = [d for d in self._discards if not d[0].completed]
        if not self._rx_reqs:
            return
        reqs, self._rx_reqs = self._rx_reqs, []
        still = self._rx_reqs  # receives posted below (into a freed scratch) join it
        for req, p, scratch, pool in reqs:
            if not req.completed:
                still.append((req, p, scratch, pool))
                continue
            try:
                req.check_error()
                err = None
            except Exception as exc:
                err = f"receive failed: {type(exc).__name__}: {exc}"
            book = self._book
            with book.cond:
                rx = p.rx
                if err is not None:
                    book.fail(rx, err)
                elif not rx.state.final:
                    if isinstance(scratch, torch.Tensor):  # lands when the scatter has
                        ev = self._scatter_dev(book.groups[p.group], p, scratch)
                        self._scatters.append(_Scatter(ev, p, scratch, pool))
                        continue
                    if scratch is not None:
                        _scatter_host(book.groups[p.group], p.seg, scratch[: p.nbytes])
                    book.landed(rx, p.group, p.seg.pages, p.nbytes)
                rx.inflight -= 1
                if pool is not None and scratch is not None:
                    pool.append(scratch)
                book.maybe_finish(rx, rx.queued)
                book.cond.notify_all()
            if self._held and isinstance(scratch, np.ndarray):
                # Hand the freed scratch to the next arrived segment (and let UCX send
                # its rendezvous reply) before scattering another one: the peer's copy
                # into it then runs while this thread scatters, instead of after.
                while self._held and self._post(*self._held[0]):
                    self._held.popleft()
                self._worker.progress()

    def _scatter_reap(self, block: bool) -> None:
        """Finish device scatters whose events have passed (all of them when ``block``:
        the thread is about to sleep, and a scatter does not wake it): their pages
        land, their scratch is free again."""
        book = self._book
        while self._scatters:
            s = self._scatters[0]
            if block:
                s.event.synchronize()
            elif not s.event.query():
                return
            self._scatters.popleft()
            with book.cond:
                rx = s.p.rx
                if not rx.state.final:
                    book.landed(rx, s.p.group, s.p.seg.pages, s.p.nbytes)
                rx.inflight -= 1
                s.pool.append(s.scratch)
                book.maybe_finish(rx, rx.queued)
                book.cond.notify_all()

    def _scatter_dev(self, grp: Group, p: _PendingSeg, scratch: torch.Tensor) -> Any:
        """Launch the scatter of a segment received into device scratch: one batched
        ``index_copy_`` over 8-byte elements per region (``scatter_rows``; a slice copy
        for a single run) on this plane's stream, the slot indices copied to the device
        once. Returns an event recorded after it: the scratch is reused and the pages
        count as landed only once it has passed (``_scatter_reap``), never a stream sync
        per segment."""
        dev = scratch.device
        stream = self._streams[dev]
        src = scratch[: p.nbytes].view(p.seg.pages, grp.page_bytes)
        runs = p.seg.runs
        with torch.cuda.stream(stream):
            slots: torch.Tensor
            if p.seg.direct:  # one run: a slice copy
                slots = torch.arange(runs[0][0], runs[0][0] + runs[0][1])
            else:
                host = p.slots if p.slots is not None else runs_slots(runs)
                slots = torch.from_numpy(host).to(dev, non_blocking=True)
            col = 0
            for region in grp.regions:
                scatter_rows(region.tensor, slots, src[:, col : col + region.size])
                col += region.size
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    # ----------------------------------- send -------------------------------------------
    def _close_ep(self, ep: Any) -> None:
        # Closing an endpoint that already failed crashes libucxx 0.52: drop it instead.
        try:
            if ep.alive:
                ep.close()
        except Exception:
            pass
        self._dead_eps.append(ep)  # destroyed with the worker, not mid-progress

    def _connect(self, endpoint: str) -> Any:
        ep = self._eps.get(endpoint)
        if ep is not None and ep.alive:
            return ep
        u = urlsplit(endpoint)
        if u.scheme == "ucx+tcp":
            ep = ucx_api.UCXEndpoint.create(self._worker, u.hostname or "127.0.0.1", u.port, True)
        else:
            addr = ucx_api.UCXAddress.create_from_buffer(
                bytes.fromhex(u.netloc or u.path.lstrip("/"))
            )
            ep = ucx_api.UCXEndpoint.create_from_worker_address(self._worker, addr, False)
        self._eps[endpoint] = ep
        return ep

    def _tx_start(self, h: PushHandle) -> None:
        if self._stop.is_set():
            h.state, h.error = TransferState.FAILED, "data plane closed"
            return
        h.state = TransferState.RECEIVING
        h.cma_seen = ucx_rma.cma_failures()[0]
        try:
            h.ep = self._connect(h.endpoint)
        except Exception as exc:
            self._tx_fail(h, f"send to {h.endpoint} failed: {type(exc).__name__}: {exc}")
            return
        self._tx_active.append(h)
        self._tx_pump(h)

    def _ring_take(self, nbytes: int, h: PushHandle) -> tuple[np.ndarray, bool] | None:
        """A send buffer for a gathered segment of ``h``: a free ring buffer, a new one
        while the ring has fewer than ``_SEND_BUFS`` (huge pages, prefaulted here once),
        else None while ``h`` has sends of its own in flight (it resumes when one
        completes). A push holding none gets a one-off buffer instead, dropped after its
        send: a peer that stopped reading (its pushes' sends never complete until their
        deadline) can hold the whole ring, and must not stall pushes to other peers.
        A segment bigger than ``SEG_BYTES`` (one page over 16 MiB) gets its own too."""
        if nbytes > SEG_BYTES:
            return np.empty(nbytes, dtype=np.uint8), False
        if self._ring_free:
            return self._ring_free.pop(), True
        if self._ring_count < _SEND_BUFS:
            buf = hostmem.empty(SEG_BYTES).numpy()
            buf.fill(0)  # fault it in now, not while gathering into it
            self._ring_count += 1
            self.stats["ucx_send_bufs"] += 1
            return buf, True
        if not h.ring:
            self.stats["ucx_send_bufs_one_off"] += 1
            return np.empty(nbytes, dtype=np.uint8), False
        return None

    def _tx_pump(self, h: PushHandle) -> bool:
        """Post ``h``'s messages in plan order from ``h.next``, stopping after one
        gathered segment (so the progress loop runs between gathers and the gather of
        segment k+1 overlaps the wire of segment k) or when the send ring is empty (the
        push resumes once a send completes, ``_tx_reap``). A gathered segment is gathered
        into its ring buffer right here, just before it is posted. Returns whether the
        push has more to post now."""
        if h.state.final:
            return False
        plan = h.plan
        try:
            ep = h.ep
            while h.next < len(plan):
                if h.rma and h.acks and h.next == len(plan) - 1:
                    return False  # TransferDone waits until every RMA batch was read
                buf, tag = plan[h.next]
                if isinstance(buf, RmaBatch):
                    reg = self._rma_reg(buf.slab, buf.owner)
                    frame = _rma_frame(
                        buf.transfer_id,
                        buf.lease_id,
                        buf.token,
                        buf.group,
                        buf.page_bytes,
                        buf.batch,
                        int(buf.slab.ctypes.data),  # inside reg (a mapped store may hold it)
                        int(buf.slab.shape[0]),
                        int(buf.slab.strides[0]),
                        int(buf.slab.shape[1]),
                        reg.rkey,
                        self._endpoint,
                        buf.cols,
                        buf.slots,
                        buf.rows,
                    )
                    if frame.size - 4 > _HDR_MAX:
                        raise ValueError(f"RMA header of {frame.size} bytes")
                    h.keep.append(frame)
                    h.requests.append(ep.tag_send(Array(frame), ucx_api.UCXXTag(tag)))
                    h.acks.add(buf.ack_tag)
                    self._ack_wait[buf.ack_tag] = h
                    h.nbytes += buf.nbytes
                    h.next += 1
                    continue
                if isinstance(buf, GatherSeg):
                    got = self._ring_take(buf.nbytes, h)
                    if got is None:
                        return False
                    out, pooled = got
                    msg = out[: buf.nbytes]
                    try:
                        buf.gather_into(msg)
                        req = ep.tag_send(Array(msg), ucx_api.UCXXTag(tag))
                    except BaseException:
                        if pooled:
                            self._ring_free.append(out)  # never handed to UCX
                        raise
                    h.ring.append((req, out, pooled))
                    h.requests.append(req)
                    h.nbytes += buf.nbytes
                    h.next += 1
                    return h.next < len(plan) and self._ring_ready()
                if isinstance(buf, ucx_iov.IovBuf):  # scattered store rows, sent in place
                    h.requests.append(ucx_iov.tag_send(ep.handle, buf, tag))
                    self.stats["iov_sends"] += 1
                else:
                    h.requests.append(ep.tag_send(Array(buf), ucx_api.UCXXTag(tag)))
                if tag & _DATA_BIT:
                    h.nbytes += buf.nbytes
                h.next += 1
        except Exception as exc:
            self._tx_fail(h, f"send to {h.endpoint} failed: {type(exc).__name__}: {exc}")
        return False

    def _ring_ready(self) -> bool:
        return bool(self._ring_free) or self._ring_count < _SEND_BUFS

    def _ring_recycle(self, h: PushHandle) -> None:
        """Ring buffers of ``h`` whose sends completed (UCX no longer reads them) go
        back to the ring."""
        still = []
        for item in h.ring:
            req, buf, pooled = item
            if not req.completed:
                still.append(item)
            elif pooled:
                self._ring_free.append(buf)
        h.ring = still

    def _tx_fail(self, h: PushHandle, why: str) -> None:
        if h.state.final:
            return
        h.state, h.error = TransferState.FAILED, why
        self.stats["push_failed"] += 1
        for tag in h.acks:  # acknowledgements still to come are discarded as unknown
            self._ack_wait.pop(tag, None)
        h.acks = set()
        ep = self._eps.pop(h.endpoint, None)
        if ep is not None:
            self._close_ep(ep)  # cancels what is still queued for this peer
        # Send buffers UCX may still read (their requests not seen complete) leave the
        # ring: never reused, kept alive until they complete (_tx_reap); the ring may
        # allocate replacements meanwhile.
        for req, buf, pooled in h.ring:
            if req.completed:
                if pooled:
                    self._ring_free.append(buf)
            else:
                self._ring_zombies.append((req, buf, pooled))
                if pooled:
                    self._ring_count -= 1
        h.ring = []
        # Scatter-gather sends are ours to free, and UCX reads their iov arrays until they
        # complete (cancelled with the ep): keep them until then (_tx_reap).
        self._raw_zombies.extend(
            r for r in h.requests if isinstance(r, ucx_iov.RawRequest) and not r.completed
        )
        # Only now may the caller reuse the rows: requests were cancelled with the ep.
        h.plan, h.keep, h.requests = [], [], []

    def _tx_reap(self) -> bool:
        """Reap completed sends, recycle send buffers, finish or fail pushes, and post
        what waited for a send buffer. Returns whether a push can post more right away
        (the loop must not sleep then)."""
        if self._raw_zombies:
            self._raw_zombies = [r for r in self._raw_zombies if not r.completed]
        if self._ring_zombies:
            left = []
            for item in self._ring_zombies:
                req, buf, pooled = item
                if not req.completed:
                    left.append(item)
                elif pooled and self._ring_count < _SEND_BUFS:  # UCX is done with it
                    self._ring_free.append(buf)
                    self._ring_count += 1
            self._ring_zombies = left
        if not self._tx_active:
            return False
        for h in self._tx_active:
            if h.ring:
                self._ring_recycle(h)
        more = False
        for h in self._tx_active:
            if h.next < len(h.plan) and (self._ring_ready() or not h.ring):
                more = self._tx_pump(h) or more
        now = time.monotonic()
        still = []
        for h in self._tx_active:
            if h.state.final:  # failed while posting
                continue
            err = None
            pending = []
            for r in h.requests:
                if r.completed:
                    try:
                        r.check_error()
                    except Exception as exc:
                        err = f"send to {h.endpoint} failed: {type(exc).__name__}: {exc}"
                        err += _cma_note(h.cma_seen)
                        break
                else:
                    pending.append(r)
            if err is not None:
                self._tx_fail(h, err)
            elif not pending and h.next >= len(h.plan):
                h.state = TransferState.DONE
                h.plan, h.keep, h.requests = [], [], []
                self.stats["push_done"] += 1
            elif now > h.deadline:
                self._tx_fail(h, f"peer {h.endpoint} did not take the data before the deadline")
            else:
                h.requests = pending
                still.append(h)
        self._tx_active = still
        return more


def _batches(
    dst: np.ndarray, idx: np.ndarray, pb: int, max_pages: int | None = None
) -> list[tuple[list[tuple[int, int]], np.ndarray]]:
    """Cut a group's pages (destination slots ``dst``, source rows ``idx``, both in page
    order, ``idx`` increasing) into batches: runs where slots and rows are both adjacent,
    up to ``RUNS_PER_BATCH`` runs and ``BATCH_BYTES`` per batch (a run splits at the
    byte limit; and at ``max_pages`` pages when given). Vectorised: a Python step per
    batch, none per run or page. Returns (runs, source row of each page) per batch."""
    brk = np.flatnonzero((np.diff(dst) != 1) | (np.diff(idx) != 1)) + 1
    starts = np.concatenate(([0], brk))
    counts = np.diff(np.concatenate((starts, [idx.size])))
    ends = np.cumsum(counts)  # page index just past each run
    run_dst = dst[starts]
    per_batch = max(1, BATCH_BYTES // pb)
    if max_pages is not None:
        per_batch = min(per_batch, max_pages)
    total = int(idx.size)
    out = []
    page = r = off = 0  # next page; its run; pages of that run already sent
    while page < total:
        end = min(page + per_batch, total)
        r_end = int(np.searchsorted(ends, end, side="left"))  # run holding page end-1
        r_last = min(r_end, r + RUNS_PER_BATCH - 1)
        if r_last < r_end:
            end = int(ends[r_last])  # the run limit ends the batch first
        b_dst = run_dst[r : r_last + 1].copy()
        b_cnt = counts[r : r_last + 1].copy()
        b_dst[0] += off
        b_cnt[0] -= off
        b_cnt[-1] -= int(ends[r_last]) - end
        # tuples, not ``tolist()``'s [dst, count] lists: the collector untracks a tuple of
        # ints the first time it sees it, a list it tracks for good. A push of scattered
        # pages has ~one run per page alive through planning, and lists were promoted
        # into the old generation by the thousand: a full collection of the whole
        # process (~60 ms here) every ~65536 pages, inside ``post_push`` (session 12)
        runs = list(zip(b_dst.tolist(), b_cnt.tolist(), strict=True))
        out.append((runs, idx[page:end]))
        if int(ends[r_last]) == end:
            r, off = r_last + 1, 0
        else:
            r, off = r_last, end - (int(ends[r_last]) - int(counts[r_last]))
        page = end
    return out


def _plan_group(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    rows: torch.Tensor | StoreRows,
    dst_slots: Sequence[int],
    seq: int,
    keep: list[object],
    direct_min: int = DIRECT_MIN,
    hdr_tag: int = _HDR_TAG,
    iov: bool = False,
    seg_bytes: int = SEG_BYTES,
) -> tuple[list[tuple[Any, int]], int, int]:
    """One group's messages: batches of runs (``_batches``). Host rows: each batch cut
    into segments (``segments``), a segment whose source rows are not one range gathered
    with numpy into a send buffer of the ring right before it is posted (``GatherSeg``). CUDA rows (whole mode, header under ``_HDR_WHOLE_TAG``): each batch
    is one message, its rows gathered with one batched ``index_select`` on the device
    (or sent in place when they are one range). ``StoreRows`` of a host slab (the
    caller checked ``ucx_iov.available()``): a segment whose pages are not one range of
    the slab goes as one scatter-gather message (``ucx_iov.IovBuf``) from the rows where
    they lie, the same bytes a gather would have sent. Returns (messages, pages, next
    seq)."""
    key = _tag_key(token)
    slots = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    if isinstance(rows, StoreRows):
        return _plan_store_rows(
            transfer_id,
            lease_id,
            token,
            group,
            rows,
            slots,
            seq,
            keep,
            direct_min,
            hdr_tag,
            iov,
            seg_bytes,
        )
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[0] != slots.shape[0]:
        raise ValueError(
            f"group {group}: rows must be uint8 [len(dst_slots)={slots.shape[0]}, page_bytes], "
            f"got {rows.dtype} {tuple(rows.shape)}"
        )
    if (slots < -1).any():
        raise ValueError(f"group {group}: destination slots must be >= -1")
    arr: Any
    whole = rows.device.type == "cuda"
    if whole:
        arr = rows.contiguous()  # stays on the device; sent from there
    else:
        arr = rows.cpu().contiguous().numpy()
    keep.append(arr)
    pb = int(arr.shape[1])
    if pb < 1:
        raise ValueError(f"group {group}: page_bytes must be >= 1")
    pages, batches = _headed_batches(transfer_id, lease_id, token, group, slots, pb)
    if not pages:
        return [], 0, seq
    msgs: list[tuple[Any, int]] = []
    for header, runs, page_src in batches:
        if whole:
            msgs.append((_frame(header), _HDR_WHOLE_TAG))
            r0, n = int(page_src[0]), int(page_src.size)
            if int(page_src[-1]) - r0 + 1 == n:  # one source range: zero copy
                buf = arr[r0 : r0 + n].reshape(-1)
            else:
                ridx = torch.from_numpy(page_src).to(arr.device)
                buf = gather_rows(arr, ridx).reshape(-1)
                keep.append(buf)
            msgs.append((buf, _data_tag(key, transfer_id, seq)))
            seq += 1
            continue
        msgs.append((_frame(header), hdr_tag))
        for seg in segments(runs, pb, direct_min, seg_bytes):
            rows_of = page_src[seg.first : seg.first + seg.pages]
            r0 = int(rows_of[0])
            if int(rows_of[-1]) - r0 + 1 == seg.pages:  # one source range: zero copy
                buf = arr[r0 : r0 + seg.pages].reshape(-1)
            else:  # gathered into a send buffer right before it is posted
                buf = GatherSeg(arr, rows_of, ((0, pb),), seg.pages * pb)
            msgs.append((buf, _data_tag(key, transfer_id, seq)))
            seq += 1
    return msgs, pages, seq


def _headed_batches(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    slots: np.ndarray,
    pb: int,
    max_pages: int | None = None,
) -> tuple[int, list[tuple[m.PageBatch, list[tuple[int, int]], np.ndarray]]]:
    """The pages to send (slots >= 0, -1 skipped) cut into ``_batches``, each with its
    PageBatch header: (pages, [(header, runs, source page index of each page)])."""
    idx = np.flatnonzero(slots >= 0)
    if idx.size == 0:
        return 0, []
    out = []
    for runs, page_src in _batches(slots[idx], idx, pb, max_pages):
        header = m.PageBatch(
            transfer_id=transfer_id,
            lease_id=lease_id,
            token=token,
            group=group,
            runs=runs,
            page_bytes=pb,
        )
        out.append((header, runs, page_src))
    return int(idx.size), out


def _store_plan_source(
    group: int, src: StoreRows, slots: np.ndarray, keep: list[object]
) -> tuple[np.ndarray, np.ndarray, tuple[tuple[int, int], ...], int]:
    """``_store_source`` for a push being planned: also checks the destination slots and
    keeps the slab alive until the push's messages are sent."""
    slab, srows, cols, pb = _store_source(group, src, int(slots.shape[0]))
    if (slots < -1).any():
        raise ValueError(f"group {group}: destination slots must be >= -1")
    keep.append(slab)
    return slab, srows, cols, pb


def _store_source(
    group: int, src: StoreRows, n: int
) -> tuple[np.ndarray, np.ndarray, tuple[tuple[int, int], ...], int]:
    """``(slab as numpy, rows, cols, page_bytes)`` of a host StoreRows push source,
    checked: a 2-D uint8 slab with contiguous rows, ``n`` rows inside it, columns inside
    a row."""
    slab = src.slab
    if slab.dtype != torch.uint8 or slab.dim() != 2 or slab.device.type != "cpu":
        raise ValueError(
            f"group {group}: the source slab must be a 2-D uint8 host tensor, got "
            f"{slab.dtype} {tuple(slab.shape)} on {slab.device}"
        )
    if slab.shape[1] > 1 and slab.stride(1) != 1:
        raise ValueError(f"group {group}: the source slab's rows must be contiguous")
    rows, cols = check_store_rows(group, src, n, int(slab.shape[1]))
    return slab.numpy(), rows, cols, sum(c for _, c in cols)


def _plan_store_rows(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    src: StoreRows,
    slots: np.ndarray,
    seq: int,
    keep: list[object],
    direct_min: int,
    hdr_tag: int,
    iov_sends: bool,
    seg_bytes: int = SEG_BYTES,
) -> tuple[list[tuple[Any, int]], int, int]:
    """``_plan_group`` for StoreRows of a host slab: the same batches, headers and
    segments as for the gathered pages (the receiver cannot tell), each segment sent
    from the slab: a plain view when its pages are one span of it, else an iov of the
    spans (``ucx_iov.iov_entries``: adjacent rows merged)."""
    slab, srows, cols, pb = _store_plan_source(group, src, slots, keep)
    pages, batches = _headed_batches(transfer_id, lease_id, token, group, slots, pb)
    if not pages:
        return [], 0, seq
    key = _tag_key(token)
    base, stride = int(slab.ctypes.data), int(slab.strides[0])
    flat = slab.reshape(-1) if slab.flags.c_contiguous else None
    msgs: list[tuple[Any, int]] = []
    for header, runs, page_src in batches:
        msgs.append((_frame(header), hdr_tag))
        for seg in segments(runs, pb, direct_min, seg_bytes):
            rows_of = srows[page_src[seg.first : seg.first + seg.pages]]
            iov = ucx_iov.iov_entries(base, stride, rows_of, cols)
            buf: Any
            if iov.shape[0] == 1 and flat is not None:  # one span of the slab: a view
                start = int(iov[0, 0]) - base
                buf = flat[start : start + int(iov[0, 1])]
            elif iov_sends:
                buf = ucx_iov.IovBuf(iov, seg.pages * pb, slab)
            else:  # gathered into a send buffer right before it is posted
                buf = GatherSeg(slab, rows_of, cols, seg.pages * pb)
            msgs.append((buf, _data_tag(key, transfer_id, seq)))
            seq += 1
    return msgs, pages, seq


def _rma_cuts(pages: int, page_bytes: int, first: bool) -> list[int]:
    """Where a group's ``pages`` pages are cut into RMA batches (the end of each):
    at most ``_RMA_MAX_PAGES`` pages and ``BATCH_BYTES`` per batch (at least a page);
    the push's ``first`` batch ``_RMA_FIRST_PAGES`` pages, each next one ``_RMA_RAMP``
    times the one before ("Batches of an RMA push")."""
    cap = max(1, min(_RMA_MAX_PAGES, BATCH_BYTES // page_bytes))
    size = min(cap, _RMA_FIRST_PAGES) if first else cap
    ends = []
    at = 0
    while at < pages:
        at = min(pages, at + size)
        ends.append(at)
        size = min(cap, size * _RMA_RAMP)
    return ends


def _plan_rma(
    transfer_id: int,
    lease_id: int,
    token: bytes,
    group: int,
    src: StoreRows,
    dst_slots: Sequence[int],
    batch: int,
    keep: list[object],
) -> tuple[list[tuple[Any, int]], int, int]:
    """``_plan_group`` for StoreRows of a host slab sent to a receiver that reads them
    itself (RMA): the pages to send (slots >= 0) in page order, cut into batches
    (``_rma_cuts``), each an ``RmaBatch`` (framed with the slab's registration when
    posted) naming the destination slot and slab row of every page; no payload
    messages. ``batch`` numbers the push's RMA batches (their acknowledgement tags;
    0: this is the push's first, a small one). Vectorised: a Python step per batch.
    Returns (messages, pages, next batch number)."""
    slots = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    slab, srows, cols, pb = _store_plan_source(group, src, slots, keep)
    idx = np.flatnonzero(slots >= 0)
    if idx.size == 0:
        return [], 0, batch
    key = _tag_key(token)
    dst, rows = slots[idx], srows[idx]
    msgs: list[tuple[Any, int]] = []
    start = 0
    for end in _rma_cuts(int(idx.size), pb, batch == 0):
        rb = RmaBatch(
            transfer_id,
            lease_id,
            token,
            group,
            pb,
            slab,
            src.slab,
            dst[start:end],
            rows[start:end],
            cols,
            batch,
            _ack_tag(key, transfer_id, batch),
            (end - start) * pb,
        )
        msgs.append((rb, _HDR_RMA_TAG))
        batch += 1
        start = end
    return msgs, int(idx.size), batch


@dataclass(frozen=True)
class GatherSeg:
    """A payload message whose pages are scattered rows of a host array (``slab``:
    2-D uint8, rows checked to lie inside it), each page the concatenation of column
    spans ``cols``: gathered by the progress thread into a send buffer of the ring just
    before it is posted (``UcxDataPlane._tx_pump``), so the bytes are read from the
    slab then, not when the push is planned."""

    slab: np.ndarray
    rows: np.ndarray
    cols: tuple[tuple[int, int], ...]
    nbytes: int

    def gather_into(self, out: np.ndarray) -> None:
        """Write the packed pages into ``out`` (uint8, ``nbytes`` long, contiguous):
        whole rows with the C row copy where it is built (one memcpy per row, GIL
        released, every row checked against the slab again; "Segments over tcp"), else
        ``gather_pages`` (numpy)."""
        rc = page_copy._rowcopy
        slab = self.slab
        pb = int(slab.shape[1])
        if rc is not None and self.cols == ((0, pb),) and slab.strides[1] == 1:
            n = int(self.rows.shape[0])
            if out.shape[0] != n * pb:
                raise ValueError(f"send buffer of {out.shape[0]} bytes for {n} pages of {pb}")
            rows = np.ascontiguousarray(self.rows, dtype=np.int64)
            rc.copy_rows(
                out.ctypes.data, n, pb, slab.ctypes.data, int(slab.shape[0]),
                int(slab.strides[0]), pb, rows, _arange(n), 1,
            )  # fmt: skip
            return
        gather_pages(out, slab, self.rows, self.cols)
