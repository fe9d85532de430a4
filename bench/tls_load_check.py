#!/usr/bin/env python3
"""Short load check of a TLS + token cluster (not CI): starts specd-verify, specd-draft and
specd-router from the build on loopback (random-weight model, mutual TLS router -> services,
TLS + bearer token on the public port), runs `--streams` concurrent greedy Generate streams
through the Python SDK for `--seconds`, and reports completed requests, errors, tokens/s and
the router's RSS idle, every 5 s under load, and at the end. Certificates are made with openssl in a temporary folder.

  SPECD_BUILD_DIR=build SPECD_RANDOM_MODEL=build/bin/specd-make-test-model \\
      PYTHONPATH=clients/python:tests/deploy python3 bench/tls_load_check.py --streams 32
"""

import argparse
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


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=64)
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
            pid = c.procs["specd-router"].pid
            rss_start = rss_kib(pid)
            stop = time.monotonic() + args.seconds
            done, errors, tokens, latencies = [0], [], [0], []
            lock = threading.Lock()

            def worker(i):
                with specd.Client(c.address, tls=specd.TLS(root_certificates=ca), timeout=120,
                                  metadata={"authorization": "Bearer bench-token"}) as client:
                    n = 0
                    while time.monotonic() < stop:
                        t0 = time.monotonic()
                        try:
                            r = client.generate(f"def f{i}_{n}(x):", temperature=0,
                                                max_new_tokens=args.max_new_tokens,
                                                ignore_eos=True)
                            with lock:
                                done[0] += 1
                                tokens[0] += len(r.token_ids)
                                latencies.append(time.monotonic() - t0)
                        except specd.SpecdError as e:
                            with lock:
                                errors.append(str(e))
                        n += 1
            samples = []

            def sample_rss():
                while time.monotonic() < stop:
                    samples.append(rss_kib(pid))
                    time.sleep(5)
            start = time.monotonic()
            threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.streams)]
            threads.append(threading.Thread(target=sample_rss))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.monotonic() - start
            rss_end = rss_kib(pid)
        print(f"streams={args.streams} seconds={wall:.1f} requests={done[0]} "
              f"errors={len(errors)} tokens/s={tokens[0] / wall:.1f} "
              f"median_request_s={statistics.median(latencies) if latencies else 0:.3f} "
              f"router_rss_kib idle={rss_start} end={rss_end} "
              f"under_load={samples}")
        for e in errors[:5]:
            print("error:", e, file=sys.stderr)
        return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
