{{/* Names and labels. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>, or <release>-<chart> when the release name does not contain the chart name.
Truncated to 40 so that "<fullname>-prefill-<ordinal>" stays a valid DNS label. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{/* A component's labels: (dict "root" $ "component" "prefill") */}}
{{- define "tandem.componentSelectorLabels" -}}
{{ include "tandem.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.componentLabels" -}}
{{ include "tandem.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The worker tiers rendered, as "key:role:component" strings (aggregated workers run with
--role both). */}}
{{- define "tandem.workerTiers" -}}
{{- if .Values.aggregated.enabled }}
{{- list "aggregated:both:both" | toJson }}
{{- else }}
{{- list "prefill:prefill:prefill" "decode:decode:decode" | toJson }}
{{- end }}
{{- end }}

{{/* A worker tier as the router's target: the headless Service's DNS name, which resolves to
every pod of the tier and which the router re-resolves on each health check, so scaling needs no
router restart: dns:///<fullname>-<component>.<ns>.svc[.<clusterDomain>]:<port>.
(dict "root" $ "component" "prefill" "tier" .Values.prefill) */}}
{{- define "tandem.workerAddresses" -}}
{{- $name := printf "%s-%s" (include "tandem.fullname" .root) .component }}
{{- $domain := printf "%s.svc" .root.Release.Namespace }}
{{- if .root.Values.clusterDomain }}
{{- $domain = printf "%s.%s" $domain .root.Values.clusterDomain }}
{{- end }}
{{- printf "dns:///%s.%s:%d" $name $domain (int .tier.port) }}
{{- end }}

{{/* The image of a tier: (dict "root" $ "tier" .Values.prefill), the tier's image block over the
global one; the tag defaults to <appVersion>-rocm for AMD tiers, <appVersion>-cuda otherwise. */}}
{{- define "tandem.image" -}}
{{- $image := merge (deepCopy (.tier.image | default dict)) (deepCopy .root.Values.image) }}
{{- $flavor := "cuda" }}
{{- if and .tier.gpu (eq (.tier.gpu.vendor | toString) "amd") }}
{{- $flavor = "rocm" }}
{{- end }}
{{- $tag := $image.tag | default (printf "%s-%s" .root.Chart.AppVersion $flavor) }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository $tag }}
{{- end }}
{{- end }}

{{- define "tandem.imagePullPolicy" -}}
{{- (.tier.image | default dict).pullPolicy | default .root.Values.image.pullPolicy }}
{{- end }}

{{/* The folder passed as --model. */}}
{{- define "tandem.modelPath" -}}
{{- $m := .Values.model }}
{{- if $m.defaultModel }}
{{- printf "%s/models/SmolLM2-135M-Instruct" $m.mountPath }}
{{- else if $m.path }}
{{- printf "%s/%s" $m.mountPath (trimSuffix "/" $m.path) }}
{{- else }}
{{- $m.mountPath }}
{{- end }}
{{- end }}

{{/* Environment shared by every container: writable caches on the "cache" emptyDir (the root
filesystem is read-only). */}}
{{- define "tandem.env" -}}
- name: HOME
  value: /var/cache/tandem
- name: XDG_CACHE_HOME
  value: /var/cache/tandem/.cache
- name: TRITON_CACHE_DIR
  value: /var/cache/tandem/.cache/triton
- name: HF_HOME
  value: /var/cache/tandem/.cache/huggingface
- name: TMPDIR
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
{{- end }}

{{/* Pod volumes: model, caches, /tmp, optional /dev/shm and TLS. (dict "root" $ "shm" bool) */}}
{{- define "tandem.volumes" -}}
{{- $v := .root.Values.model.volume }}
- name: model
{{- if eq $v.type "persistentVolumeClaim" }}
  persistentVolumeClaim:
    claimName: {{ $v.claimName }}
    readOnly: {{ not .root.Values.model.defaultModel }}
{{- else if eq $v.type "hostPath" }}
  hostPath:
    path: {{ $v.hostPath }}
    {{- with $v.hostPathType }}
    type: {{ . }}
    {{- end }}
{{- else }}
  emptyDir:
    {{- if $v.sizeLimit }}
    sizeLimit: {{ $v.sizeLimit }}
    {{- else }} {}
    {{- end }}
{{- end }}
- name: cache
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- if and .shm .root.Values.shmSize }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .root.Values.shmSize }}
{{- end }}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .root.Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
- name: internal-token
  secret:
    secretName: {{ include "tandem.internalTokenSecret" .root }}
    defaultMode: 0440
    items:
      - key: {{ .root.Values.internalToken.key }}
        path: token
{{- end }}

