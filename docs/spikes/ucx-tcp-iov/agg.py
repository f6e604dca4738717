import glob, os, re, sys, statistics as st, collections
d = collections.defaultdict(lambda: collections.defaultdict(list))
pat = sys.argv[1] if len(sys.argv) > 1 else "*"
for f in sorted(glob.glob(os.path.join(sys.argv[2] if len(sys.argv) > 2 else "/tmp/ucx-tcp-iov", f"{pat}.txt"))):
    v = f.split("/")[-1].split(".")[0]
    for line in open(f):
        m = re.match(r"ucx\s+tcp\s+(\S+)\s+([\d.]+)\s+raw_tcp\s+([\d.]+)\s+([\d.]+)", line)
        if m:
            d[v][m[1]].append((float(m[2]), float(m[4]), float(m[3])))
for v in d:
    out = []
    for p in ("64KiB", "256KiB", "1MiB"):
        xs = d[v][p]
        g = [x[0] for x in xs]; r = [x[1] for x in xs]; c = [x[2] for x in xs]
        out.append(f"{p}: {st.median(g):.2f} [{min(g):.2f}-{max(g):.2f}] r {st.median(r):.2f} [{min(r):.2f}-{max(r):.2f}] (ceil med {st.median(c):.2f})")
    print(f"{v:6s} n={len(d[v]['64KiB'])} | " + " | ".join(out))
