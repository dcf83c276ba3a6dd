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
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "the RayService name %q is not a DNS-1035 label (lowercase letters, digits and '-', starting with a letter, ending with a letter or digit), as Kubernetes names its Services: set fullnameOverride, nameOverride or the release name so" $name) -}}
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

{{/*
Numbers given as strings: `--set decode.numGpus=0.5` passes "0.5" (Helm types only integers,
booleans and null), which values.schema.json accepts for every number field (a decimal within
the field's bounds). tandem.numbers turns each such string into a number in .Values, once, before
anything renders, so Ray and the cluster config get numbers. The fields are listed by
tandem.numberFields (_numbers.tpl, generated from the schema).
*/}}
{{- define "tandem.numbers" -}}
{{- include "tandem.numbersIn" (list .Values (include "tandem.numberFields" . | fromJson)) -}}
{{- end -}}

{{/* Called with (list node spec): spec maps a key (or "*": every key) to true or a sub-spec. */}}
{{- define "tandem.numbersIn" -}}
{{- $node := index . 0 -}}
{{- $spec := index . 1 -}}
{{- if kindIs "map" $node -}}
{{- range $key, $sub := $spec -}}
{{- $keys := ternary (keys $node) (list $key) (eq $key "*") -}}
{{- range $name := $keys -}}
{{- if hasKey $node $name -}}
{{- $value := index $node $name -}}
{{- if kindIs "bool" $sub -}}
{{- if kindIs "string" $value -}}
{{- $_ := set $node $name (float64 $value) -}}
{{- end -}}
{{- else -}}
{{- include "tandem.numbersIn" (list $value $sub) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The head's GCS and Ray client server ports, as Ray opens them: its rayStartParams `port` and
`ray-client-server-port` (strings, as KubeRay takes every rayStartParams value; tandem.validate
refuses one that is no port number), else Ray's defaults. A JSON {"gcs": n, "client": n}.
*/}}
{{- define "tandem.headRayPorts" -}}
{{- $params := .Values.head.rayStartParams | default (dict) -}}
{{- $gcs := 6379 -}}
{{- $client := 10001 -}}
{{- if hasKey $params "port" -}}
{{- $gcs = int (index $params "port") -}}
{{- end -}}
{{- if hasKey $params "ray-client-server-port" -}}
{{- $client = int (index $params "ray-client-server-port") -}}
{{- end -}}
{{- toJson (dict "gcs" $gcs "client" $client) -}}
{{- end -}}

{{/* A Kubernetes quantity (as the schema allows: a number, a suffix) in bytes, rounded down. */}}
{{- define "tandem.bytes" -}}
{{- $q := toString . -}}
{{- $suffix := regexFind "([KMGTPE]i|[numkMGTPE])$" $q -}}
{{- $scale := dict "" 1.0 "n" 1e-9 "u" 1e-6 "m" 1e-3 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18
  "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- int64 (floor (mulf (float64 (trimSuffix $suffix $q)) (index $scale $suffix))) -}}
{{- end -}}

{{/*
Ray's object store (rayStartParams object-store-memory, bytes) of a Ray group (the head, a
worker group) with a memory-backed /dev/shm (shmSize): Ray's own default, 30 % of the pod's memory, but at most 80 %
of shmSize (the rest for NCCL's and torch's shared memory). Left to Ray, the default exceeds
/dev/shm (16Gi x 30 % > 2Gi) and Ray moves the store to /tmp, slowly. "" when the group has no
shmSize or its rayStartParams set object-store-memory themselves. Called with the group's values.
*/}}
{{- define "tandem.objectStoreBytes" -}}
{{- if and .shmSize (not (hasKey (.rayStartParams | default (dict)) "object-store-memory")) -}}
{{- $memory := include "tandem.bytes" .memory | float64 -}}
{{- $shm := include "tandem.bytes" .shmSize | float64 -}}
{{- int64 (floor (minf (mulf 0.3 $memory) (mulf 0.8 $shm))) -}}
{{- end -}}
{{- end -}}