{{- define "tandem.volumeMounts" -}}
- name: model
  mountPath: {{ .root.Values.model.mountPath }}
  readOnly: true
  {{- with .root.Values.model.volume.subPath }}
  subPath: {{ . }}
  {{- end }}
- name: cache
  mountPath: /var/cache/tandem
- name: tmp
  mountPath: /tmp
{{- if and .shm .root.Values.shmSize }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- if .root.Values.tls.enabled }}
- name: tls
  mountPath: /etc/tandem/tls
  readOnly: true
{{- end }}
- name: internal-token
  mountPath: /etc/tandem/internal-token
  readOnly: true
{{- end }}

{{/* The init container that converts the default model into the model volume
(tandem.common.default_model; a no-op when the volume already holds it). (dict "root" $ "tier" ...) */}}
{{- define "tandem.defaultModelInit" -}}
{{- if .root.Values.model.defaultModel }}
- name: default-model
  image: {{ include "tandem.image" . }}
  imagePullPolicy: {{ include "tandem.imagePullPolicy" . }}
  command: ["python", "-c", "from tandem.common.default_model import ensure_default_model; print(ensure_default_model())"]
  env:
    {{- include "tandem.env" .root | trim | nindent 4 }}
    - name: TANDEM_CACHE_DIR
      value: {{ .root.Values.model.mountPath }}
  securityContext:
    {{- toYaml .root.Values.containerSecurityContext | nindent 4 }}
  resources:
    {{- toYaml (omit .tier.resources "limits") | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ .root.Values.model.mountPath }}
      {{- with .root.Values.model.volume.subPath }}
      subPath: {{ . }}
      {{- end }}
    - name: cache
      mountPath: /var/cache/tandem
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* --tls-* flags, only with tls.enabled: mutual TLS on every connection; peers are dialled by
pod IP, so every certificate must carry tls.serverName, which peers verify. */}}
{{- define "tandem.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert
- /etc/tandem/tls/tls.crt
- --tls-key
- /etc/tandem/tls/tls.key
- --tls-ca
- /etc/tandem/tls/ca.crt
- --tls-server-name
- {{ .Values.tls.serverName | quote }}
{{- end }}
{{- end }}

{{/* The Secret holding the internal token: internalToken.existingSecret, or the one
templates/internal-token.yaml generates. */}}
{{- define "tandem.internalTokenSecret" -}}
{{- .Values.internalToken.existingSecret | default (printf "%s-internal-token" (include "tandem.fullname" .)) }}
{{- end }}

{{/* --internal-token-file: the router and every worker send the token on each internal call and
workers refuse Worker/KVTransfer calls without it (with or without TLS). */}}
{{- define "tandem.internalTokenArgs" -}}
- --internal-token-file
- /etc/tandem/internal-token/token
{{- end }}

{{/* A probe: gRPC health of `service` on `port`, or a TCP check of the port with TLS on
(kubelet's gRPC probe is plaintext only). (dict "root" $ "port" 7001 "service" "" "timing" ...) */}}
{{- define "tandem.probe" -}}
{{- if .root.Values.tls.enabled }}
tcpSocket:
  port: grpc
{{- else }}
grpc:
  port: {{ int .port }}
  service: {{ .service | quote }}
{{- end }}
{{- range $key, $value := .timing }}
{{ $key }}: {{ int $value }}
{{- end }}
{{- end }}

{{/* The PodDisruptionBudget's budget: minAvailable when set, else maxUnavailable. */}}
{{- define "tandem.pdbBudget" -}}
{{- if not (kindIs "invalid" .minAvailable) }}
minAvailable: {{ .minAvailable }}
{{- else }}
maxUnavailable: {{ ternary 1 .maxUnavailable (kindIs "invalid" .maxUnavailable) }}
{{- end }}
{{- end }}
