{{/*
etrain.validate: rejects value combinations that a JSON schema cannot express, each with a message that
names the key and the fix. Included at the top of the controller Deployment, so `helm install`,
`helm upgrade` and `helm template` all stop on the first problem. (`helm lint` turns `fail` into a log
line by design; the chart's tests therefore render with each values file.)
*/}}
{{- define "etrain.validate" -}}
{{- $v := .Values }}
{{- $external := include "etrain.etcd.isExternal" . }}

{{- /* shared checkpoint storage */}}
{{- if eq $v.storage.type "pvc" }}
{{- if and (not $v.storage.pvc.existingClaim) (not $v.storage.pvc.create) }}
{{- fail "etrain: storage is missing: checkpoints need storage shared by every node. Set storage.pvc.existingClaim (a ReadWriteMany claim, e.g. on Lustre), or storage.pvc.create=true with storage.pvc.storageClassName, or storage.type=s3 with storage.s3.bucket and storage.s3.existingSecret." }}
{{- end }}
{{- if and $v.storage.pvc.existingClaim $v.storage.pvc.create }}
{{- fail "etrain: storage.pvc.existingClaim and storage.pvc.create=true exclude each other: use the existing claim or let the chart create one." }}
{{- end }}
{{- if and $v.storage.pvc.create (not $v.storage.pvc.storageClassName) }}
{{- fail "etrain: storage.pvc.create=true needs storage.pvc.storageClassName: a class that provides ReadWriteMany volumes (e.g. a Lustre CSI class); cluster default classes are usually ReadWriteOnce." }}
{{- end }}
{{- else if eq $v.storage.type "s3" }}
{{- if not $v.storage.s3.bucket }}
{{- fail "etrain: storage.type=s3 needs storage.s3.bucket." }}
{{- end }}
{{- if and (not $v.storage.s3.existingSecret) (not $v.storage.s3.useAmbientCredentials) }}
{{- fail "etrain: storage.type=s3 needs credentials: set storage.s3.existingSecret (a Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), or storage.s3.useAmbientCredentials=true with serviceAccount.annotations that grant S3 access." }}
{{- end }}
{{- end }}

{{- /* agents */}}
{{- with $v.agent.autoscaling }}
{{- if .enabled }}
{{- if gt (int .minReplicas) (int .maxReplicas) }}
{{- fail (printf "etrain: agent.autoscaling.minReplicas (%d) is greater than agent.autoscaling.maxReplicas (%d): the agent pool needs min nodes <= max nodes." (int .minReplicas) (int .maxReplicas)) }}
{{- end }}
{{- if ne $v.agent.kind "StatefulSet" }}
{{- fail "etrain: agent.autoscaling.enabled=true needs agent.kind=StatefulSet: a DaemonSet has one agent per matching node and cannot be scaled." }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq $v.agent.rdzvHost "dns") (ne $v.agent.kind "StatefulSet") }}
{{- fail "etrain: agent.rdzvHost=dns needs agent.kind=StatefulSet (only StatefulSet pods get stable DNS names); use agent.rdzvHost=podIP with a DaemonSet." }}
{{- end }}
{{- if and $v.agent.hostNetwork (eq $v.agent.rdzvHost "dns") }}
{{- fail "etrain: agent.hostNetwork=true needs agent.rdzvHost=podIP: with host networking the pod IP is the node IP, and the headless-service DNS name would not match the sockets workers bind." }}
{{- end }}

