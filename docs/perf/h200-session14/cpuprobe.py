"""Session 14: are some vCPUs slow, or pairs of vCPUs host hyperthread siblings?
Solo: a fixed Python loop pinned to each vCPU (twice). Pairs: the loop on vCPU 0 while
another pinned process spins on vCPU j: slowdown of cpu0's loop per j."""
import os, sys, time, multiprocessing as mp

def loop(n=300000):
    x = 0
    for i in range(n):
        x += i * i % 7
    return x

def timed(cpu, reps=5):
    os.sched_setaffinity(0, {cpu})
    best = []
    for _ in range(reps):
        t = time.perf_counter(); loop(); best.append(time.perf_counter() - t)
    return min(best), sorted(best)[len(best)//2]

def spinner(cpu, stop):
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        loop(20000)

def main():
    ncpu = os.cpu_count()
    for r in range(2):
        print("solo ms (min/median) per cpu:", " ".join(f"{c}:{1e3*timed(c)[0]:.1f}/{1e3*timed(c)[1]:.1f}" for c in range(ncpu)))
    for base in (0, 5):
        alone = timed(base, 7)[1]
        out = []
        for j in range(ncpu):
            if j == base: continue
            stop = mp.Event(); p = mp.Process(target=spinner, args=(j, stop)); p.start(); time.sleep(0.05)
            t = timed(base, 7)[1]
            stop.set(); p.join()
            out.append(f"{j}:{t/alone:.2f}")
        print(f"cpu{base} slowdown with a spinner on:", " ".join(out))

if __name__ == "__main__":
    main()
