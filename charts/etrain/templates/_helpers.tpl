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

{{/* True (non-empty) when the in-cluster etcd runs with mutual TLS (etcd.tls.enabled). */}}
{{- define "etrain.etcd.inClusterTls" -}}
{{- if and (not (include "etrain.etcd.isExternal" .)) .Values.etcd.tls.enabled }}true{{ end }}
{{- end }}

{{/* True (non-empty) when the in-cluster etcd has users (etcd.auth.enabled, over TLS only: passwords on plain gRPC
would be readable on the network): the controller is root, agents etcd.auth.agentUser. */}}
{{- define "etrain.etcd.inClusterAuth" -}}
{{- if and (include "etrain.etcd.inClusterTls" .) .Values.etcd.auth.enabled }}true{{ end }}
{{- end }}

{{/* True (non-empty) when each agent has an etcd user of its own (etcd.auth.perNodeUsers with the in-cluster etcd's
users): agent.replicas StatefulSets of one pod each. */}}
{{- define "etrain.agent.perNodeUsers" -}}
{{- if and (include "etrain.etcd.inClusterAuth" .) .Values.etcd.auth.perNodeUsers }}true{{ end }}
{{- end }}

{{/* The node name of agent number (dict "ctx" . "index" i) with per-node users, also its StatefulSet's name. */}}
{{- define "etrain.agent.indexedName" -}}
{{- printf "%s-agent-%d" (include "etrain.fullname" .ctx) (int .index) }}
{{- end }}

{{/* The Secret with agent number (dict "ctx" . "index" i)'s etcd password (key "password"). */}}
{{- define "etrain.etcd.nodeSecret" -}}
{{- printf "%s-etcd-node-%d" (include "etrain.fullname" .ctx) (int .index) }}
{{- end }}

{{/* The Secret with the in-cluster etcd's root-password and agent-password. */}}
{{- define "etrain.etcd.authSecret" -}}
{{- default (printf "%s-etcd-users" (include "etrain.fullname" .)) .Values.etcd.auth.existingSecret }}
{{- end }}

{{/* True (non-empty) when the component's pods authenticate to etcd with a user and password file. */}}
{{- define "etrain.etcd.usesPassword" -}}
{{- if or (include "etrain.etcd.inClusterAuth" .) (and (include "etrain.etcd.isExternal" .) .Values.etcd.external.auth.username) }}true{{ end }}
{{- end }}

{{/* URL scheme of the in-cluster etcd's client and peer URLs. */}}
{{- define "etrain.etcd.scheme" -}}
{{- ternary "https" "http" (not (empty (include "etrain.etcd.inClusterTls" .))) }}
{{- end }}

{{/* Secret with the in-cluster members' ca.crt, tls.crt, tls.key (server and peer certificate). */}}
{{- define "etrain.etcd.serverTlsSecret" -}}
{{- default (printf "%s-etcd-server-tls" (include "etrain.fullname" .)) .Values.etcd.tls.existingSecret }}
{{- end }}

{{/* Secret with the client certificate (ca.crt, tls.crt, tls.key) of the controller and agents. */}}
{{- define "etrain.etcd.clientTlsSecret" -}}
{{- if include "etrain.etcd.isExternal" . }}
{{- .Values.etcd.external.tls.existingSecret }}
{{- else if .Values.etcd.tls.existingClientSecret }}
{{- .Values.etcd.tls.existingClientSecret }}
{{- else if .Values.etcd.tls.existingSecret }}
{{- .Values.etcd.tls.existingSecret }}
{{- else }}
{{- printf "%s-etcd-client-tls" (include "etrain.fullname" .) }}
{{- end }}
{{- end }}

{{/* True (non-empty) when the controller and agents talk TLS to etcd (in-cluster or external). */}}
{{- define "etrain.etcd.clientUsesTls" -}}
{{- if include "etrain.etcd.isExternal" . }}
{{- if .Values.etcd.external.tls.enabled }}true{{ end }}
{{- else }}
{{- include "etrain.etcd.inClusterTls" . }}
{{- end }}
{{- end }}

{{/* True (non-empty) when they also present a client certificate. */}}
{{- define "etrain.etcd.clientPresentsCert" -}}
{{- if include "etrain.etcd.isExternal" . }}
{{- if and .Values.etcd.external.tls.enabled .Values.etcd.external.tls.clientCertificate }}true{{ end }}
{{- else }}
{{- include "etrain.etcd.inClusterTls" . }}
{{- end }}
{{- end }}

