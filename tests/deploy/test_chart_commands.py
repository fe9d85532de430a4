"""What the Helm chart tells people to run, and runs itself, run against real specd services
on loopback (specd-verify, specd-draft, specd-router and specd-http from the build, a
random-weight model):

- every "$ " command NOTES.txt prints (rendered by `helm install --dry-run=client`, no
  Kubernetes needed), with each `localhost:PORT` replaced by the loopback service that the
  NOTES' own `kubectl port-forward` maps PORT to. The kubectl and helm lines need a cluster and
  are not run; instead each port-forward is checked against the rendered manifests (a Service
  of the release with that port, selecting the router or specd-http);
- the `helm test` pod's script as rendered, with its Service addresses replaced, which must
  pass here and fail against an endpoint that is not specd-http;
- the router's model-files init script as rendered, on a model folder: the router then serves
  from the copy alone;
- files/fetch_models.py's once-only logic, with the Hub download replaced by a function that
  writes files (no Hub is reachable here).

Helm comes from scripts/check-deploy.sh --tools (npm). The python3 in the NOTES is the venv's
with the installed SDK (ctest runs this file with it).
"""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml

import specd_cluster

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
CHART = os.path.join(ROOT, "helm", "specd")
NAMESPACE = "specd-test"
PROFILES = {"default": [], "cpu": ["-f", os.path.join(CHART, "examples", "values-cpu.yaml")]}


