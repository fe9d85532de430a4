"""Starts the three real specd executables on loopback with a random-weight model, for the
Python integration tests (Prometheus scraping, the Python SDK).

The executables come from $SPECD_BIN_DIR (the CMake build's bin/), the model writer from
$SPECD_RANDOM_MODEL; ctest sets both (tests/deploy/CMakeLists.txt) and skips the tests
(run_pytest.py --cluster, exit code 77) when they are not built.
"""

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import grpc

SERVICES = ("specd-verify", "specd-draft", "specd-router")
SKIP = 77


def binary(name):
    return os.path.join(os.environ.get("SPECD_BIN_DIR", ""), name)


def missing_binaries():
    names = [binary(n) for n in SERVICES + ("specd-cli", "specd-http")]
    names.append(os.environ.get("SPECD_RANDOM_MODEL", ""))
    return [n for n in names if not (n and os.path.isfile(n) and os.access(n, os.X_OK))]



_given_ports = set()
_port_rng = random.Random(os.getpid() ^ time.time_ns())


def free_port():
    """A bindable loopback port in [32000, 32768), below Linux's ephemeral range, so that no
    outgoing connection of a test running in parallel can take it before the service binds
    it (C++ tests draw from [20000, 32000): the two never collide)."""
    for _ in range(1000):
        port = _port_rng.randrange(32000, 32768)
        if port in _given_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given_ports.add(port)
        return port
    raise RuntimeError("no free loopback port in [32000, 32768)")


def health(address, timeout=1.0, root_certificates=None, key_and_cert=None):
    """grpc.health.v1.Health/Check of the whole server, encoded by hand (no health stubs);
    over TLS when root_certificates (PEM bytes) is given, mutual with key_and_cert (PEM bytes)."""
    if root_certificates is not None:
        key, cert = key_and_cert or (None, None)
        channel = grpc.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates, key, cert))
    else:
        channel = grpc.insecure_channel(address)
    with channel as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=lambda _: b"",
                               response_deserializer=lambda b: b)
        resp = check(None, timeout=timeout)
    return "SERVING" if resp[:2] == b"\x08\x01" else "NOT_SERVING"


