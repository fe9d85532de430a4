#!/usr/bin/env python3
"""Checks what `helm template` rendered from helm/specd beyond schema validity: that the parts
fit together (Service and PodDisruptionBudget selectors match pods, the HPA targets the router,
the router reaches the draft and verify Services and specd-http the router's, the helm test
pod reaches both, the ServiceMonitor finds the metrics Services, every pod mounts the models it
needs and only those: draft and verify their own folder, the router and specd-http copies of
the small files; the download Job writes the claim the pods read) and that each values file
gets what it asks for (GPU counts, tensor-parallel flags, /dev/shm, NCCL_NVLS_ENABLE=0,
runtime and priority classes, no GPU anywhere in the CPU install).

  check_rendered.py --profile 8gpu-tp7 rendered.yaml --json-out manifests.json

--json-out writes the documents as [{"source", "doc"}] for validate-manifests.mjs.
"""

import argparse
import json
import re
import sys

import yaml

GPU = "nvidia.com/gpu"


class Checker:
    def __init__(self):
        self.problems = []

    def expect(self, cond, msg):
        if not cond:
            self.problems.append(msg)
        return cond


def load(path):
    docs = []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for chunk in re.split(r"^---\s*$", text, flags=re.M):
        m = re.search(r"^# Source: (.*)$", chunk, flags=re.M)
        doc = yaml.safe_load(chunk)
        if doc is None:
            continue
        docs.append({"source": m.group(1) if m else "?", "doc": doc})
    return docs


def component(doc):
    return doc["metadata"]["labels"].get("app.kubernetes.io/component")


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def arg_value(args, flag):
    for a in args:
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def resolve(value, env):
    """Expands $(VAR) the way the kubelet does in args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)),
                  value or "")


def service_port(services, address, port_name):
    """Whether host:port is a Service of the release with that port under port_name."""
    host, _, port = (address or "").rpartition(":")
    return any(s["metadata"]["name"] == host and
               any(str(p["port"]) == port and p["name"] == port_name for p in s["spec"]["ports"])
               for s in services)


def pod_under_headless(services, workload, address, port_name):
    """Whether host:port names pod N (N < replicas) of the StatefulSet `workload` by the
    headless Service that governs it, on that Service's port under port_name."""
    host, _, port = (address or "").rpartition(":")
    pod, _, svc = host.partition(".")
    name = workload["metadata"]["name"]
    m = re.fullmatch(re.escape(name) + r"-(\d+)", pod)
    headless = [s for s in services if s["metadata"]["name"] == svc and
                s["spec"].get("clusterIP") == "None"]
    return (workload["kind"] == "StatefulSet" and m is not None and
            int(m.group(1)) < workload["spec"].get("replicas", 1) and
            workload["spec"].get("serviceName") == svc and len(headless) == 1 and
            any(str(p["port"]) == port and p["name"] == port_name
                for p in headless[0]["spec"]["ports"]))


def headless_for(services, workload, address, port_name):
    """Whether address is dns:///NAME:PORT where NAME is a headless Service that selects the
    pods of `workload` and has PORT under port_name: the router resolves it to every pod."""
    if not (address or "").startswith("dns:///"):
        return False
    host, _, port = address[len("dns:///"):].rpartition(":")
    labels = workload["spec"]["template"]["metadata"].get("labels", {})
    return any(s["metadata"]["name"] == host and s["spec"].get("clusterIP") == "None" and
               s["spec"].get("selector") and
               all(labels.get(k) == v for k, v in s["spec"]["selector"].items()) and
               any(str(p["port"]) == port and p["name"] == port_name for p in s["spec"]["ports"])
               for s in services)


def gpu_count(container, kind):
    return int(container.get("resources", {}).get(kind, {}).get(GPU, 0))