@pytest.fixture(scope="module")
def helm():
    r = subprocess.run([os.path.join(ROOT, "scripts", "check-deploy.sh"), "--tools"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def render(helm, args):
    """(NOTES text, manifests) of an install with these values."""
    out = subprocess.run([helm, "install", "specd", CHART, "--dry-run=client", "-n", NAMESPACE]
                         + args, capture_output=True, text=True, check=True).stdout
    notes = out.split("\nNOTES:\n", 1)[1]
    manifests = subprocess.run([helm, "template", "specd", CHART, "-n", NAMESPACE] + args,
                               capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(manifests) if d]
    return notes, docs


@pytest.fixture(scope="module")
def workdir():
    d = tempfile.mkdtemp(prefix="specd-chart-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def rendered(helm):
    return {name: render(helm, args) for name, args in PROFILES.items()}


def model_init_command(docs, component):
    for d in docs:
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-" + component):
            inits = d["spec"]["template"]["spec"].get("initContainers", [])
            return inits[0]["command"] if inits else None
    raise AssertionError(f"no {component} Deployment")


@pytest.fixture(scope="module")
def cluster(rendered, workdir):
    """The loopback cluster; its router serves from the folder that the chart's rendered
    model-files init script copied (the download marker is there, as the Job leaves it)."""
    target = os.path.join(workdir, "target")
    subprocess.run([os.environ["SPECD_RANDOM_MODEL"], target, "7"], check=True)
    shutil.copytree(target, os.path.join(workdir, "draft"))
    # The random model has no generation_config.json: the optional files must be optional.
    with open(os.path.join(target, ".specd-complete"), "w") as f:
        f.write("test\n")
    copy = os.path.join(workdir, "router-model")
    os.mkdir(copy)
    cmd = model_init_command(rendered["default"][1], "router")
    sh, dash_c, script, name, _src, _dst, wait, *files = cmd
    assert (sh, dash_c, wait) == ("sh", "-c", "1")
    assert files[:2] == ["config.json", "tokenizer.json"]
    r = subprocess.run([sh, dash_c, script, name, target, copy, wait] + files,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    present = [f.lstrip("?") for f in files if os.path.exists(os.path.join(target,
                                                                         f.lstrip("?")))]
    assert sorted(os.listdir(copy)) == sorted(present)
    assert not any(n.endswith(".safetensors") for n in os.listdir(copy))
    with specd_cluster.Cluster(workdir=workdir, http=True, router_model=copy) as c:
        yield c


def test_model_init_script_refuses_a_folder_without_config(rendered, workdir):
    cmd = model_init_command(rendered["default"][1], "router")
    empty, dst = (os.path.join(workdir, n) for n in ("empty", "dst"))
    os.makedirs(empty)
    os.makedirs(dst)
    r = subprocess.run(cmd[:4] + [empty, dst, "0"] + cmd[7:], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0 and "config.json is missing" in r.stderr


def forwarded_ports(notes, docs):
    """{local port: component} from the NOTES' port-forward lines, each checked against the
    rendered Services."""
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    ports = {}
    for cmd in commands(notes):
        m = re.fullmatch(r"kubectl -n (\S+) port-forward svc/(\S+) (\d+):(\d+)", cmd)
        if not m:
            continue
        ns, svc, local, remote = m.groups()
        assert ns == NAMESPACE
        assert svc in services, f"{cmd}: no Service {svc}"
        spec = services[svc]["spec"]
        assert any(p["port"] == int(remote) for p in spec["ports"]), f"{cmd}: no port {remote}"
        component = spec["selector"]["app.kubernetes.io/component"]
        assert component in ("router", "http"), cmd
        ports[int(local)] = component
    return ports


def commands(notes):
    return [line.split("$ ", 1)[1] for line in notes.splitlines()
            if line.lstrip().startswith("$ ")]


def run_shell(cmd, timeout=120):
    env = dict(os.environ)
    # specd-cli from the build, python3 with the installed SDK (the venv running this test).
    env["PATH"] = os.pathsep.join([os.environ["SPECD_BIN_DIR"], os.path.dirname(sys.executable),
                                   env.get("PATH", "")])
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_notes_commands_work(profile, rendered, cluster):
    notes, docs = rendered[profile]
    ports = forwarded_ports(notes, docs)
    assert sorted(ports.values()) == ["http", "router"], notes
    address = {"router": cluster.address, "http": cluster.http}
    ran = []
    for cmd in commands(notes):
        if cmd.split()[0] in ("kubectl", "helm"):
            continue
        for port in re.findall(r"localhost:(\d+)", cmd):
            assert int(port) in ports, f"{cmd}: localhost:{port} is not port-forwarded"
        local = re.sub(r"localhost:(\d+)", lambda m: address[ports[int(m.group(1))]], cmd)
        r = run_shell(local)
        assert r.returncode == 0, f"{cmd}\n-> {local}\n{r.stdout}\n{r.stderr}"
        assert r.stdout.strip(), f"{cmd}: no output"
        if cmd.startswith("curl"):
            body = json.loads(r.stdout)
            assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] > 0
        ran.append(cmd.split()[0])
    assert sorted(ran) == ["curl", "python3", "specd-cli"], notes
    assert "helm test specd -n " + NAMESPACE in commands(notes)


def helm_test_command(docs):
    pods = [d for d in docs if d["kind"] == "Pod"]
    assert len(pods) == 1 and pods[0]["metadata"]["annotations"]["helm.sh/hook"] == "test"
    return pods[0]["spec"]["containers"][0]["command"]


def test_helm_test_pod_passes_against_the_cluster(rendered, cluster):
    sh, dash_c, script, name, router, http, *rest = helm_test_command(rendered["default"][1])
    assert router.endswith(":50050") and http.endswith(":8000")
    r = run_shell(shlex.join([sh, dash_c, script, name, cluster.address, cluster.http] + rest))
    assert r.returncode == 0 and r.stdout.rstrip().endswith("PASS"), r.stdout + r.stderr
    # Pointed at something that is not specd-http (the router's /metrics listener), it fails.
    wrong = f"127.0.0.1:{cluster.metrics_port['specd-router']}"
    r = run_shell(shlex.join([sh, dash_c, script, name, cluster.address, wrong] + rest))
    assert r.returncode != 0 and "PASS" not in r.stdout


# -- files/fetch_models.py ------------------------------------------------------------------

def load_fetch_models():
    spec = importlib.util.spec_from_file_location(
        "fetch_models", os.path.join(CHART, "files", "fetch_models.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeHub:
    """Stands in for huggingface_hub.snapshot_download (no Hub here): writes a model's files."""

    def __init__(self, files=("config.json", "model.safetensors")):
        self.calls, self.files = [], files

    def __call__(self, repo_id, revision, local_dir, allow_patterns):
        self.calls.append((repo_id, revision, allow_patterns))
        for f in self.files:
            with open(os.path.join(local_dir, f), "w") as out:
                out.write("{}")


def test_fetch_models_fetches_once_and_marks_complete(tmp_path):
    fm = load_fetch_models()
    env = {"MODELS_DIR": str(tmp_path), "SPECD_TARGET_MODEL": "t", "SPECD_TARGET_REPO": "o/t",
           "SPECD_TARGET_REVISION": "v1", "SPECD_DRAFT_MODEL": "d", "SPECD_DRAFT_REPO": "o/d",
           "SPECD_ALLOW_PATTERNS": "*.json\n*.safetensors\n"}
    hub = FakeHub()
    assert fm.main(env, hub) == 0
    assert hub.calls == [("o/t", "v1", ["*.json", "*.safetensors"]),
                         ("o/d", None, ["*.json", "*.safetensors"])]
    assert (tmp_path / "t" / fm.MARKER).exists() and (tmp_path / "d" / fm.MARKER).exists()
    again = FakeHub()
    assert fm.main(env, again) == 0 and again.calls == []


def test_fetch_models_leaves_no_marker_on_an_incomplete_download(tmp_path):
    fm = load_fetch_models()
    env = {"MODELS_DIR": str(tmp_path), "SPECD_TARGET_MODEL": "t", "SPECD_TARGET_REPO": "o/t"}
    assert fm.main(env, FakeHub(files=("config.json",))) == 1
    assert not (tmp_path / "t" / fm.MARKER).exists()
    env["SPECD_TARGET_MODEL"] = "../escape"
    assert fm.main(env, FakeHub()) == 1
