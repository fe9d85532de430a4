#!/usr/bin/env python3
"""Load check of a TLS + token cluster (not CI): starts specd-verify, specd-draft and
specd-router from the build on loopback (random-weight model, mutual TLS router -> services,
TLS + bearer token on the public port), runs `--streams` concurrent greedy Generate streams
through the Python SDK for `--seconds`, and reports completed requests, errors and tokens/s.

Memory: the RSS (and thread count) of every service is sampled each `--sample-seconds` from
before the load to its end. The load is cut in thirds. The first is the warm-up, left out of
every verdict: connections, TLS sessions, HTTP/2 and stream buffers, and the threads the gRPC
server starts under load (each with its stack, and in glibc possibly its own malloc arena) all
grow then, once. In the middle and the last third, the rise is the median RSS of the third's
last quarter minus that of its first quarter (medians, so that one noisy sample moves nothing);
it counts when it is above 0.1 % of the RSS per minute of the third. A service is "flat" when
neither third rises, "one rise" when exactly one does (a single allocation of a buffer or an
arena, or a warm-up that ends after the first third: not growth; its size is in the table), and
"grows" when both do: steady growth shows in every stretch of a run, a step in one. A leak that
starts only in the last third reads as one rise; a longer run tells them apart. The table also
gives the least-squares slope over the two thirds with its standard
error. The script fails (exit 1) on any error or any growing service. `--json` writes the
samples and the table, `--plot` a PNG of RSS and threads over time (matplotlib). Certificates
are made with openssl in a temporary folder.

  SPECD_BIN_DIR=build/bin SPECD_RANDOM_MODEL=build/tests/specd_write_random_model \\
      PYTHONPATH=clients/python:tests/deploy python3 bench/tls_load_check.py --streams 256 \\
      --seconds 180 --json bench/results/tls_load_256.json --plot bench/results/tls_load_256.png
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import specd
import specd_cluster


def certificates(d):
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*a):
        subprocess.run(a, check=True, capture_output=True)
    run("openssl", "req", "-x509", *key, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem",
        "-days", "2", "-subj", "/CN=bench-ca", "-addext", "basicConstraints=critical,CA:TRUE")
    for name, ext in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
                      ("client", "extendedKeyUsage=clientAuth")):
        with open(f"{d}/{name}.ext", "w") as f:
            f.write(ext + "\n")
        run("openssl", "req", *key, "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr",
            "-subj", f"/CN={name}")
        run("openssl", "x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/ca.pem",
            "-CAkey", f"{d}/ca.key", "-CAcreateserial", "-days", "2", "-out",
            f"{d}/{name}.pem", "-extfile", f"{d}/{name}.ext")
    with open(f"{d}/ca.pem", "rb") as f:
        return f.read()


def rss_kib_and_threads(pid):
    rss, threads = 0, 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss, threads


def slope(points):
    """Least-squares slope (KiB/s) of [(t, kib)] and its standard error."""
    n = len(points)
    if n < 3:
        return 0.0, float("inf")
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    sxx = sum((t - mt) ** 2 for t, _ in points)
    if sxx == 0:
        return 0.0, float("inf")
    b = sum((t - mt) * (v - mv) for t, v in points) / sxx
    a = mv - b * mt
    residual = sum((v - (a + b * t)) ** 2 for t, v in points) / (n - 2)
    return b, math.sqrt(residual / sxx)


def thirds(load_start, load_end):
    """(start, end) of the warm-up, middle and last thirds of the load."""
    third = (load_end - load_start) / 3
    return [(load_start + i * third, load_start + (i + 1) * third) for i in range(3)]


def rise(series, start, end):
    """Median RSS (KiB) of the last quarter of [start, end] minus that of its first quarter."""
    quarter = (end - start) / 4
    first = [v for t, v in series if start <= t <= start + quarter]
    last = [v for t, v in series if end - quarter <= t <= end]
    if not first or not last:
        return 0.0
    return statistics.median(last) - statistics.median(first)


def memory_table(samples, threads, idle, load_start, load_end):
    """Per service: idle RSS, RSS at the end of the warm-up and at the end, the rise of the
    middle and the last third, the slope over both, threads, and the verdict."""
    (_, warm_end), middle, last = thirds(load_start, load_end)
    rows = []
    for name, series in samples.items():
        after = [(t, v) for t, v in series if warm_end <= t <= load_end]
        b, se = slope(after)
        end = after[-1][1] if after else 0
        # 0.1 % of the RSS per minute, over one third.
        limit = 0.001 * max(end, 1) * (middle[1] - middle[0]) / 60
        rises = [rise(series, *middle), rise(series, *last)]
        up = [r > limit for r in rises]
        verdict = "grows" if all(up) else "one rise" if any(up) else "flat"
        th = [(t, n) for t, n in threads[name] if warm_end <= t <= load_end]
        rows.append({"service": name, "idle_kib": idle[name],
                     "warmed_up_kib": after[0][1] if after else 0, "end_kib": end,
                     "middle_rise_kib": rises[0], "last_rise_kib": rises[1],
                     "rise_limit_kib": limit, "slope_kib_per_min": b * 60,
                     "stderr_kib_per_min": se * 60, "samples": len(after),
                     "threads_warmed_up": th[0][1] if th else 0,
                     "threads_end": th[-1][1] if th else 0,
                     "threads_max": max((n for _, n in threads[name]), default=0),
                     "verdict": verdict, "grows": verdict == "grows"})
    return rows


def plot(path, samples, threads, load_start, load_end, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, tx) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 1]})
    for name, series in samples.items():
        ax.plot([t for t, _ in series], [v / 1024 for _, v in series], label=name)
        tx.plot([t for t, _ in threads[name]], [n for _, n in threads[name]], label=name)
    for a in (ax, tx):
        for (start, end), shade in zip(thirds(load_start, load_end), ("0.95", "0.88", "0.8")):
            a.axvspan(start, end, color=shade)
    ax.text(0.01, 0.02, "thirds of the load: warm-up (left out), middle, last",
            transform=ax.transAxes, fontsize=8)
    tx.set_xlabel("seconds since the cluster started serving")
    ax.set_ylabel("RSS (MiB)")
    tx.set_ylabel("threads")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sample-seconds", type=float, default=1.0)
    ap.add_argument("--json", help="write samples and the memory table here")
    ap.add_argument("--plot", help="write a PNG of RSS over time here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ca = certificates(d)
        with open(f"{d}/tokens", "w") as f:
            f.write("bench-token\n")
        tls = [f"--tls_cert={d}/server.pem", f"--tls_key={d}/server.key"]
        c = specd_cluster.Cluster(
            router_args=tls + [f"--token_file={d}/tokens", f"--upstream_tls_ca={d}/ca.pem",
                               f"--upstream_tls_cert={d}/client.pem",
                               f"--upstream_tls_key={d}/client.key",
                               f"--max_queue={args.streams * 2}"],
            router_root_certificates=ca,
            service_args=tls + [f"--tls_client_ca={d}/ca.pem"],
            service_root_certificates=ca, service_client_pair=(f"{d}/client.key",
                                                               f"{d}/client.pem"))
        with c:
            pids = {n: c.procs[n].pid for n in ("specd-router", "specd-draft", "specd-verify")}
            t0 = time.monotonic()
            samples = {n: [] for n in pids}
            threads = {n: [] for n in pids}
            sampling = threading.Event()

            def sample_rss():
                while not sampling.is_set():
                    now = time.monotonic() - t0
                    for n, pid in pids.items():
                        rss, count = rss_kib_and_threads(pid)
                        samples[n].append((now, rss))
                        threads[n].append((now, count))
                    sampling.wait(args.sample_seconds)
            sampler = threading.Thread(target=sample_rss)
            sampler.start()
            time.sleep(3 * args.sample_seconds)  # idle samples before the load
            idle = {n: s[-1][1] for n, s in samples.items()}
            load_start = time.monotonic() - t0
            stop = time.monotonic() + args.seconds
            done, errors, tokens, latencies = [0], [], [0], []
            lock = threading.Lock()

            def worker(i):
                with specd.Client(c.address, tls=specd.TLS(root_certificates=ca), timeout=120,
                                  metadata={"authorization": "Bearer bench-token"}) as client:
                    n = 0
                    while time.monotonic() < stop:
                        t1 = time.monotonic()
                        try:
                            r = client.generate(f"def f{i}_{n}(x):", temperature=0,
                                                max_new_tokens=args.max_new_tokens,
                                                ignore_eos=True)
                            with lock:
                                done[0] += 1
                                tokens[0] += len(r.token_ids)
                                latencies.append(time.monotonic() - t1)
                        except specd.SpecdError as e:
                            with lock:
                                errors.append(str(e))
                        n += 1
            start = time.monotonic()
            workers = [threading.Thread(target=worker, args=(i,)) for i in range(args.streams)]
            for t in workers:
                t.start()
            for t in workers:
                t.join()
            wall = time.monotonic() - start
            # The requests running at `stop` end a little later; the slope window ends at the
            # last of them.
            load_end = time.monotonic() - t0
            sampling.set()
            sampler.join()
        rows = memory_table(samples, threads, idle, load_start, load_end)
        print(f"streams={args.streams} seconds={wall:.1f} requests={done[0]} "
              f"errors={len(errors)} tokens/s={tokens[0] / wall:.1f} "
              f"median_request_s={statistics.median(latencies) if latencies else 0:.3f} "
              f"load_average={os.getloadavg()[0]:.1f}")
        print("| service | idle MiB | warmed up MiB | end MiB | middle third rise KiB | "
              "last third rise KiB | limit KiB | slope KiB/min | ± s.e. | threads "
              "(warmed up → end) | verdict |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in rows:
            print(f"| {r['service']} | {r['idle_kib'] / 1024:.1f} | "
                  f"{r['warmed_up_kib'] / 1024:.1f} | {r['end_kib'] / 1024:.1f} | "
                  f"{r['middle_rise_kib']:+.0f} | {r['last_rise_kib']:+.0f} | "
                  f"{r['rise_limit_kib']:.0f} | {r['slope_kib_per_min']:+.1f} | "
                  f"{r['stderr_kib_per_min']:.1f} | {r['threads_warmed_up']} → "
                  f"{r['threads_end']} | {r['verdict']} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"streams": args.streams, "seconds": wall, "requests": done[0],
                           "errors": len(errors), "tokens_per_s": tokens[0] / wall,
                           "load_start_s": load_start, "load_end_s": load_end,
                           "load_average": os.getloadavg(), "memory": rows,
                           "rss_kib": samples, "threads": threads}, f, indent=1)
        if args.plot:
            plot(args.plot, samples, threads, load_start, load_end,
                 f"RSS under {args.streams} TLS streams ({wall:.0f} s)")
        for e in errors[:5]:
            print("error:", e, file=sys.stderr)
        return 1 if errors or any(r["grows"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