def check_http(c, w, services):
    """specd-http: its own ports, HTTP probes (readiness on /health, the others on /metrics,
    all on the metrics listener) and the router Service's gRPC port."""
    ct = w["spec"]["template"]["spec"]["containers"][0]
    where = f"{w['metadata']['name']}/{ct['name']}"
    ports = {p["name"]: p["containerPort"] for p in ct.get("ports", [])}
    args = ct.get("args", [])
    c.expect(ct.get("command") == ["specd-http"], f"{where}: command must be specd-http")
    c.expect({"http", "metrics"} <= set(ports), f"{where}: needs http and metrics ports")
    c.expect(arg_value(args, "--address") == f"0.0.0.0:{ports.get('http')}",
             f"{where}: --address does not listen on the http port")
    c.expect(arg_value(args, "--metrics_port") == str(ports.get("metrics")),
             f"{where}: --metrics_port is not the metrics port")
    c.expect(service_port(services, arg_value(args, "--router"), "grpc"),
             f"{where}: --router is no Service's grpc port")
    for probe, path in (("startupProbe", "/metrics"), ("readinessProbe", "/health"),
                        ("livenessProbe", "/metrics")):
        get = ct.get(probe, {}).get("httpGet", {})
        c.expect(get.get("path") == path and get.get("port") == "metrics",
                 f"{where}: {probe} must GET {path} on the metrics port")
    model_dir = arg_value(args, "--model_dir")
    mounts = {m["mountPath"]: m["name"] for m in ct.get("volumeMounts", [])}
    c.expect("models" not in mounts.values(), f"{where}: mounts the models volume")
    if model_dir and "model-files" in mounts.values():
        c.expect(mounts.get(model_dir) == "model-files",
                 f"{where}: --model_dir={model_dir} is not the copied files")


def check_jobs_and_tests(c, by_kind, services, comps, claims, config):
    """The download Job writes the claim the pods read; the helm test pod reaches the router
    (and specd-http) through their Services."""
    for job in by_kind.get("Job", []):
        spec = job["spec"]["template"]["spec"]
        where = f"Job {job['metadata']['name']}"
        c.expect(spec.get("restartPolicy") in ("Never", "OnFailure"), f"{where}: restartPolicy")
        vols = {v["name"]: v for v in spec["volumes"]}
        claim = vols.get("models", {}).get("persistentVolumeClaim", {})
        pod_claims = {v["persistentVolumeClaim"]["claimName"]
                      for w in comps.values() for v in w["spec"]["template"]["spec"]["volumes"]
                      if "persistentVolumeClaim" in v}
        c.expect(claim.get("claimName") and not claim.get("readOnly") and
                 pod_claims == {claim.get("claimName")},
                 f"{where}: must write the claim the pods read ({pod_claims})")
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        c.expect(config.get("SPECD_TARGET_MODEL", "").endswith("/" + env["SPECD_TARGET_MODEL"]),
                 f"{where}: fetches {env['SPECD_TARGET_MODEL']}, the pods read "
                 f"{config.get('SPECD_TARGET_MODEL')}")
        if "draft" in comps:
            c.expect(config.get("SPECD_DRAFT_MODEL", "").endswith("/" + env["SPECD_DRAFT_MODEL"]),
                     f"{where}: fetches another draft folder than the pods read")
    for pod in by_kind.get("Pod", []):
        hook = pod["metadata"].get("annotations", {}).get("helm.sh/hook")
        c.expect(hook == "test", f"Pod {pod['metadata']['name']}: not a helm test hook")
        cmd = pod["spec"]["containers"][0]["command"]
        router, http = cmd[4], cmd[5]
        c.expect(service_port(services, router, "grpc") and router.split(":")[0].endswith(
            "-router"), f"helm test: {router} is not the router's gRPC Service")
        if "http" in comps:
            c.expect(service_port(services, http, "http"),
                     f"helm test: {http} is not specd-http's Service")
        else:
            c.expect(http == "", "helm test: specd-http address without specd-http")


