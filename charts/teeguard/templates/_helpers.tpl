{{/* Chart name. */}}
{{- define "teeguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name prefix: <release>, or <release>-<chart> when the release name lacks the chart name.
Truncated to 50 so that suffixes such as "-webhook-tls" stay within 63 characters. */}}
{{- define "teeguard.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "teeguard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "teeguard.labels" -}}
helm.sh/chart: {{ include "teeguard.chart" . }}
app.kubernetes.io/name: {{ include "teeguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: teeguard
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "webhook"). */}}
{{- define "teeguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "teeguard.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects: (dict "ctx" $ "component" "webhook"). */}}
{{- define "teeguard.componentLabels" -}}
{{ include "teeguard.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "teeguard.webhook.name" -}}
{{- printf "%s-webhook" (include "teeguard.fullname" .) }}
{{- end }}

{{- define "teeguard.agent.name" -}}
{{- printf "%s-agent" (include "teeguard.fullname" .) }}
{{- end }}

{{- define "teeguard.config.name" -}}
{{- printf "%s-config" (include "teeguard.fullname" .) }}
{{- end }}

{{/* The Secret holding the webhook's serving certificate (tls.crt, tls.key, ca.crt). */}}
{{- define "teeguard.webhook.tlsSecretName" -}}
{{- if and (not .Values.certManager.enabled) .Values.webhook.tls.existingSecret }}
{{- .Values.webhook.tls.existingSecret }}
{{- else }}
{{- printf "%s-webhook-tls" (include "teeguard.fullname" .) }}
{{- end }}
{{- end }}

{{- define "teeguard.webhook.serviceAccountName" -}}
{{- default (include "teeguard.webhook.name" .) .Values.webhook.serviceAccount.name }}
{{- end }}

{{- define "teeguard.agent.serviceAccountName" -}}
{{- default (include "teeguard.agent.name" .) .Values.agent.serviceAccount.name }}
{{- end }}

{{/* image reference: (dict "image" .Values.webhook.image "ctx" $). */}}
{{- define "teeguard.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{/* The DNS names the serving certificate must carry, one per line. */}}
{{- define "teeguard.webhook.dnsNames" -}}
{{- $svc := include "teeguard.webhook.name" . }}
{{- $ns := .Release.Namespace }}
{{ $svc }}
{{ printf "%s.%s" $svc $ns }}
{{ printf "%s.%s.svc" $svc $ns }}
{{ printf "%s.%s.svc.cluster.local" $svc $ns }}
{{- end }}

{{/* Namespaces the webhooks skip: the release namespace, exempt-labelled ones and excludeNamespaces. */}}
{{- define "teeguard.webhook.namespaceSelector" -}}
namespaceSelector:
  matchExpressions:
    - key: teeguard.dev/exempt
      operator: NotIn
      values: ["true"]
    - key: kubernetes.io/metadata.name
      operator: NotIn
      values:
        {{- range (concat (list .Release.Namespace) .Values.webhook.excludeNamespaces | uniq) }}
        - {{ . | quote }}
        {{- end }}
{{- end }}

{{/* Pod-level security context shared by both workloads: (dict "uid" 65532), or (dict "root" true) for
an agent that enforces limits: UID/GID 0 so that it owns what it must open (the root-only NRI socket, the
root-owned misc.max files), while teeguard.containerSecurityContext still drops every capability. */}}
{{- define "teeguard.podSecurityContext" -}}
{{- if .root -}}
runAsNonRoot: false
runAsUser: 0
runAsGroup: 0
{{- else -}}
runAsNonRoot: true
runAsUser: {{ .uid }}
runAsGroup: {{ .uid }}
fsGroup: {{ .uid }}
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The agent's enforcement mode (config.enforcement.mode; a key set to null means the default, auto). */}}
{{- define "teeguard.agent.enforcementMode" -}}
{{- $enforcement := .Values.config.enforcement | default dict -}}
{{- $enforcement.mode | default "auto" -}}
{{- end }}

{{/* The NRI socket the agent connects to (config.enforcement.nriSocket, default /var/run/nri/nri.sock). */}}
{{- define "teeguard.agent.nriSocket" -}}
{{- $enforcement := .Values.config.enforcement | default dict -}}
{{- $enforcement.nriSocket | default "/var/run/nri/nri.sock" -}}
{{- end }}

{{/* How the agent accounts for keys (config.agent.accounting; null means the default, extendedResource). */}}
{{- define "teeguard.agent.accounting" -}}
{{- $agent := .Values.config.agent | default dict -}}
{{- $agent.accounting | default "extendedResource" -}}
{{- end }}

{{/* The DRA driver the agent is in accounting mode dra (shared/src/names.rs DRA_DRIVER). */}}
{{- define "teeguard.dra.driver" -}}
tee.teeguard.dev
{{- end }}

{{/* The kubelet's root directory on the nodes (agent.kubeletDir), without a trailing slash. */}}
{{- define "teeguard.agent.kubeletDir" -}}
{{- .Values.agent.kubeletDir | default "/var/lib/kubelet" | trimSuffix "/" -}}
{{- end }}

{{- define "teeguard.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* A webhook's clientConfig: (dict "ctx" $ "path" "/mutate" "caBundle" "<base64 PEM>").
With cert-manager the caBundle is left to its CA injector. */}}
{{- define "teeguard.webhook.clientConfig" -}}
{{- with .ctx.Values.webhook.url }}
url: {{ printf "%s%s" (trimSuffix "/" .) $.path | quote }}
{{- else }}
service:
  name: {{ include "teeguard.webhook.name" .ctx }}
  namespace: {{ .ctx.Release.Namespace }}
  path: {{ .path }}
  port: {{ .ctx.Values.webhook.service.port }}
{{- end }}
{{- if not .ctx.Values.certManager.enabled }}
caBundle: {{ .caBundle }}
{{- end }}
{{- end }}

{{/*
The API server address override (values apiServer.host/port): env for both containers. Empty: the
in-cluster default the kubelet sets (the `kubernetes` Service).
*/}}
{{- define "teeguard.apiServerEnv" -}}
{{- with .Values.apiServer.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
{{- end }}
{{- with .Values.apiServer.port }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{/*
Pod network settings: `hostNetwork` (the pod uses the node's network namespace) with the DNS policy
that keeps cluster DNS for such a pod.
*/}}
{{- define "teeguard.hostNetwork" -}}
{{- if . }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- end }}
