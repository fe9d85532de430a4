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
Pod-level settings shared by every component. Takes (dict "ctx" $ "component" "draft"
"values" .Values.draft "device" "cuda").
*/}}
{{- define "specd.podSpecCommon" -}}
{{- $ctx := .ctx }}
{{- $v := .values }}
serviceAccountName: {{ include "specd.serviceAccountName" $ctx }}
automountServiceAccountToken: false
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
Init container that fills the models emptyDir (models.source = initContainer).
Takes (dict "ctx" $ "component" "draft").
*/}}
{{- define "specd.modelInitContainers" -}}
{{- $m := .ctx.Values.models }}
{{- if eq $m.source "initContainer" }}
initContainers:
  - name: fetch-models
    image: {{ $m.initContainer.image }}
    imagePullPolicy: {{ .ctx.Values.image.pullPolicy }}
    {{- with $m.initContainer.command }}
    command:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    env:
      - name: MODELS_DIR
        value: {{ $m.mountPath | quote }}
      - name: SPECD_TARGET_MODEL
        value: {{ $m.target | quote }}
      - name: SPECD_DRAFT_MODEL
        value: {{ $m.draft | quote }}
      - name: SPECD_COMPONENT
        value: {{ .component }}
      - name: HOME
        value: /tmp
      {{- with $m.initContainer.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- with $m.initContainer.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    securityContext:
      allowPrivilegeEscalation: false
      capabilities:
        drop:
          - ALL
    volumeMounts:
      - name: models
        mountPath: {{ $m.mountPath }}
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end }}

{{/*
Volumes: models (unless baked into the image), /tmp (the root filesystem is read-only), and
/dev/shm when shmSize is set. Takes (dict "ctx" $ "shmSize" "16Gi").
*/}}
{{- define "specd.volumes" -}}
{{- $m := .ctx.Values.models }}
volumes:
  - name: tmp
    emptyDir: {}
  {{- if eq $m.source "pvc" }}
  - name: models
    persistentVolumeClaim:
      claimName: {{ $m.pvc.claimName }}
      readOnly: true
  {{- else if eq $m.source "hostPath" }}
  - name: models
    hostPath:
      path: {{ $m.hostPath.path }}
      type: {{ $m.hostPath.type }}
  {{- else if eq $m.source "initContainer" }}
  - name: models
    emptyDir:
      sizeLimit: {{ $m.initContainer.sizeLimit }}
  {{- end }}
  {{- if .shmSize }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ .shmSize }}
  {{- end }}
{{- end }}

{{- define "specd.volumeMounts" -}}
{{- $m := .ctx.Values.models }}
volumeMounts:
  - name: tmp
    mountPath: /tmp
  {{- if ne $m.source "image" }}
  - name: models
    mountPath: {{ $m.mountPath }}
    readOnly: true
  {{- end }}
  {{- if .shmSize }}
  - name: dshm
    mountPath: /dev/shm
  {{- end }}
{{- end }}

{{/*
Container ports and gRPC health probes. Takes (dict "ctx" $ "component" "router").
Readiness asks for "" (the model is loaded; for the router, its verify service is up). Liveness
asks for the "liveness" service, SERVING whenever the process answers: a router whose verify
service is down is not ready, but restarting it would not help. The startup probe of a model
service waits for its model (long loads); the router's only for its process.
*/}}
{{- define "specd.portsAndProbes" -}}
{{- $p := .ctx.Values.probes }}
ports:
  - name: grpc
    containerPort: {{ .ctx.Values.ports.grpc }}
    protocol: TCP
  - name: metrics
    containerPort: {{ .ctx.Values.ports.metrics }}
    protocol: TCP
startupProbe:
  grpc:
    port: {{ .ctx.Values.ports.grpc }}
    {{- if eq .component "router" }}
    service: liveness
    {{- end }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ .ctx.Values.ports.grpc }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
livenessProbe:
  grpc:
    port: {{ .ctx.Values.ports.grpc }}
    service: liveness
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
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
multicast (see DESIGN.md), and NCCL's NVLS setup fails on hosts without it configured.
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
