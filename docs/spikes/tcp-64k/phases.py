"""Session 13: zloop.py in zmq mode with the consumer's receiver thread timed per batch
(prefix wait, header read, Python before the payload, payload, after). usage: phases.py PAGE
ROUNDS (env DISAGG_STREAM_TCP_MSG_BYTES picks the batch size)."""
import sys, time, statistics as st, runpy, threading
sys.argv = ["zloop.py", sys.argv[1], sys.argv[2], "zmq"]
sys.path.insert(0, __file__.rsplit("/docs/", 1)[0])
from disagg.transport import zmq_plane as zp
T = []
cur = {}
orig_rx = zp.ZmqDataPlane._rx_message
orig_pay = zp.ZmqDataPlane._recv_payload
orig_read = zp.ZmqDataPlane._read
def rd(self, conn, n, *a, **k):
    r = orig_read(self, conn, n, *a, **k)
    cur.setdefault("reads", []).append(time.perf_counter())
    return r
def rx(self, conn):
    cur.clear()
    import socket as _s
    if len(T) % 100 == 5:
        print("rcvbuf", conn.sock.getsockopt(_s.SOL_SOCKET, _s.SO_RCVBUF), flush=True)
    t0 = time.perf_counter(); c0 = time.thread_time()
    r = orig_rx(self, conn)
    if "p0" in cur:
        T.append((t0, *cur["reads"], cur["p0"], cur["p1"], time.perf_counter(), time.thread_time() - c0))
    return r
def pay(self, *a):
    cur["p0"] = time.perf_counter()
    r = orig_pay(self, *a)
    cur["p1"] = time.perf_counter()
    return r
zp.ZmqDataPlane._rx_message = rx
zp.ZmqDataPlane._recv_payload = pay
zp.ZmqDataPlane._read = rd
import atexit
def report():
    rows = [t for t in T if len(t) == 7]
    print("batches", len(rows), "of", len(T))
    def med(f): 
        v = sorted(f(t) for t in rows); return f"{v[len(v)//2]*1e6:.0f} (p10 {v[len(v)//10]*1e6:.0f} p90 {v[9*len(v)//10]*1e6:.0f})"
    print("prefix wait", med(lambda t: t[1]-t[0]))
    print("header read", med(lambda t: t[2]-t[1]))
    print("python before payload", med(lambda t: t[3]-t[2]))
    print("payload", med(lambda t: t[4]-t[3]))
    print("after payload", med(lambda t: t[5]-t[4]))
    print("cpu per batch", med(lambda t: t[6]))
atexit.register(report)
runpy.run_path(__file__.rsplit("/", 1)[0] + "/zloop.py", run_name="__main__")
