{{/* Names, labels, the image. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The RayService name, also the prefix of every other object. KubeRay derives the RayCluster and
its Services from it (adding suffixes), so it must stay within 47 characters: refused, not cut.
*/}}
{{- define "tandem.fullname" -}}
{{- $name := "" -}}
{{- if .Values.fullnameOverride -}}
{{- $name = .Values.fullnameOverride -}}
{{- else if contains (include "tandem.name" .) .Release.Name -}}
{{- $name = .Release.Name -}}
{{- else -}}
{{- $name = printf "%s-%s" .Release.Name (include "tandem.name" .) -}}
{{- end -}}
{{- if gt (len $name) 47 -}}
{{- fail (printf "the RayService name %q is %d characters long: KubeRay allows at most 47 (set fullnameOverride or a shorter release name)" $name (len $name)) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "tandem.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The API key's Secret name, or "" when no key is configured. */}}
{{- define "tandem.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.value -}}
{{- printf "%s-api-key" (include "tandem.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Whether autoscaler v2 is chosen by `autoscalerOptions.version` (KubeRay >= 1.4). */}}
{{- define "tandem.autoscalerVersionField" -}}
{{- if semverCompare ">=1.4.0-0" .Values.kuberay.operatorVersion -}}true{{- end -}}
{{- end -}}

{{/* ceil(n / d) for non-negative integers: call with (list n d). */}}
{{- define "tandem.ceilDiv" -}}
{{- $n := int (index . 0) -}}
{{- $d := int (index . 1) -}}
{{- div (add $n (sub $d 1)) $d -}}
{{- end -}}
