{{/*
The chart name, truncated to the 63 characters a DNS label allows.
*/}}
{{- define "specd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name: the release name alone when it already contains the chart name.
Truncated to leave room for a component suffix ("-router", "-verify-metrics").
*/}}
{{- define "specd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every resource.
*/}}
{{- define "specd.labels" -}}
helm.sh/chart: {{ include "specd.chart" . }}
{{ include "specd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specd
{{- end }}

{{/*
Selector labels of the release (stable across upgrades: never add changing values here).
*/}}
{{- define "specd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Component helpers take (dict "ctx" $ "component" "router").
*/}}
{{- define "specd.componentName" -}}
{{- printf "%s-%s" (include "specd.fullname" .ctx) .component }}
{{- end }}

{{- define "specd.componentLabels" -}}
{{ include "specd.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specd.componentSelectorLabels" -}}
{{ include "specd.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image of a component: the GPU image for device cuda, the CPU image otherwise.
Takes (dict "ctx" $ "device" "cuda").
*/}}
{{- define "specd.image" -}}
{{- $img := ternary .ctx.Values.image.gpu .ctx.Values.image.cpu (eq .device "cuda") }}
{{- printf "%s:%s" $img.repository (default .ctx.Chart.AppVersion $img.tag) }}
{{- end }}

{{- define "specd.targetModelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.models.mountPath) .Values.models.target }}
{{- end }}

{{- define "specd.draftModelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.models.mountPath) .Values.models.draft }}
{{- end }}

{{/*
Pod-level settings shared by every component. Takes (dict "ctx" $ "values" .Values.draft
"device" "cuda"). GPU pods get gpu.runtimeClassName and, unless their own is set,
gpu.priorityClassName.
*/}}
{{- define "specd.podSpecCommon" -}}
{{- $ctx := .ctx }}
{{- $v := .values }}
serviceAccountName: {{ include "specd.serviceAccountName" $ctx }}
automountServiceAccountToken: false
{{- $priority := default "" $v.priorityClassName }}
{{- if eq .device "cuda" }}
{{- $priority = default $ctx.Values.gpu.priorityClassName $priority }}
{{- with $ctx.Values.gpu.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- end }}
{{- with $priority }}
priorityClassName: {{ . }}
{{- end }}
{{- with $ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $ctx.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
{{- $nodeSelector := $v.nodeSelector }}
{{- $tolerations := $v.tolerations }}
{{- if eq .device "cuda" }}
{{- $nodeSelector = merge (deepCopy $v.nodeSelector) $ctx.Values.gpu.nodeSelector }}
{{- $tolerations = concat $ctx.Values.gpu.tolerations $v.tolerations }}
{{- end }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Whether specd pods wait for the download Job's marker before they start.
*/}}
{{- define "specd.waitsForDownload" -}}
{{- if and (eq .Values.models.source "pvc") .Values.models.download.enabled }}true{{ end }}
{{- end }}

{{- define "specd.modelsClaimName" -}}
{{- default (printf "%s-models" (include "specd.fullname" .)) .Values.models.pvc.existingClaim }}
{{- end }}

{{/*
The models volume (nothing for models.source = image). Takes the root context.
*/}}
{{- define "specd.modelsVolume" -}}
{{- $m := .Values.models }}
{{- if eq $m.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ include "specd.modelsClaimName" . }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: models
  hostPath:
    path: {{ $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "imageVolume" }}
- name: models
  image:
    reference: {{ required "models.imageVolume.reference: the image that holds the models" $m.imageVolume.reference }}
    pullPolicy: {{ $m.imageVolume.pullPolicy }}
{{- end }}
{{- end }}

{{/*
The files the router reads from the target's folder (--model: vocabulary, context and EOS ids
from config.json and generation_config.json, the tokenizer from tokenizer.json and
tokenizer_config.json); "?" marks the optional ones. specd-http reads the chat template
(chat_template.jinja, else tokenizer_config.json's) and the special tokens from the same copy.
*/}}
{{- define "specd.routerModelFiles" -}}
config.json tokenizer.json ?tokenizer_config.json ?generation_config.json ?chat_template.jinja
{{- end }}

{{/*
Shell script of the model init containers: waits for SRC/.specd-complete when WAIT is 1, then
copies FILES from SRC to DST ("?name": only if present). Arguments: SRC DST WAIT FILES...
tests/deploy/test_chart_commands.py runs it as rendered.
*/}}
{{- define "specd.modelInitScript" -}}
set -eu
src=$1 dst=$2 wait=$3
shift 3
if [ "$wait" = 1 ]; then
  until [ -f "$src/.specd-complete" ]; do
    echo "waiting for $src/.specd-complete (the model download Job)"
    sleep 10
  done
fi
for f in "$@"; do
  case $f in
    \?*) f=${f#?}; [ -f "$src/$f" ] || continue ;;
    *) [ -f "$src/$f" ] || { echo "$src/$f is missing: is it a model folder?" >&2; exit 1; } ;;
  esac
  cp "$src/$f" "$dst/$f"
  echo "copied $f"
done
{{- end }}

{{/*
Init containers that give a pod its model files. Takes (dict "ctx" $ "image" IMAGE "folder"
FOLDER "files" "a ?b" "dst" DIR): with files, copies them from the models volume into the
emptyDir "model-files" (mounted at dst by the caller); without, only waits for the download
Job's marker of the folder (and renders nothing when there is nothing to wait for).
*/}}
{{- define "specd.modelInitContainers" -}}
{{- $ctx := .ctx }}
{{- $m := $ctx.Values.models }}
{{- $wait := include "specd.waitsForDownload" $ctx }}
{{- if and (ne $m.source "image") (or .files $wait) }}
initContainers:
  - name: {{ ternary "model-files" "wait-for-model" (not (empty .files)) }}
    image: {{ .image }}
    imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
    command:
      - sh
      - -c
      - |
        {{- include "specd.modelInitScript" $ctx | nindent 8 }}
      - model-init
      - {{ printf "/model-source/%s" .folder | quote }}
      - {{ default "-" .dst | quote }}
      - {{ ternary "1" "0" (eq $wait "true") | quote }}
      {{- range (splitList " " (default "" .files)) }}
      {{- if . }}
      - {{ . | quote }}
      {{- end }}
      {{- end }}
    resources:
      requests:
        cpu: 10m
        memory: 16Mi
      limits:
        memory: 64Mi
    securityContext:
      {{- toYaml $ctx.Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: models
        mountPath: /model-source
        readOnly: true
      {{- if .files }}
      - name: model-files
        mountPath: {{ .dst }}
      {{- end }}
{{- end }}
{{- end }}

{{/*
Volumes: /tmp (the root filesystem is read-only), the models volume, the model-files emptyDir
(withFiles) and /dev/shm when shmSize is set. Takes (dict "ctx" $ "shmSize" "16Gi" "withFiles"
true).
*/}}
{{- define "specd.volumes" -}}
volumes:
  - name: tmp
    emptyDir: {}
  {{- with (include "specd.modelsVolume" .ctx | trim) }}{{ . | nindent 2 }}{{ end }}
  {{- if and .withFiles (ne .ctx.Values.models.source "image") }}
  - name: model-files
    emptyDir:
      sizeLimit: 256Mi
  {{- end }}
  {{- if .shmSize }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ .shmSize }}
  {{- end }}
  {{- $sec := .ctx.Values.security }}
  {{- if $sec.tls.enabled }}
  - name: tls
    secret:
      secretName: {{ include "specd.tlsSecretName" .ctx }}
  {{- end }}
  {{- if and .tokens $sec.tokens.enabled }}
  - name: tokens
    secret:
      secretName: {{ include "specd.tokenSecretName" .ctx }}
  {{- end }}
{{- end }}

{{/*
Volume mounts of a main container: /tmp, and either its own model folder from the models
volume (folder; subPath, so that draft and verify see only their model) or the copied files
at dst (withFiles), and /dev/shm. Takes (dict "ctx" $ "folder" F "withFiles" B "dst" D
"shmSize" S).
*/}}
{{- define "specd.volumeMounts" -}}
{{- $m := .ctx.Values.models }}
volumeMounts:
  - name: tmp
    mountPath: /tmp
  {{- if ne $m.source "image" }}
  {{- if .withFiles }}
  - name: model-files
    mountPath: {{ .dst }}
    readOnly: true
  {{- else if .folder }}
  - name: models
    mountPath: {{ printf "%s/%s" (trimSuffix "/" $m.mountPath) .folder }}
    subPath: {{ .folder }}
    readOnly: true
  {{- end }}
  {{- end }}
  {{- if .shmSize }}
  - name: dshm
    mountPath: /dev/shm
  {{- end }}
  {{- $sec := .ctx.Values.security }}
  {{- if $sec.tls.enabled }}
  - name: tls
    mountPath: /etc/specd/tls
    readOnly: true
  {{- end }}
  {{- if and .tokens $sec.tokens.enabled }}
  - name: tokens
    mountPath: /etc/specd/tokens
    readOnly: true
  {{- end }}
{{- end }}

{{/*
Container ports (grpc: ports.<component>) and gRPC health probes. Takes (dict "ctx" $
"component" "router").
Readiness asks for "" (the model is loaded; for the router, its verify service is up). Liveness
asks for the "liveness" service, SERVING whenever the process answers: a router whose verify
service is down is not ready, but restarting it would not help. The startup probe of a model
service waits for its model (long loads); the router's only for its process.
*/}}
{{- define "specd.portsAndProbes" -}}
{{- $p := .ctx.Values.probes }}
{{- $port := index .ctx.Values.ports .component }}
ports:
  - name: grpc
    containerPort: {{ $port }}
    protocol: TCP
  - name: metrics
    containerPort: {{ .ctx.Values.ports.metrics }}
    protocol: TCP
{{- if .ctx.Values.security.tls.enabled }}
{{- /* The kubelet's gRPC probes speak plaintext only: with TLS on, readiness asks the
plaintext /health of the metrics listener (200 exactly when gRPC health says SERVING), and
startup and liveness check that the process accepts connections. */}}
startupProbe:
  {{- if eq .component "router" }}
  tcpSocket:
    port: metrics
  {{- else }}
  httpGet:
    path: /health
    port: metrics
  {{- end }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
readinessProbe:
  httpGet:
    path: /health
    port: metrics
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
livenessProbe:
  tcpSocket:
    port: metrics
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
{{- else }}
startupProbe:
  grpc:
    port: {{ $port }}
    {{- if eq .component "router" }}
    service: liveness
    {{- end }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
livenessProbe:
  grpc:
    port: {{ $port }}
    service: liveness
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
{{- end }}
{{- end }}

{{/*
Names of the Secrets with the TLS files (tls.crt, tls.key, ca.crt) and the API tokens.
*/}}
{{- define "specd.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "specd.fullname" .)) .Values.security.tls.existingSecret }}
{{- end }}

{{- define "specd.tokenSecretName" -}}
{{- default (printf "%s-tokens" (include "specd.fullname" .)) .Values.security.tokens.existingSecret }}
{{- end }}

{{/*
TLS flags of a component's server: its certificate, and for draft and verify (and the router
with security.tls.requireClientCert) the CA that must sign the client's. Takes (dict "ctx" $
"component" C).
*/}}
{{- define "specd.tlsArgs" -}}
{{- $sec := .ctx.Values.security }}
{{- if $sec.tls.enabled }}
- --tls_cert=/etc/specd/tls/tls.crt
- --tls_key=/etc/specd/tls/tls.key
{{- if or (has .component (list "draft" "verify")) (and (eq .component "router") $sec.tls.requireClientCert) }}
- --tls_client_ca=/etc/specd/tls/ca.crt
{{- end }}
{{- if eq .component "router" }}
- --upstream_tls_ca=/etc/specd/tls/ca.crt
- --upstream_tls_cert=/etc/specd/tls/tls.crt
- --upstream_tls_key=/etc/specd/tls/tls.key
{{- end }}
{{- if eq .component "http" }}
- --router_tls_ca=/etc/specd/tls/ca.crt
{{- if $sec.tls.requireClientCert }}
- --router_tls_cert=/etc/specd/tls/tls.crt
- --router_tls_key=/etc/specd/tls/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- if and $sec.tokens.enabled (has .component (list "router" "http")) }}
- --token_file=/etc/specd/tokens/{{ $sec.tokens.key }}
{{- if eq .component "http" }}
- --router_token_file=/etc/specd/tokens/{{ $sec.tokens.key }}
{{- end }}
{{- end }}
{{- end }}

{{/*
GPU resources: adds `<gpu.resourceName>: count` to limits (and requests) of a component.
Takes (dict "ctx" $ "resources" .Values.draft.resources "gpus" 1).
*/}}
{{- define "specd.resources" -}}
{{- $r := deepCopy (default (dict) .resources) }}
{{- if gt (int .gpus) 0 }}
{{- $name := .ctx.Values.gpu.resourceName }}
{{- $_ := set $r "limits" (merge (dict $name (int .gpus)) (default (dict) $r.limits)) }}
{{- $_ := set $r "requests" (merge (dict $name (int .gpus)) (default (dict) $r.requests)) }}
{{- end }}
{{- with $r }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Environment of the GPU services. NCCL_NVLS_ENABLE=0 always: specd never uses NVLink
multicast (docs/tensor-parallel.md), and NCCL's NVLS setup fails on hosts without it configured.
*/}}
{{- define "specd.gpuEnv" -}}
- name: NCCL_NVLS_ENABLE
  value: "0"
{{- end }}

{{/*
Devices flag for tensor-parallel verify: "cuda:0,cuda:1,...,cuda:N-1", one device per rank (the
GPUs the device plugin gives the container are numbered from 0 inside it).
*/}}
{{- define "specd.deviceList" -}}
{{- $ids := list }}
{{- range $i := until (int .) }}
{{- $ids = append $ids (printf "cuda:%d" $i) }}
{{- end }}
{{- join "," $ids }}
{{- end }}

{{/*
The router's --verify_address and --draft_address: the headless Service of the tier as a DNS
name (dns:///<release>-verify-headless:PORT), which resolves to every pod of it. The router keeps
one Step stream per verify pod (a verify group) and per draft pod, places each new sequence on
the least-loaded of each, and resolves the name again every --dns_refresh_seconds, so scaling
either tier needs no new router flags (a ClusterIP Service would pin each router to whichever
pod its one connection reached).
*/}}
{{- define "specd.verifyAddresses" -}}
{{- $name := include "specd.componentName" (dict "ctx" . "component" "verify") -}}
{{- printf "dns:///%s-headless:%v" $name .Values.ports.verify -}}
{{- end -}}
{{- define "specd.draftAddresses" -}}
{{- $name := include "specd.componentName" (dict "ctx" . "component" "draft") -}}
{{- printf "dns:///%s-headless:%v" $name .Values.ports.draft -}}
{{- end -}}
