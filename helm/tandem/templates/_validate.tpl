{{/*
Checks values.schema.json cannot express (it checks each value on its own): the model source,
autoscaling bounds, distinct ports, and that each role's replicas fit the pods of its worker group. Fails the
render with a message naming the values to change.
*/}}

{{- define "tandem.validate" -}}
{{- $m := .Values.model -}}
{{- if not $m.path -}}
{{- fail "model.path is required: the checkpoint directory as the pods see it (e.g. /models/Qwen3-8B)" -}}
{{- end -}}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" $m.mountPath)) $m.path) -}}
{{- fail (printf "model.path %q must lie under model.mountPath %q" $m.path $m.mountPath) -}}
{{- end -}}
{{- $claim := $m.persistentVolumeClaim.claimName -}}
{{- if and $claim $m.hostPath -}}
{{- fail "model: set one of model.persistentVolumeClaim.claimName and model.hostPath, not both" -}}
{{- end -}}
{{- if not (or $claim $m.hostPath) -}}
{{- fail "model: set model.persistentVolumeClaim.claimName or model.hostPath (the volume holding the checkpoint)" -}}
{{- end -}}
{{- $p := .Values.ports -}}
{{- $taken := dict -}}
{{- range $name := list "http" "grpc" "direct" "metrics" "dashboard" -}}
{{- $port := int (index $p $name) -}}
{{- if $port -}}
{{- $key := toString $port -}}
{{- if hasKey $taken $key -}}
{{- fail (printf "ports.%s and ports.%s are both %d: each server needs a port of its own" (index $taken $key) $name $port) -}}
{{- end -}}
{{- $_ := set $taken $key $name -}}
{{- end -}}
{{- end -}}
{{- range $role := include "tandem.roles" . | fromJsonArray -}}
{{- include "tandem.validateRole" (list $role (index $.Values $role)) -}}
{{- end -}}
{{- include "tandem.validatePacking" (list "router" .Values.router) -}}
{{- end -}}

{{- define "tandem.validateRole" -}}
{{- $role := index . 0 -}}
{{- $v := index . 1 -}}
{{- if $v.autoscaling.enabled -}}
{{- $min := int $v.autoscaling.min_replicas -}}
{{- $max := int $v.autoscaling.max_replicas -}}
{{- if gt $min $max -}}
{{- fail (printf "%s.autoscaling: min_replicas (%d) is above max_replicas (%d)" $role $min $max) -}}
{{- end -}}
{{- if or (lt (int $v.replicas) $min) (gt (int $v.replicas) $max) -}}
{{- fail (printf "%s.replicas (%d) is the initial count when autoscaling: it must lie within min_replicas..max_replicas (%d..%d)" $role (int $v.replicas) $min $max) -}}
{{- end -}}
{{- end -}}
{{- include "tandem.validatePacking" (list $role $v) -}}
{{- $gpus := mulf $v.numGpus $v.replicasPerPod -}}
{{- if ne (floor $gpus) (float64 $gpus) -}}
{{- fail (printf "%s: replicasPerPod (%v) x numGpus (%v) = %v GPUs per pod: it must be a whole number" $role $v.replicasPerPod $v.numGpus $gpus) -}}
{{- end -}}
{{- end -}}

{{- define "tandem.validatePacking" -}}
{{- $role := index . 0 -}}
{{- $v := index . 1 -}}
{{- $cpus := mulf $v.numCpus $v.replicasPerPod -}}
{{- if gt $cpus (float64 $v.cpu) -}}
{{- fail (printf "%s: replicasPerPod (%v) x numCpus (%v) = %v CPUs, more than a pod's cpu (%v)" $role $v.replicasPerPod $v.numCpus $cpus $v.cpu) -}}
{{- end -}}
{{- end -}}

{{/* The worker roles of the chosen mode, as a JSON list. */}}
{{- define "tandem.roles" -}}
{{- if eq .Values.serve.mode "colocated" -}}["decode"]{{- else -}}["prefill","decode"]{{- end -}}
{{- end -}}