{{/* Subject alternative names of the generated etcd server certificate, as a JSON list: every member's
     DNS name (FQDN and the shorter forms), wildcards of the headless Service, the client Service in all
     its forms, localhost, and etcd.tls.extraSANs. */}}
{{- define "etrain.etcd.tlsSANs" -}}
{{- $fullname := include "etrain.etcd.fullname" . }}
{{- $headless := include "etrain.etcd.headless" . }}
{{- $ns := .Release.Namespace }}
{{- $domain := .Values.clusterDomain }}
{{- $sans := list "localhost" }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $sans = append $sans (printf "%s-%d.%s.%s.svc.%s" $fullname $i $headless $ns $domain) }}
{{- $sans = append $sans (printf "%s-%d.%s.%s.svc" $fullname $i $headless $ns) }}
{{- $sans = append $sans (printf "%s-%d.%s" $fullname $i $headless) }}
{{- end }}
{{- $sans = append $sans (printf "*.%s.%s.svc.%s" $headless $ns $domain) }}
{{- $sans = append $sans (printf "*.%s.%s.svc" $headless $ns) }}
{{- range list $fullname (printf "%s.%s" $fullname $ns) (printf "%s.%s.svc" $fullname $ns) (printf "%s.%s.svc.%s" $fullname $ns $domain) }}
{{- $sans = append $sans . }}
{{- end }}
{{- range .Values.etcd.tls.extraSANs }}
{{- $sans = append $sans . }}
{{- end }}
{{- toJson (uniq $sans) }}
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
{{- $hosts = append $hosts (printf "%s://%s:%d" (include "etrain.etcd.scheme" $ctx) (include "etrain.etcd.memberHost" (dict "ctx" $ctx "i" $i)) (int $ctx.Values.etcd.clientPort)) }}
{{- end }}
{{- join "," $hosts }}
{{- end }}
{{- end }}

{{/* The initial-cluster flag value of the in-cluster etcd. */}}
{{- define "etrain.etcd.initialCluster" -}}
{{- $ctx := . }}
{{- $members := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $members = append $members (printf "%s-%d=%s://%s:%d" (include "etrain.etcd.fullname" $ctx) $i (include "etrain.etcd.scheme" $ctx) (include "etrain.etcd.memberHost" (dict "ctx" $ctx "i" $i)) (int $ctx.Values.etcd.peerPort)) }}
{{- end }}
{{- join "," $members }}
{{- end }}

{{/* Name of the Secret holding the API tokens file. */}}
{{- define "etrain.auth.secretName" -}}
{{- default (printf "%s-auth" (include "etrain.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* True (non-empty) when the chart writes the tokens Secret (from auth.tokens or generated). */}}
{{- define "etrain.auth.chartManaged" -}}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) }}true{{ end }}
{{- end }}

{{/* The chart-managed tokens, as JSON {"generated": bool, "tokens": [...]}: auth.tokens when given, else an
     admin and a read token generated with randAlphaNum, reused from the release's existing Secret (lookup)
     so that `helm upgrade` keeps them. Memoized in the root context: the Secret and the controller's
     checksum annotation see the same tokens within one render. */}}
{{- define "etrain.auth.tokens" -}}
{{- if not (hasKey . "etrainAuthTokens") }}
{{- $out := dict "generated" false "tokens" .Values.auth.tokens }}
{{- if not .Values.auth.tokens }}
{{- $admin := randAlphaNum 40 }}
{{- $read := randAlphaNum 40 }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "etrain.auth.secretName" .) }}
{{- if and $existing (index ($existing.metadata.annotations | default dict) "etrain.io/generated-tokens") }}
{{- $data := $existing.data | default dict }}
{{- if and (index $data "admin-token") (index $data "read-token") }}
{{- $admin = index $data "admin-token" | b64dec }}
{{- $read = index $data "read-token" | b64dec }}
{{- end }}
{{- end }}
{{- $_ := set $out "generated" true }}
{{- $_ := set $out "tokens" (list (dict "name" "admin" "role" "admin" "token" $admin) (dict "name" "read" "role" "read" "token" $read)) }}
{{- end }}
{{- $_ := set . "etrainAuthTokens" (toJson $out) }}
{{- end }}
{{- index . "etrainAuthTokens" }}
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

{{/* etcd connection of a component (endpoints, TLS files, user and password file): call with
(dict "ctx" . "component" "controller"|"agent"). */}}
{{- define "etrain.etcdEnv" -}}
{{- $component := .component }}
{{- with .ctx -}}
- name: ETRAIN_ETCD_ENDPOINTS
  value: {{ include "etrain.etcd.endpoints" . | quote }}
{{- if include "etrain.etcd.clientUsesTls" . }}
- name: ETRAIN_ETCD_CA_CERT
  value: /etc/etrain/etcd-tls/ca.crt
{{- if include "etrain.etcd.clientPresentsCert" . }}
- name: ETRAIN_ETCD_CERT
  value: /etc/etrain/etcd-tls/tls.crt
