{{/* Chart name, possibly overridden. */}}
{{- define "etrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified name: "<release>-etrain" unless the release name already contains it.
     Truncated to 40 characters so that suffixed names ("-etcd-headless", pod ordinals) stay within
     the 63-character DNS label limit. */}}
{{- define "etrain.fullname" -}}
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

{{- define "etrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels common to every object. */}}
{{- define "etrain.labels" -}}
helm.sh/chart: {{ include "etrain.chart" . }}
app.kubernetes.io/name: {{ include "etrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: etrain
{{- end }}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "controller"). */}}
{{- define "etrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "etrain.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of one component (common + selector). */}}
{{- define "etrain.componentLabels" -}}
{{ include "etrain.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "etrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "etrain.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The etrain image reference. */}}
{{- define "etrain.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* Names of the in-cluster etcd objects. */}}
{{- define "etrain.etcd.fullname" -}}
{{- printf "%s-etcd" (include "etrain.fullname" .) }}
{{- end }}
{{- define "etrain.etcd.headless" -}}
{{- printf "%s-etcd-headless" (include "etrain.fullname" .) }}
{{- end }}

{{/* True (non-empty) when an external etcd is configured. */}}
{{- define "etrain.etcd.isExternal" -}}
{{- if .Values.etcd.external.endpoints }}true{{ end }}
{{- end }}

{{/* DNS name of in-cluster etcd member $i: call with (dict "ctx" $ "i" 0). */}}
{{- define "etrain.etcd.memberHost" -}}
{{- printf "%s-%d.%s.%s.svc.%s" (include "etrain.etcd.fullname" .ctx) (int .i) (include "etrain.etcd.headless" .ctx) .ctx.Release.Namespace .ctx.Values.clusterDomain }}
{{- end }}

{{/* The comma-separated endpoint list given to controller and agents (ETRAIN_ETCD_ENDPOINTS). */}}
{{- define "etrain.etcd.endpoints" -}}
{{- if include "etrain.etcd.isExternal" . }}
{{- join "," .Values.etcd.external.endpoints }}
{{- else }}
{{- $ctx := . }}
{{- $hosts := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $hosts = append $hosts (printf "%s:%d" (include "etrain.etcd.memberHost" (dict "ctx" $ctx "i" $i)) (int $ctx.Values.etcd.clientPort)) }}
{{- end }}
{{- join "," $hosts }}
{{- end }}
{{- end }}

{{/* The initial-cluster flag value of the in-cluster etcd. */}}
{{- define "etrain.etcd.initialCluster" -}}
{{- $ctx := . }}
{{- $members := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $members = append $members (printf "%s-%d=http://%s:%d" (include "etrain.etcd.fullname" $ctx) $i (include "etrain.etcd.memberHost" (dict "ctx" $ctx "i" $i)) (int $ctx.Values.etcd.peerPort)) }}
{{- end }}
{{- join "," $members }}
{{- end }}

{{/* Name of the Secret holding the API tokens file. */}}
{{- define "etrain.auth.secretName" -}}
{{- default (printf "%s-auth" (include "etrain.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* Name of the checkpoint volume's claim. */}}
{{- define "etrain.storage.claimName" -}}
{{- default (printf "%s-shared" (include "etrain.fullname" .)) .Values.storage.pvc.existingClaim }}
{{- end }}

{{/* Worker processes per node. */}}
{{- define "etrain.agent.nproc" -}}
{{- if gt (int .Values.agent.nprocPerNode) 0 }}
{{- int .Values.agent.nprocPerNode }}
{{- else if gt (int .Values.agent.gpusPerNode) 0 }}
{{- int .Values.agent.gpusPerNode }}
{{- else }}1{{ end }}
{{- end }}

{{/* Environment shared by controller and agents: etcd, prefix, storage credentials. */}}
{{- define "etrain.commonEnv" -}}
- name: ETRAIN_ETCD_ENDPOINTS
  value: {{ include "etrain.etcd.endpoints" . | quote }}
- name: ETRAIN_PREFIX
  value: {{ .Values.prefix | quote }}
- name: TORCH_DISABLE_SHARE_RDZV_TCP_STORE
  value: "1"
- name: PYTHONUNBUFFERED
  value: "1"
- name: HOME
  value: /tmp
{{- if include "etrain.etcd.isExternal" . }}
{{- with .Values.etcd.external.tls }}
{{- if .enabled }}
- name: ETRAIN_ETCD_CA_CERT
  value: /etc/etrain/etcd-tls/ca.crt
{{- if .clientCertificate }}
- name: ETRAIN_ETCD_CERT
  value: /etc/etrain/etcd-tls/tls.crt
- name: ETRAIN_ETCD_KEY
  value: /etc/etrain/etcd-tls/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- if .Values.etcd.external.auth.username }}
- name: ETRAIN_ETCD_USER
  value: {{ .Values.etcd.external.auth.username | quote }}
- name: ETRAIN_ETCD_PASSWORD_FILE
  value: /etc/etrain/etcd-auth/password
{{- end }}
{{- end }}
{{- if eq .Values.storage.type "s3" }}
{{- with .Values.storage.s3 }}
{{- if not .useAmbientCredentials }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .secretAccessKeyKey }}
{{- if .sessionTokenKey }}
- name: AWS_SESSION_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .sessionTokenKey }}
{{- end }}
{{- end }}
{{- if .region }}
- name: AWS_REGION
  value: {{ .region | quote }}
- name: AWS_DEFAULT_REGION
  value: {{ .region | quote }}
{{- end }}
{{- if .endpoint }}
- name: AWS_ENDPOINT_URL
  value: {{ .endpoint | quote }}
- name: AWS_ENDPOINT_URL_S3
  value: {{ .endpoint | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Volume mounts shared by controller and agents. */}}
{{- define "etrain.commonVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if eq .Values.storage.type "pvc" }}
- name: shared
  mountPath: {{ .Values.storage.mountPath }}
{{- end }}
{{- if include "etrain.etcd.isExternal" . }}
{{- if .Values.etcd.external.tls.enabled }}
- name: etcd-tls
  mountPath: /etc/etrain/etcd-tls
  readOnly: true
{{- end }}
{{- if .Values.etcd.external.auth.username }}
- name: etcd-auth
  mountPath: /etc/etrain/etcd-auth
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/* Volumes shared by controller and agents. */}}
{{- define "etrain.commonVolumes" -}}
- name: tmp
  emptyDir: {}
{{- if eq .Values.storage.type "pvc" }}
- name: shared
  persistentVolumeClaim:
    claimName: {{ include "etrain.storage.claimName" . }}
{{- end }}
{{- if include "etrain.etcd.isExternal" . }}
{{- if .Values.etcd.external.tls.enabled }}
- name: etcd-tls
  secret:
    secretName: {{ .Values.etcd.external.tls.existingSecret }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
      {{- if .Values.etcd.external.tls.clientCertificate }}
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      {{- end }}
{{- end }}
{{- if .Values.etcd.external.auth.username }}
- name: etcd-auth
  secret:
    secretName: {{ .Values.etcd.external.auth.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.etcd.external.auth.passwordKey }}
        path: password
{{- end }}
{{- end }}
{{- end }}

{{/* A probe: call with (dict "path" "/healthz" "port" "http" "timing" .Values.controller.livenessProbe). */}}
{{- define "etrain.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
{{- toYaml .timing | nindent 0 }}
{{- end }}