{{- /* in-cluster etcd */}}
{{- if not $external }}
{{- if eq (mod (int $v.etcd.replicas) 2) 0 }}
{{- fail (printf "etrain: etcd.replicas must be odd (1, 3, 5, ...), got %d: an even member count tolerates no more failures than the odd count below it." (int $v.etcd.replicas)) }}
{{- end }}
{{- if and (not $v.etcd.tls.enabled) (not $v.etcd.tls.allowInsecure) }}
{{- fail "etrain: etcd.tls.enabled=false needs etcd.tls.allowInsecure=true: without TLS any pod that reaches etcd's client port can read and write every key, including the work agents run. Keep etcd.tls.enabled=true, or confirm with etcd.tls.allowInsecure=true." }}
{{- end }}
{{- if and (not $v.etcd.tls.enabled) (or $v.etcd.tls.existingSecret $v.etcd.tls.existingClientSecret $v.etcd.tls.extraSANs) }}
{{- fail "etrain: etcd.tls.existingSecret, etcd.tls.existingClientSecret and etcd.tls.extraSANs need etcd.tls.enabled=true." }}
{{- end }}
{{- if and $v.etcd.auth.perNodeUsers (or (ne $v.agent.kind "StatefulSet") $v.agent.autoscaling.enabled) }}
{{- fail "etrain: etcd.auth.perNodeUsers=true needs agent.kind=StatefulSet and agent.autoscaling.enabled=false: each agent gets an etcd user and a password Secret of its own, made for agent.replicas agents." }}
{{- end }}
{{- if and $v.etcd.auth.enabled (or (not $v.etcd.auth.agentUser) (eq (toString $v.etcd.auth.agentUser) "root")) }}
{{- fail "etrain: etcd.auth.agentUser must be a user name other than root: the agents get the release's keys only, root stays with the controller." }}
{{- end }}
{{- if and $v.etcd.tls.existingClientSecret (not $v.etcd.tls.existingSecret) }}
{{- fail "etrain: etcd.tls.existingClientSecret needs etcd.tls.existingSecret: a client certificate from your CA cannot be checked by members whose certificates the chart generates with its own CA." }}
{{- end }}
{{- if and $v.etcd.tls.existingSecret $v.etcd.tls.extraSANs }}
{{- fail "etrain: etcd.tls.extraSANs applies to the generated certificate only: with etcd.tls.existingSecret, put the names in that certificate." }}
{{- end }}
{{- else }}
{{- if or $v.etcd.tls.existingSecret $v.etcd.tls.existingClientSecret $v.etcd.tls.extraSANs }}
{{- fail "etrain: etcd.tls.* configures the in-cluster etcd, which etcd.external.endpoints replaces: use etcd.external.tls for your own etcd." }}
{{- end }}
{{- if and $v.etcd.external.tls.enabled (not $v.etcd.external.tls.existingSecret) }}
{{- fail "etrain: etcd.external.tls.enabled=true needs etcd.external.tls.existingSecret (a Secret with ca.crt, and tls.crt/tls.key for client certificates)." }}
{{- end }}
{{- if and $v.etcd.external.auth.username (not $v.etcd.external.auth.existingSecret) }}
{{- fail "etrain: etcd.external.auth.username needs etcd.external.auth.existingSecret (a Secret with the user's password)." }}
{{- end }}
{{- end }}

{{- /* API authentication (tokens are generated when neither existingSecret nor tokens is set) */}}
{{- if $v.auth.enabled }}
{{- if and $v.auth.existingSecret $v.auth.tokens }}
{{- fail "etrain: auth.existingSecret and auth.tokens exclude each other: keep tokens in one place." }}
{{- end }}
{{- else }}
{{- if not $v.auth.allowInsecure }}
{{- fail "etrain: auth.enabled=false needs auth.allowInsecure=true: without tokens anyone who reaches the controller API can submit jobs, i.e. run code on every agent node. Keep auth.enabled=true (the chart generates tokens when none are given), or confirm with auth.allowInsecure=true." }}
{{- end }}
{{- if or $v.auth.existingSecret $v.auth.tokens }}
{{- fail "etrain: auth.existingSecret or auth.tokens is set but auth.enabled=false: the tokens would be ignored. Set auth.enabled=true, or remove them." }}
{{- end }}
{{- end }}

{{- /* network policies */}}
{{- if $v.networkPolicy.enabled }}
{{- if and $v.agent.hostNetwork (not $v.networkPolicy.nodeCIDRs) }}
{{- fail "etrain: agent.hostNetwork=true with networkPolicy.enabled=true needs networkPolicy.nodeCIDRs: host-network agents connect from node addresses, which no pod selector matches, so etcd and the other agents would refuse them. List the nodes' CIDRs, or set networkPolicy.enabled=false." }}
{{- end }}
{{- if and (ne $v.controller.service.type "ClusterIP") (not $v.networkPolicy.controller.extraFrom) }}
{{- fail (printf "etrain: controller.service.type=%s with networkPolicy.enabled=true needs networkPolicy.controller.extraFrom: the NetworkPolicy admits only in-cluster clients, so the %s would not reach the API. Add the clients, e.g. [{ipBlock: {cidr: 0.0.0.0/0}}], or set networkPolicy.enabled=false." $v.controller.service.type $v.controller.service.type) }}
{{- end }}
{{- end }}
{{- end }}
