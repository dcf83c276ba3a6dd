{{/*
The pod template of a Ray node (head or worker group). Called with a dict:
  root: $, group: "head" | "router" | "prefill" | "decode", v: the group's values,
  gpus: GPUs per pod (int), ports: list of container ports, env: extra env entries,
  grace (optional): terminationGracePeriodSeconds, graceWhy: its comment.
Every pod mounts the model read-only (the Serve app is built on the head, replicas load it on
the workers) and, where the group sets shmSize (head, router, prefill, decode by default), a
memory-backed /dev/shm for Ray's object store.
*/}}
{{- define "tandem.podTemplate" -}}
{{- $root := .root -}}
{{- $v := .v -}}
{{- $m := $root.Values.model -}}
metadata:
  labels:
    {{- include "tandem.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .group }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if not (include "tandem.autoscalerVersionField" $root) }}
  restartPolicy: Never  # autoscaler v2 before KubeRay 1.4: a restarted pod would be a new Ray node
  {{- end }}
  {{- with .grace }}
  terminationGracePeriodSeconds: {{ . }}  # {{ $.graceWhy }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  containers:
    - name: {{ ternary "ray-head" "ray-worker" (eq .group "head") }}
      image: {{ include "tandem.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      securityContext:
        allowPrivilegeEscalation: false
      env:
        - {name: HF_HUB_OFFLINE, value: "1"}
        - {name: TRANSFORMERS_OFFLINE, value: "1"}
        - {name: TOKENIZERS_PARALLELISM, value: "false"}
        {{- if eq $root.Values.serve.ingress "haproxy" }}
        - {name: RAY_SERVE_ENABLE_HA_PROXY, value: "1"}  # read by the controller and replicas
        {{- end }}
        {{- with .env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        {{- toYaml .ports | nindent 8 }}
      resources:
        requests:
          cpu: {{ $v.cpu | quote }}
          memory: {{ $v.memory | quote }}
          {{- if .gpus }}
          {{ $v.gpuResourceName }}: {{ .gpus | quote }}
          {{- end }}
        limits:
          cpu: {{ $v.cpu | quote }}
          memory: {{ $v.memory | quote }}
          {{- if .gpus }}
          {{ $v.gpuResourceName }}: {{ .gpus | quote }}
          {{- end }}
      volumeMounts:
        - name: model
          mountPath: {{ $m.mountPath }}
          readOnly: true
        {{- if $v.shmSize }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
  volumes:
    - name: model
      {{- if $m.persistentVolumeClaim.claimName }}
      persistentVolumeClaim:
        claimName: {{ $m.persistentVolumeClaim.claimName }}
        readOnly: true
      {{- else }}
      hostPath:
        path: {{ $m.hostPath }}
        type: Directory
      {{- end }}
    {{- if $v.shmSize }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shmSize }}
    {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/*
A worker group: called with (list $ "prefill"|"decode"|"router"). Pods = ceil(Serve replicas /
replicasPerPod); with Serve autoscaling the group's bounds follow the role's min / max replicas.
*/}}
{{- define "tandem.workerGroup" -}}
{{- $root := index . 0 -}}
{{- $group := index . 1 -}}
{{- $v := index $root.Values $group -}}
{{- $per := int $v.replicasPerPod -}}
{{- $replicas := include "tandem.ceilDiv" (list $v.replicas $per) | int -}}
{{- $min := $replicas -}}
{{- $max := $replicas -}}
{{- if and $v.autoscaling $v.autoscaling.enabled -}}
{{- $min = include "tandem.ceilDiv" (list $v.autoscaling.min_replicas $per) | int -}}
{{- $max = include "tandem.ceilDiv" (list $v.autoscaling.max_replicas $per) | int -}}
{{- end -}}
{{- $gpus := int (mulf (default 0 $v.numGpus) $per) -}}
{{- /* extraRayResources never holds rayResource (tandem.validate refuses it) */ -}}
{{- $resources := merge (dict $v.rayResource $per) (deepCopy (default (dict) $v.extraRayResources)) -}}
{{- /* rayStartParams never holds these keys (tandem.validate refuses them): the chart's win */ -}}
{{- $params := dict
  "num-cpus" (toString (int $v.cpu))
  "resources" (toJson $resources | squote)
  "metrics-export-port" (toString (int $root.Values.ports.metrics))
-}}
{{- if $gpus -}}
{{- $_ := set $params "num-gpus" (toString $gpus) -}}
{{- end -}}
{{- with include "tandem.objectStoreBytes" $v -}}
{{- $_ := set $params "object-store-memory" . -}}
{{- end -}}
{{- /* `serve` on every group: proxy_location EveryNode runs a Serve proxy on each pod that
hosts a replica, and KubeRay's readiness probe of a RayService worker checks /-/healthz on the
container port named serve (8000 when none is). The chart's Services and the router PodMonitor
select router pods by their component label, never by this port. */ -}}
{{- $ports := list
  (dict "name" "metrics" "containerPort" (int $root.Values.ports.metrics))
  (dict "name" "serve" "containerPort" (int $root.Values.ports.http)) -}}
{{- $env := list -}}
{{- if eq $group "router" -}}
{{- if $root.Values.ports.grpc -}}
{{- $ports = append $ports (dict "name" "grpc" "containerPort" (int $root.Values.ports.grpc)) -}}
{{- end -}}
{{- if $root.Values.ports.direct -}}
{{- $ports = append $ports (dict "name" "direct" "containerPort" (int $root.Values.ports.direct)) -}}
{{- end -}}
{{- $secret := include "tandem.apiKeySecret" $root -}}
{{- if $secret -}}
{{- $env = append $env (dict "name" "TANDEM_API_KEY" "valueFrom" (dict "secretKeyRef" (dict "name" $secret "key" $root.Values.apiKey.secretKey))) -}}
{{- end -}}
{{- end -}}
{{- /* Kubernetes kills a stopping pod after its grace period: it must outlast Serve's graceful
shutdown of the replicas on it (tandem.deploy.app_builder), then leave Ray time to stop. A
worker replica drains for drainTimeoutS (+ 10 s); a router replica waits twice the longest worker
drain (+ 10 s). Colocated, the cluster config's prefill keeps its default drain (30 s), which
app_builder counts too. */ -}}
{{- $grace := 0 -}}
{{- $graceWhy := "" -}}
{{- if eq $group "router" -}}
{{- $prefillDrain := ternary 30.0 (float64 $root.Values.prefill.drainTimeoutS) (eq $root.Values.serve.mode "colocated") -}}
{{- $drain := maxf (float64 $root.Values.decode.drainTimeoutS) $prefillDrain -}}
{{- $grace = add (int (ceil (mulf 2 $drain))) 30 -}}
{{- $graceWhy = "the router's streams: 2 x the longest worker drain, then Ray's own stop" -}}
{{- else if $v.drainTimeoutS -}}
{{- $grace = add (int (ceil $v.drainTimeoutS)) 30 -}}
{{- $graceWhy = "the replicas' drain, then Ray's own stop" -}}
{{- end -}}
- groupName: {{ $group }}
  replicas: {{ $replicas }}
  minReplicas: {{ $min }}
  maxReplicas: {{ $max }}
  rayStartParams:
    {{- toYaml (merge (deepCopy $v.rayStartParams) $params) | nindent 4 }}
  template:
    {{- include "tandem.podTemplate" (dict "root" $root "group" $group "v" $v "gpus" $gpus "ports" $ports "env" $env "grace" $grace "graceWhy" $graceWhy) | nindent 4 }}
{{- end -}}
