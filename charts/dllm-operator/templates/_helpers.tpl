{{/* Chart name, truncated to the 63 characters of a label value. */}}
{{- define "dllm-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: release-chart, unless the release name already contains the chart name. */}}
{{- define "dllm-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dllm-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels: small and stable (Deployment selectors are immutable). */}}
{{- define "dllm-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dllm-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dllm-operator.labels" -}}
{{ include "dllm-operator.selectorLabels" . }}
helm.sh/chart: {{ include "dllm-operator.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dllm-operator
{{- end -}}

{{- define "dllm-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dllm-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "dllm-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The rules the operator needs in each namespace it manages (and, in cluster mode, everywhere). */}}
{{- define "dllm-operator.rules" -}}
# The custom resource: read and watch it; write only its status.
- apiGroups: ["disagg.dev"]
  resources: ["disaggregatedllms"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["disagg.dev"]
  resources: ["disaggregatedllms/status"]
  verbs: ["get", "patch"]
# The children it renders, applied server-side (create + patch), pruned or replaced (delete).
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The per-CR auth Secret: created once with random values (POST), never read, listed or patched; pods
# take its keys by secretKeyRef and the garbage collector deletes it with the CR.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# Pods only to read readiness and scheduling failures for status.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Events on the custom resource (Created, Scaled, Replaced, FailedApply); list: a StatefulSet reports
# pods it could not create (e.g. refused by Pod Security) only as a FailedCreate Event.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list"]
{{- end -}}


{{/* The operator's own identity, as the API server names it in admission requests. */}}
{{- define "dllm-operator.username" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "dllm-operator.serviceAccountName" . }}
{{- end -}}