class Cluster:
    """verify + draft + router on 127.0.0.1, and with http=True specd-http in front of the
    router. The draft model is a copy of the target (same weights and tokenizer), so greedy
    drafts are accepted and sampled ones partly. router_model: the router's --model folder
    (default: the target's)."""

    def __init__(self, workdir=None, router_args=(), http=False, router_model=None,
                 router_root_certificates=None, service_args=(), service_root_certificates=None,
                 service_client_pair=None):
        self.own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="specd-cluster-")
        self.router_args = list(router_args)
        self.router_model = router_model
        # PEM bytes of the CA of a router started with --tls_cert: health checks use TLS.
        self.router_root_certificates = router_root_certificates
        # Flags added to draft and verify (TLS), and how health checks reach them then: the CA
        # (PEM bytes) and a client (key, certificate) pair of file paths.
        self.service_args = list(service_args)
        self.service_root_certificates = service_root_certificates
        self.service_key_and_cert = None
        if service_client_pair:
            self.service_key_and_cert = tuple(open(p, "rb").read() for p in service_client_pair)
        self.procs = {}
        self.logs = {}
        self.grpc = {n: f"127.0.0.1:{free_port()}" for n in SERVICES}
        self.metrics_port = {n: free_port() for n in SERVICES}
        self.http = f"127.0.0.1:{free_port()}" if http else None
        if http:
            self.metrics_port["specd-http"] = free_port()

    @property
    def address(self):
        return self.grpc["specd-router"]

    def metrics_url(self, name):
        return f"http://127.0.0.1:{self.metrics_port[name]}/metrics"

    def job_targets(self):
        """{job: host:port of /metrics}, the scrape targets."""
        return {n: f"127.0.0.1:{self.metrics_port[n]}" for n in SERVICES}

    def start(self, timeout=60):
        target = os.path.join(self.dir, "target")
        draft = os.path.join(self.dir, "draft")
        if not os.path.isdir(target):
            subprocess.run([os.environ["SPECD_RANDOM_MODEL"], target, "7"], check=True)
            shutil.copytree(target, draft)
        common = ["--device=cpu", "--num_threads=1"]
        self._spawn("specd-verify", [f"--model={target}"] + common + self.service_args)
        self._spawn("specd-draft", [f"--model={draft}"] + common + self.service_args)
        self._spawn("specd-router", [f"--model={self.router_model or target}",
                                     f"--verify_address={self.grpc['specd-verify']}",
                                     f"--draft_address={self.grpc['specd-draft']}"]
                    + self.router_args)
        for name in SERVICES:
            self.wait_serving(name, timeout)
        self.wait_draft_available(timeout)
        if self.http:
            self._spawn_http(target, timeout)
        return self

    def _spawn_http(self, target, timeout):
        log = open(os.path.join(self.dir, "specd-http.log"), "wb")
        self.logs["specd-http"] = log.name
        self.procs["specd-http"] = subprocess.Popen(
            [binary("specd-http"), f"--address={self.http}", f"--router={self.address}",
             f"--metrics_port={self.metrics_port['specd-http']}", f"--model_dir={target}",
             "--threads=4"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.metrics_port['specd-http']}/health"
        while True:
            if self.procs["specd-http"].poll() is not None:
                raise RuntimeError("specd-http exited:\n" + self.log("specd-http"))
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("specd-http not healthy:\n" + self.log("specd-http"))
            time.sleep(0.1)

    def wait_draft_available(self, timeout=60):
        """The router connects to the draft service in the background (and reconnects with
        backoff); until then it decodes target-only. Wait for its specd_draft_available."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if re.search(r"^specd_draft_available(\{[^}]*\})? 1(\.0*)?$",
                             self.scrape("specd-router"), re.M):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the router never reached the draft service:\n"
                                   + self.log("specd-router"))
            time.sleep(0.1)

    def _spawn(self, name, args):
        log = open(os.path.join(self.dir, f"{name}.log"), "wb")
        self.logs[name] = log.name
        cmd = [binary(name), f"--address={self.grpc[name]}",
               f"--metrics_port={self.metrics_port[name]}"] + args
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        log.close()

    def restart(self, name, timeout=60):
        """Starts a stopped service again with the same flags and ports."""
        old = self.procs[name]
        self.procs[name] = subprocess.Popen(old.args, stdout=open(self.logs[name], "ab"),
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_serving(name, timeout)
        if name == "specd-router":
            self.wait_draft_available(timeout)

    def wait_serving(self, name, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited ({self.procs[name].returncode}):\n"
                                   + self.log(name))
            try:
                if name == "specd-router":
                    roots, pair = self.router_root_certificates, None
                else:
                    roots, pair = self.service_root_certificates, self.service_key_and_cert
                status = health(self.grpc[name], root_certificates=roots, key_and_cert=pair)
                if status == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not SERVING after {timeout} s:\n" + self.log(name))
            time.sleep(0.1)

    def kill(self, name, sig=signal.SIGKILL):
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(sig)
            p.wait(10)

    def log(self, name):
        try:
            with open(self.logs[name], "rb") as f:
                return f.read()[-4000:].decode("utf-8", "replace")
        except OSError:
            return ""

    def scrape(self, name):
        with urllib.request.urlopen(self.metrics_url(name), timeout=5) as r:
            return r.read().decode("utf-8")

    def cli(self, *args, check=True, timeout=120):
        """Runs specd-cli against the router: cli("generate", "--prompt", "x", "--json")."""
        cmd = [binary("specd-cli"), args[0], "--server", self.address] + list(args[1:])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr}")
        return r

    def stop(self):
        order = ("specd-http",) + tuple(reversed(SERVICES))
        for name in order:
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
        for name in order:
            p = self.procs.get(name)
            if p is None:
                continue
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
