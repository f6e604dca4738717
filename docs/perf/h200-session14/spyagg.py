"""Session 14: aggregate py-spy raw stacks (t12.sh: 1200 back-to-back 1 GiB pushes of 64 KiB
pages) by the frames under an anchor function. usage: python spyagg.py spy.txt"""
import collections
import re
import sys


def agg(path, who, anchor, depth, top=12):
    c, tot = collections.Counter(), 0
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        if not any(who in f for f in frames[:3]):
            continue
        names = [re.sub(r" \((?:.*/)?([^/]*)\)$", r" [\1]", x) for x in frames]
        idx = [k for k, x in enumerate(names) if x.startswith(anchor)]
        if not idx:
            continue
        tot += int(n)
        c[" > ".join(names[idx[-1] + 1 : idx[-1] + 1 + depth])] += int(n)
    print(f"== {who}: samples under {anchor}: {tot}")
    for k, v in c.most_common(top):
        print(f"{v:6d} {100 * v / max(tot, 1):5.1f}% {k}")


p = sys.argv[1]
agg(p, "disagg-ipc-rx", "IpcDataPlane._rx_run", 2)
agg(p, "disagg-ipc-rx", "IpcDataPlane._rx_push", 1)
agg(p, "disagg-ipc-rx", "IpcDataPlane._plan", 1)
agg(p, "disagg-ipc-rx", "_copy", 1)
agg(p, "process 2038", "IpcDataPlane.post_push", 1)
agg(p, "process 2038", "IpcDataPlane._tx_run", 1, 4)