- name: ETRAIN_ETCD_KEY
  value: /etc/etrain/etcd-tls/tls.key
{{- end }}
{{- end }}
{{- if include "etrain.etcd.inClusterAuth" . }}
- name: ETRAIN_ETCD_USER
  value: {{ ternary "root" ($.etcdUser | default .Values.etcd.auth.agentUser) (eq $component "controller") | quote }}
- name: ETRAIN_ETCD_PASSWORD_FILE
  value: /etc/etrain/etcd-auth/password
{{- else if include "etrain.etcd.usesPassword" . }}
- name: ETRAIN_ETCD_USER
  value: {{ .Values.etcd.external.auth.username | quote }}
- name: ETRAIN_ETCD_PASSWORD_FILE
  value: /etc/etrain/etcd-auth/password
{{- end }}
{{- end }}
{{- end }}

{{/* Environment shared by controller and agents: etcd, prefix, storage credentials. Call with
(dict "ctx" . "component" "controller"|"agent"): with the in-cluster etcd's users, the controller is root and the
agents are etcd.auth.agentUser. */}}
{{- define "etrain.commonEnv" -}}
{{- $component := .component }}
{{- $etcdUser := .etcdUser }}
{{- with .ctx }}
{{- include "etrain.etcdEnv" (dict "ctx" . "component" $component "etcdUser" $etcdUser) }}
- name: ETRAIN_PREFIX
  value: {{ .Values.prefix | quote }}
- name: TORCH_DISABLE_SHARE_RDZV_TCP_STORE
  value: "1"
- name: PYTHONUNBUFFERED
  value: "1"
- name: HOME
  value: /tmp
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
{{- end }}

{{/* Volume mounts shared by controller and agents. */}}
{{- define "etrain.commonVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if eq .Values.storage.type "pvc" }}
- name: shared
  mountPath: {{ .Values.storage.mountPath }}
{{- end }}
{{- if include "etrain.etcd.clientUsesTls" . }}
- name: etcd-tls
  mountPath: /etc/etrain/etcd-tls
  readOnly: true
{{- end }}
{{- if include "etrain.etcd.usesPassword" . }}
- name: etcd-auth
  mountPath: /etc/etrain/etcd-auth
  readOnly: true
{{- end }}
{{- end }}

{{/* Volumes shared by controller and agents: call with (dict "ctx" . "component" "controller"|"agent"), and
"secretMode" "0400" for the Secrets' file mode (default 0440: the pods' fsGroup reads them; 0400: root only, for an
agent whose jobs run as uids of their own). The controller's etcd-auth volume holds root's password and the agents'
(for its init container); an agent's holds the agents' only. */}}
{{- define "etrain.commonVolumes" -}}
{{- $ctx := .ctx | default . }}
{{- $mode := .secretMode | default "0440" }}
- name: tmp
  emptyDir: {}
{{- if eq $ctx.Values.storage.type "pvc" }}
- name: shared
  persistentVolumeClaim:
    claimName: {{ include "etrain.storage.claimName" $ctx }}
{{- end }}
{{- if include "etrain.etcd.clientUsesTls" $ctx }}
- name: etcd-tls
  secret:
    secretName: {{ include "etrain.etcd.clientTlsSecret" $ctx }}
    defaultMode: {{ $mode }}
    items:
      - key: ca.crt
        path: ca.crt
      {{- if include "etrain.etcd.clientPresentsCert" $ctx }}
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      {{- end }}
{{- end }}
{{- if and (include "etrain.etcd.inClusterAuth" $ctx) .nodeSecret }}
- name: etcd-auth
  secret:
    secretName: {{ .nodeSecret }}
    defaultMode: {{ $mode }}
    items:
      - key: password
        path: password
{{- else if include "etrain.etcd.inClusterAuth" $ctx }}
- name: etcd-auth
  secret:
    secretName: {{ include "etrain.etcd.authSecret" $ctx }}
    defaultMode: {{ $mode }}
    items:
      {{- if eq .component "controller" }}
      - key: root-password
        path: password
      - key: agent-password
        path: agent-password
      {{- else }}
      - key: agent-password
        path: password
      {{- end }}
{{- else if include "etrain.etcd.usesPassword" $ctx }}
- name: etcd-auth
  secret:
    secretName: {{ $ctx.Values.etcd.external.auth.existingSecret }}
    defaultMode: {{ $mode }}
    items:
      - key: {{ $ctx.Values.etcd.external.auth.passwordKey }}
        path: password
{{- end }}
{{- end }}

{{/* A probe: call with (dict "path" "/healthz" "port" "http" "timing" .Values.controller.livenessProbe). */}}
{{- define "etrain.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
{{- toYaml .timing | nindent 0 }}
{{- end }}