def check_tls_probes(c, where, ct, comp):
    """With TLS on, the kubelet's gRPC probes (plaintext only) cannot be used: readiness is
    the metrics listener's /health (200 exactly when SERVING); liveness only checks that the
    process accepts connections, so it does not follow the verify service; startup of a model
    service waits for its model (/health), the router's only for its process."""
    ready = ct.get("readinessProbe", {}).get("httpGet", {})
    c.expect(ready.get("path") == "/health" and ready.get("port") == "metrics",
             f"{where}: with TLS, readinessProbe must GET /health on the metrics port")
    c.expect("tcpSocket" in ct.get("livenessProbe", {}),
             f"{where}: with TLS, livenessProbe must not follow readiness")
    startup = ct.get("startupProbe", {})
    if comp == "router":
        c.expect("tcpSocket" in startup,
                 f"{where}: the router's startupProbe waits for its process only")
    else:
        c.expect(startup.get("httpGet", {}).get("path") == "/health",
                 f"{where}: startupProbe of a model service waits for its model")


def check(docs, profile):
    c = Checker()
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["doc"]["kind"], []).append(d["doc"])
    workloads = by_kind.get("Deployment", []) + by_kind.get("StatefulSet", [])
    services = by_kind.get("Service", [])
    comps = {component(w): w for w in workloads}
    config = {}
    for cm in by_kind.get("ConfigMap", []):
        if "SPECD_TARGET_MODEL" in cm.get("data", {}):
            config = cm["data"]
    claims = {pvc["metadata"]["name"] for pvc in by_kind.get("PersistentVolumeClaim", [])}

    for w in workloads:
        name = w["metadata"]["name"]
        tpl = w["spec"]["template"]
        pod_labels = tpl["metadata"]["labels"]
        c.expect(matches(w["spec"]["selector"]["matchLabels"], pod_labels),
                 f"{name}: selector does not match its pod labels")
        for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                  "app.kubernetes.io/component"):
            c.expect(k in w["spec"]["selector"]["matchLabels"], f"{name}: selector lacks {k}")
        spec = tpl["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for ct in spec.get("initContainers", []):
            for m in ct.get("volumeMounts", []):
                c.expect(m["name"] in volumes,
                         f"{name}/{ct['name']}: mounts {m['name']}, no such volume")
        if "models" in volumes and "persistentVolumeClaim" in volumes["models"]:
            claim = volumes["models"]["persistentVolumeClaim"]
            c.expect(claim.get("readOnly") is True, f"{name}: mounts the models claim writable")
            c.expect(claim["claimName"] in claims or profile in ("variant",),
                     f"{name}: claim {claim['claimName']} is not the chart's")
        if component(w) == "http":
            check_http(c, w, services)
            continue
        for ct in spec["containers"]:
            where = f"{name}/{ct['name']}"
            ports = {p["name"]: p["containerPort"] for p in ct.get("ports", [])}
            c.expect({"grpc", "metrics"} <= set(ports), f"{where}: needs grpc and metrics ports")
            if any(a.startswith("--tls_cert=") for a in ct.get("args", [])):
                check_tls_probes(c, where, ct, component(w))
            else:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    p = ct.get(probe, {})
                    c.expect(p.get("grpc", {}).get("port") == ports.get("grpc"),
                             f"{where}: {probe} must be a gRPC probe on the grpc port")
                # Readiness is the server's overall status; liveness must not follow it, or a
                # router would be restarted whenever its verify service is down.
                c.expect(ct.get("readinessProbe", {}).get("grpc", {}).get("service", "") == "",
                         f"{where}: readinessProbe must ask for the overall status (\"\")")
                c.expect(ct.get("livenessProbe", {}).get("grpc", {}).get("service") == "liveness",
                         f"{where}: livenessProbe must ask for the \"liveness\" service")
                startup = ct.get("startupProbe", {}).get("grpc", {}).get("service", "")
                c.expect(startup == ("liveness" if component(w) == "router" else ""),
                         f"{where}: startupProbe of a model service waits for its model, the "
                         "router's only for its process")
            args = ct.get("args", [])
            c.expect(ct.get("command") == [f"specd-{component(w)}"],
                     f"{where}: command must be specd-{component(w)} (the images serve several)")
            c.expect(arg_value(args, "--address") == f"0.0.0.0:{ports.get('grpc')}",
                     f"{where}: --address does not listen on the grpc port")
            c.expect(arg_value(args, "--metrics_port") == str(ports.get("metrics")),
                     f"{where}: --metrics_port is not the metrics port")
            c.expect(arg_value(args, "--model") is not None, f"{where}: no --model")
            req = ct.get("resources", {}).get("requests", {})
            c.expect("cpu" in req and "memory" in req, f"{where}: needs cpu and memory requests")
            c.expect(gpu_count(ct, "limits") == gpu_count(ct, "requests"),
                     f"{where}: GPU requests and limits differ")
            sc = ct.get("securityContext", {})
            c.expect(sc.get("allowPrivilegeEscalation") is False,
                     f"{where}: allowPrivilegeEscalation must be false")
            mounts = {m["mountPath"]: m["name"] for m in ct.get("volumeMounts", [])}
            for path, vol in mounts.items():
                c.expect(vol in volumes, f"{where}: mounts {vol} at {path}, no such volume")
            model = resolve(arg_value(args, "--model"), config)
            model_mounts = [m for m in ct.get("volumeMounts", [])
                            if m["name"] in ("models", "model-files")]
            if "models" not in volumes:
                c.expect(not model_mounts, f"{where}: model mounts without a models volume")
            elif component(w) == "router":
                # The router reads a few files of the target, copied by its init container.
                c.expect([m["name"] for m in model_mounts] == ["model-files"] and
                         model_mounts[0]["mountPath"] == model,
                         f"{where}: must see only the copied files at --model={model}")
                inits = spec.get("initContainers", [])
                c.expect(len(inits) == 1 and "config.json" in inits[0]["command"] and
                         "tokenizer.json" in inits[0]["command"],
                         f"{where}: no init container copying config.json and tokenizer.json")
            else:
                # Draft and verify mount only their own model folder.
                c.expect(len(model_mounts) == 1 and model_mounts[0]["name"] == "models" and
                         model_mounts[0].get("readOnly") is True and
                         model_mounts[0]["mountPath"] == model and
                         model.endswith("/" + model_mounts[0].get("subPath", "//")),
                         f"{where}: must mount only its model folder (subPath) at {model}")
            if component(w) in ("draft", "verify"):
                env = {e["name"]: e.get("value") for e in ct.get("env", [])}
                c.expect(env.get("NCCL_NVLS_ENABLE") == "0",
                         f"{where}: NCCL_NVLS_ENABLE=0 must always be set")
                if component(w) == "verify":
                    c.expect("/dev/shm" in mounts and
                             volumes.get(mounts["/dev/shm"], {}).get("emptyDir", {})
                             .get("medium") == "Memory",
                             f"{where}: /dev/shm must be a memory-backed emptyDir")
                gpus = gpu_count(ct, "limits")
                device = arg_value(args, "--device")
                if component(w) == "verify" and arg_value(args, "--devices"):
                    device = arg_value(args, "--devices").split(",")[0]
                if gpus:
                    c.expect(device == "cuda:0", f"{where}: has GPUs but --device={device}")
                    if profile == "8gpu-tp7":
                        c.expect(spec.get("runtimeClassName") == "nvidia" and
                                 spec.get("priorityClassName") == "specd-gpu",
                                 f"{where}: GPU pod without gpu.runtimeClassName or "
                                 "gpu.priorityClassName")
                    c.expect(any(t.get("key") == GPU for t in spec.get("tolerations", [])),
                             f"{where}: GPU pod without the {GPU} toleration")
                    c.expect(w["spec"].get("strategy", {}).get("type") != "RollingUpdate",
                             f"{where}: a GPU Deployment must not surge (use Recreate)")
                else:
                    c.expect(device == "cpu", f"{where}: no GPU but --device={device}")
                    c.expect("runtimeClassName" not in spec,
                             f"{where}: a CPU pod with gpu.runtimeClassName")
                if component(w) == "verify":
                    tp = arg_value(args, "--tensor_parallel")
                    if gpus:
                        c.expect(tp == str(gpus),
                                 f"{where}: --tensor_parallel={tp} but {gpus} GPUs")
                        c.expect(arg_value(args, "--devices") ==
                                 ",".join(f"cuda:{i}" for i in range(gpus)),
                                 f"{where}: --devices does not list cuda:0..cuda:{gpus - 1}")
                        c.expect(arg_value(args, "--device") is None,
                                 f"{where}: --devices replaces --device")
                    else:
                        c.expect(tp is None, f"{where}: --tensor_parallel on the CPU")

    for s in services:
        name = s["metadata"]["name"]
        sel = s["spec"].get("selector", {})
        targets = [w for w in workloads
                   if matches(sel, w["spec"]["template"]["metadata"]["labels"])]
        c.expect(len(targets) == 1, f"Service {name} selects {len(targets)} workloads, not 1")
        for p in s["spec"]["ports"]:
            for w in targets:
                names = {pp["name"] for ct in w["spec"]["template"]["spec"]["containers"]
                         for pp in ct.get("ports", [])}
                c.expect(p["targetPort"] in names,
                         f"Service {name}: targetPort {p['targetPort']} is no container port")

    for pdb in by_kind.get("PodDisruptionBudget", []):
        sel = pdb["spec"]["selector"]["matchLabels"]
        c.expect(any(matches(sel, w["spec"]["template"]["metadata"]["labels"])
                     for w in workloads),
                 f"PodDisruptionBudget {pdb['metadata']['name']} selects no pods")

    for hpa in by_kind.get("HorizontalPodAutoscaler", []):
        ref = hpa["spec"]["scaleTargetRef"]
        c.expect(any(w["kind"] == ref["kind"] and w["metadata"]["name"] == ref["name"]
                     for w in workloads),
                 f"HPA {hpa['metadata']['name']} targets a missing {ref['kind']}")
        router = comps.get("router")
        c.expect(router is not None and "replicas" not in router["spec"],
                 "the router Deployment must leave replicas to the HPA")

    router = comps.get("router")
    if c.expect(router is not None, "no router Deployment"):
        args = router["spec"]["template"]["spec"]["containers"][0]["args"]
        for flag, comp in (("--verify_address", "verify"), ("--draft_address", "draft")):
            addr = arg_value(args, flag)
            if comp not in comps:
                c.expect(addr is None, f"router: {flag} set but no {comp} workload")
                continue
            # Every pod of the tier, by the headless Service's DNS name (one group or draft
            # service per pod), or failing that one Service's or pod's grpc port.
            c.expect(headless_for(services, comps[comp], addr, "grpc") or
                     service_port(services, addr, "grpc") or
                     pod_under_headless(services, comps[comp], addr, "grpc"),
                     f"router: {flag}={addr} reaches no {comp} pod's grpc port")

    check_jobs_and_tests(c, by_kind, services, comps, claims, config)

    metric_services = [s for s in services
                       if s["metadata"]["labels"].get("specd.io/metrics") == "true"]
    c.expect(sorted(s["metadata"]["labels"]["specd.io/job"] for s in metric_services) ==
             sorted(f"specd-{k}" for k in comps),
             "one metrics Service per component, labelled with its job")
    for sm in by_kind.get("ServiceMonitor", []):
        sel = sm["spec"]["selector"]["matchLabels"]
        chosen = [s for s in services if matches(sel, s["metadata"]["labels"])]
        c.expect(sorted(s["metadata"]["name"] for s in chosen) ==
                 sorted(s["metadata"]["name"] for s in metric_services),
                 f"ServiceMonitor selects {[s['metadata']['name'] for s in chosen]}, "
                 f"not the metrics Services")
        for ep in sm["spec"]["endpoints"]:
            c.expect(all(any(p["name"] == ep["port"] for p in s["spec"]["ports"])
                         for s in chosen), f"ServiceMonitor port {ep['port']} not on Services")

    gpus = {k: sum(gpu_count(ct, "limits") for ct in w["spec"]["template"]["spec"]["containers"])
            for k, w in comps.items()}
    kinds = set(by_kind)
    if profile == "default":
        c.expect(gpus == {"router": 0, "http": 0, "draft": 1, "verify": 1}, f"GPUs {gpus}")
        c.expect("HorizontalPodAutoscaler" in kinds, "default install has an HPA")
        c.expect("ServiceMonitor" not in kinds, "ServiceMonitor is off by default")
        c.expect(len(by_kind.get("PersistentVolumeClaim", [])) == 1 and
                 len(by_kind.get("Job", [])) == 1,
                 "the default install creates the models claim and the download Job")
        for w in workloads:
            inits = w["spec"]["template"]["spec"].get("initContainers", [])
            c.expect(len(inits) == 1 and "/.specd-complete" in inits[0]["command"][2],
                     f"{w['metadata']['name']}: does not wait for the download")
    elif profile == "cpu":
        c.expect(all(v == 0 for v in gpus.values()), f"CPU install asks for GPUs: {gpus}")
        c.expect(GPU not in json.dumps([d["doc"] for d in docs]),
                 f"CPU install mentions {GPU}")
        for w in workloads:
            for ct in w["spec"]["template"]["spec"]["containers"]:
                c.expect("specd-cpu" in ct["image"], f"{ct['name']}: not the CPU image")
    elif profile == "8gpu-tp7":
        c.expect(gpus == {"router": 0, "http": 0, "draft": 1, "verify": 7}, f"GPUs {gpus}")
        c.expect(sum(gpus.values()) == 8, "draft + verify fill the 8-GPU host")
        c.expect("ServiceMonitor" in kinds, "the 8-GPU example enables the ServiceMonitor")
        dashboards = [cm for cm in by_kind.get("ConfigMap", [])
                      if cm["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
        c.expect(len(dashboards) == 1 and
                 all(json.loads(v)["panels"] for v in dashboards[0]["data"].values()),
                 "the 8-GPU example ships the dashboard for Grafana's sidecar")
    elif profile == "variant":
        # An existing claim and a hub token value, no draft service, ServiceMonitor, Ingress.
        c.expect("draft" not in comps, "draft.enabled=false leaves no draft workload")
        c.expect("PersistentVolumeClaim" not in kinds, "existingClaim creates no claim")
        c.expect(len(by_kind.get("Secret", [])) == 1, "hubToken.value creates a Secret")
        c.expect("Ingress" in kinds, "http.ingress.enabled renders an Ingress")
        env = {e["name"]: e for e in
               by_kind["Job"][0]["spec"]["template"]["spec"]["containers"][0]["env"]}
        c.expect(env.get("HF_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
                 .get("name") == by_kind["Secret"][0]["metadata"]["name"],
                 "the download Job reads HF_TOKEN from the hub token Secret")
        c.expect("SPECD_DRAFT_REPO" not in env, "no draft service, no draft download")
    elif profile == "groups":
        # verify.replicas=2: two verify groups of one GPU each, both used by the router.
        c.expect(gpus == {"router": 0, "http": 0, "draft": 1, "verify": 1}, f"GPUs {gpus}")
        c.expect(comps["verify"]["spec"]["replicas"] == 2, "verify.replicas=2: two verify pods")
        args = comps["router"]["spec"]["template"]["spec"]["containers"][0]["args"]
        c.expect(headless_for(services, comps["verify"], arg_value(args, "--verify_address"),
                              "grpc"),
                 "the router does not resolve every verify group by the headless Service")
    elif profile == "image-volume":
        # models.source=imageVolume, no download, no specd-http, no helm test.
        c.expect("http" not in comps and "Pod" not in kinds and "Job" not in kinds,
                 "http, tests and download disabled")
        for w in workloads:
            vol = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
            c.expect(vol.get("models", {}).get("image", {}).get("reference"),
                     f"{w['metadata']['name']}: no image volume")
    elif profile == "secure":
        # TLS, tokens and NetworkPolicies on, with the Secrets the chart makes.
        secrets = {d["metadata"]["name"] for d in by_kind.get("Secret", [])}
        for name, w in comps.items():
            spec = w["spec"]["template"]["spec"]
            vols = {v["name"]: v for v in spec.get("volumes", [])}
            ct = spec["containers"][0]
            args = ct.get("args", [])
            mounts = {m["name"]: m["mountPath"] for m in ct.get("volumeMounts", [])}
            c.expect(vols.get("tls", {}).get("secret", {}).get("secretName") in secrets and
                     mounts.get("tls") == "/etc/specd/tls", f"{name}: TLS Secret not mounted")
            c.expect("--tls_cert=/etc/specd/tls/tls.crt" in args and
                     "--tls_key=/etc/specd/tls/tls.key" in args, f"{name}: no --tls_cert/key")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                c.expect("grpc" not in ct.get(probe, {}),
                         f"{name}: {probe} uses gRPC, which the kubelet speaks without TLS")
            if name in ("draft", "verify"):
                c.expect("--tls_client_ca=/etc/specd/tls/ca.crt" in args,
                         f"{name}: does not require client certificates")
            if name in ("router", "http"):
                c.expect(any(a.startswith("--token_file=/etc/specd/tokens/") for a in args) and
                         vols.get("tokens", {}).get("secret", {}).get("secretName") in secrets,
                         f"{name}: tokens not on")
        router_args = comps["router"]["spec"]["template"]["spec"]["containers"][0]["args"]
        c.expect("--upstream_tls_cert=/etc/specd/tls/tls.crt" in router_args,
                 "router: no client certificate towards draft and verify")
        policies = {p["metadata"]["name"]: p for p in by_kind.get("NetworkPolicy", [])}
        for name in ("draft", "verify"):
            w = comps[name]
            pol = [p for p in policies.values()
                   if p["spec"]["podSelector"]["matchLabels"] == w["spec"]["selector"]["matchLabels"]]
            c.expect(len(pol) == 1, f"{name}: {len(pol)} NetworkPolicies select its pods")
            if pol:
                rules = pol[0]["spec"]["ingress"]
                grpc_port = w["spec"]["template"]["spec"]["containers"][0]["ports"][0]
                grpc_rules = [r for r in rules
                              if any(p["port"] == grpc_port["containerPort"]
                                     for p in r.get("ports", []))]
                c.expect(len(grpc_rules) == 1 and len(grpc_rules[0].get("from", [])) == 1 and
                         grpc_rules[0]["from"][0]["podSelector"]["matchLabels"] ==
                         comps["router"]["spec"]["selector"]["matchLabels"],
                         f"{name}: its gRPC port is open to more than the router pods")
    else:
        c.expect(False, f"unknown profile {profile}")
    # Every profile: the kubelet waits longer than the router drains.
    if "router" in comps:
        spec = comps["router"]["spec"]["template"]["spec"]
        grace = [int(a.split("=", 1)[1]) for a in spec["containers"][0]["args"]
                 if a.startswith("--shutdown_grace_seconds=")]
        c.expect(len(grace) == 1 and spec.get("terminationGracePeriodSeconds", 30) > grace[0],
                 "router: terminationGracePeriodSeconds is not above --shutdown_grace_seconds")
    return c.problems


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rendered")
    ap.add_argument("--profile", required=True,
                    choices=["default", "cpu", "8gpu-tp7", "variant", "image-volume", "secure",
                             "groups"])
    ap.add_argument("--json-out")
    args = ap.parse_args()
    docs = load(args.rendered)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(docs, f)
    problems = check(docs, args.profile)
    if problems:
        print(f"check_rendered ({args.profile}): FAILED", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        return 1
    print(f"check_rendered ({args.profile}): {len(docs)} documents fit together")
    return 0


if __name__ == "__main__":
    sys.exit(main())
