{{/*
The operator's name: its ServiceAccount, ClusterRole, ClusterRoleBinding and
Deployment (the metrics and webhook Services append "-metrics" and "-webhook").
*/}}
{{- define "alpajob.operatorName" -}}
{{- default "alpajob-operator" .Values.fullnameOverride | trunc 55 | trimSuffix "-" -}}
{{- end -}}

{{/*
Labels of every object of the release.
*/}}
{{- define "alpajob.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/part-of: alpajob
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/*
Selector labels of the operator's pod (the Deployment's selector and the metrics
Service's); fixed for the life of a release.
*/}}
{{- define "alpajob.operatorSelectorLabels" -}}
app.kubernetes.io/name: alpajob-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
The operator's image.
*/}}
{{- define "alpajob.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
The trainer image of jobs without spec.image, when trainerImage names one (else
empty: the operator's built-in default, this release's trainer image).
*/}}
{{- define "alpajob.trainerImage" -}}
{{- with .Values.trainerImage -}}
{{- if and .tag (not .repository) -}}
{{- fail "trainerImage.tag is set but trainerImage.repository is empty: name the trainer image's repository too" -}}
{{- end -}}
{{- if .repository -}}
{{- printf "%s:%s" .repository (.tag | default $.Chart.AppVersion) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The webhook's Service, and the host name the operator registers its webhook URL
with (https://<host>:<webhook.port>/validate-alpajob): the Service's DNS name.
*/}}
{{- define "alpajob.webhookServiceName" -}}
{{- printf "%s-webhook" (include "alpajob.operatorName" .) -}}
{{- end -}}

{{- define "alpajob.webhookHost" -}}
{{- printf "%s.%s.svc" (include "alpajob.webhookServiceName" .) .Release.Namespace -}}
{{- end -}}
