{{/*
Checks values.schema.json cannot express (it checks each value on its own): the model source,
autoscaling bounds, distinct ports, the head's GCS and client ports, that each role's replicas
fit the pods of its worker group, that each group's /dev/shm holds Ray's object store, that
rayStartParams leave the chart's own parameters alone, that the custom resources replicas ask
for are advertised, the cluster config's cross-field rules (tandem.validateConfigRules), an
image whose variant runs what the roles run on (tandem.validateImage), and one source for the
API key.
Fails the render with a message naming the values to change.
*/}}

{{- define "tandem.validate" -}}
{{- $m := .Values.model -}}
{{- if not $m.path -}}
{{- fail "model.path is required: the checkpoint directory as the pods see it (e.g. /models/Qwen3-8B)" -}}
{{- end -}}
{{- /* the checkpoint in a folder of the volume, or at its root (model.path = mountPath) */ -}}
{{- $mount := trimSuffix "/" $m.mountPath -}}
{{- if not (or (hasPrefix (printf "%s/" $mount) $m.path) (eq (trimSuffix "/" $m.path) $mount)) -}}
{{- fail (printf "model.path %q must lie under model.mountPath %q (or be it)" $m.path $m.mountPath) -}}
{{- end -}}
{{- if and $m.tokenizerPath (not (or (hasPrefix (printf "%s/" $mount) $m.tokenizerPath) (eq (trimSuffix "/" $m.tokenizerPath) $mount))) -}}
{{- fail (printf "model.tokenizerPath %q must lie under model.mountPath %q (or be it)" $m.tokenizerPath $m.mountPath) -}}
{{- end -}}
{{- $claim := $m.persistentVolumeClaim.claimName -}}
{{- if and $claim $m.hostPath -}}
{{- fail "model: set one of model.persistentVolumeClaim.claimName and model.hostPath, not both (with hostPath, clear the default claim: --set model.persistentVolumeClaim.claimName=\"\")" -}}
{{- end -}}
{{- if not (or $claim $m.hostPath) -}}
{{- fail "model: set model.persistentVolumeClaim.claimName or model.hostPath (the volume holding the checkpoint)" -}}
{{- end -}}
{{- if and .Values.apiKey.value .Values.apiKey.existingSecret -}}
{{- fail "apiKey: set one of apiKey.value and apiKey.existingSecret, not both" -}}
{{- end -}}
{{- if not (semverCompare "~2.60.0" .Values.rayVersion) -}}
{{- fail (printf "rayVersion %q: tandem's image runs Ray 2.60 (it pins ray[serve]==2.60.0), and KubeRay needs the Ray it runs" .Values.rayVersion) -}}
{{- end -}}
{{- if not (semverCompare ">=1.1.0-0" .Values.kuberay.operatorVersion) -}}
{{- fail (printf "kuberay.operatorVersion %q: the chart takes KubeRay 1.1 or later (ray.io/v1 RayService)" .Values.kuberay.operatorVersion) -}}
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
{{- /* KubeRay (1.4 and before) probes Ray's dashboard and dashboard agent on their default
ports whatever rayStartParams say (kuberay#2584, #1760): pods elsewhere never get ready */ -}}
{{- if ne (int $p.dashboard) 8265 -}}
{{- fail (printf "ports.dashboard (%d): KubeRay's liveness and readiness probes check Ray's dashboard on 8265 whatever it is set to (kuberay#2584), so the head would never be ready: leave it at 8265" (int $p.dashboard)) -}}
{{- end -}}
{{- range $group := prepend (prepend (include "tandem.roles" . | fromJsonArray) "router") "head" -}}
{{- if hasKey ((index $.Values $group).rayStartParams | default (dict)) "dashboard-agent-listen-port" -}}
{{- fail (printf "%s.rayStartParams.dashboard-agent-listen-port: KubeRay's liveness and readiness probes check Ray's dashboard agent on 52365 whatever it is set to (kuberay#1760), so the pods would never be ready: leave it out" $group) -}}
{{- end -}}
{{- end -}}
{{- include "tandem.validateHeadPorts" . -}}
{{- include "tandem.validateRayPorts" . -}}
{{- include "tandem.validateShm" (list "head" .Values.head) -}}
{{- include "tandem.validateShm" (list "router" .Values.router) -}}
{{- range $role := include "tandem.roles" . | fromJsonArray -}}
{{- include "tandem.validateRole" (list $role (index $.Values $role) $.Values.autoscaler.enabled) -}}
{{- end -}}
{{- include "tandem.validatePacking" (list "router" .Values.router) -}}
{{- include "tandem.validateRayParams" . -}}
{{- include "tandem.validateConfigRules" . -}}
{{- include "tandem.validateImage" . -}}
{{- end -}}

{{/*
rayStartParams: `merge` would let a user's key replace what the chart derives (a role's
`resources` lost its custom resource, so no replica could be placed), so those keys are refused,
naming the value that sets them. extraRayResources: more custom resources per pod, never the
group's own rayResource nor one of Ray's predefined resources.
*/}}
{{- define "tandem.validateRayParams" -}}
{{- $head := dict
  "num-cpus" "the head advertises no CPUs, so that no Serve replica is ever placed on it"
  "dashboard-host" "the chart sets 0.0.0.0, where KubeRay reaches the dashboard"
  "dashboard-port" "set ports.dashboard instead"
  "metrics-export-port" "set ports.metrics instead" -}}
{{- include "tandem.refuseParams" (list "head" .Values.head.rayStartParams $head) -}}
{{- range $group := prepend (include "tandem.roles" . | fromJsonArray) "router" -}}
{{- $v := index $.Values $group -}}
{{- $owned := dict
  "num-cpus" (printf "set %s.cpu (whole CPUs per pod: Ray's num-cpus) instead" $group)
  "resources" (printf "set %s.extraRayResources (name: amount per pod; the chart adds %s.rayResource) instead" $group $group)
  "metrics-export-port" "set ports.metrics instead" -}}
{{- if eq $group "router" -}}
{{- $_ := set $owned "num-gpus" "router pods get no GPU (router replicas use none)" -}}
{{- else -}}
{{- $_ := set $owned "num-gpus" (printf "set %s.numGpus (GPUs per replica; a pod gets replicasPerPod x numGpus) instead" $group) -}}
{{- end -}}
{{- include "tandem.refuseParams" (list $group $v.rayStartParams $owned) -}}
{{- range $name, $amount := $v.extraRayResources -}}
{{- if eq $name $v.rayResource -}}
{{- fail (printf "%s.extraRayResources.%s is the group's rayResource: the chart advertises replicasPerPod (%d) of it itself" $group $name (int $v.replicasPerPod)) -}}
{{- end -}}
{{- if has $name (list "CPU" "GPU" "memory" "object_store_memory") -}}
{{- fail (printf "%s.extraRayResources.%s is one of Ray's own resources: set %s.cpu, numGpus or memory instead" $group $name $group) -}}
{{- end -}}
{{- end -}}
{{- /* what each replica asks for must be on its group's pods, for replicasPerPod replicas:
else Serve's replicas stay pending and the autoscaler knows no group to grow */ -}}
{{- $per := int $v.replicasPerPod -}}
{{- $offered := $v.extraRayResources | default (dict) -}}
{{- range $name, $amount := $v.replicaRayResources -}}
{{- if eq $name $v.rayResource -}}
{{- fail (printf "%s.replicaRayResources.%s is the group's rayResource: each replica asks for one unit of it already" $group $name) -}}
{{- end -}}
{{- if has $name (list "CPU" "GPU" "memory" "object_store_memory") -}}
{{- fail (printf "%s.replicaRayResources.%s is one of Ray's own resources: set %s.numCpus%s instead" $group $name $group (ternary "" " or numGpus" (eq $group "router"))) -}}
{{- end -}}
{{- $needed := mulf $amount $per -}}
{{- $has := float64 (default 0 (index $offered $name)) -}}
{{- /* a hair of slack: 3 x 0.1 is 0.30000000000000004 */ -}}
{{- if gt $needed (addf $has 0.000001) -}}
{{- fail (printf "%s.replicaRayResources.%s (%v per replica) is not on the %s pods: each pod hosts replicasPerPod (%d) replicas, so set %s.extraRayResources.%s to %v or more (now %v)" $group $name $amount $group $per $group $name $needed $has) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tandem.refuseParams" -}}
{{- $group := index . 0 -}}
{{- $params := index . 1 | default (dict) -}}
{{- $owned := index . 2 -}}
{{- range $key := keys $owned | sortAlpha -}}
{{- if hasKey $params $key -}}
{{- fail (printf "%s.rayStartParams.%s is the chart's own: %s" $group $key (index $owned $key)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The cluster config's model validators (tandem.deploy.cluster_config ClusterConfig
._devices_fit_the_roles, tandem.deploy.autoscaling_config RoleAutoscaling._consistent), at
render time: without them these values render and the RayService then fails to deploy.
tests/helm/test_chart_config_rules.py checks that the config refuses what these refuse.
*/}}
{{- define "tandem.validateConfigRules" -}}
{{- $s := .Values.serve -}}
{{- range $role := include "tandem.roles" . | fromJsonArray -}}
{{- $v := index $.Values $role -}}
{{- $device := include "tandem.device" (list $s.engine $v) -}}
{{- if hasPrefix "cuda" $device -}}
{{- if le (float64 (default 0 $v.numGpus)) 0.0 -}}
{{- fail (printf "%s runs on '%s' but asks Ray for no GPU: set %s.numGpus (1 for a GPU of its own, 0.5 for two replicas sharing one)" $role $device $role) -}}
{{- end -}}
{{- if and (eq $s.transport "ucx") (eq $s.mode "pd") -}}
{{- fail (printf "serve.transport 'ucx' moves host-memory KV pools only, and %s runs on '%s': use serve.transport 'torch' (NCCL between GPUs)" $role $device) -}}
{{- end -}}
{{- end -}}
{{- if $v.autoscaling.enabled -}}
{{- $a := $v.autoscaling -}}
{{- /* the defaults of tandem.deploy.autoscaling_config.RoleAutoscaling */ -}}
{{- $lookBack := float64 (default 10.0 (index $a "look_back_period_s")) -}}
{{- $interval := float64 (default 2.0 (index $a "metrics_interval_s")) -}}
{{- if le $lookBack $interval -}}
{{- fail (printf "%s.autoscaling: look_back_period_s (%v) must exceed metrics_interval_s (%v)" $role $lookBack $interval) -}}
{{- end -}}
{{- /* a target left out keeps its default (not null); one set to null is off */ -}}
{{- $targets := list "kv_usage_target" "running_seqs_per_replica" "itl_target_ms" -}}
{{- if eq $role "prefill" -}}
{{- $targets = list "queued_prefill_tokens_per_replica" "ttft_target_ms" -}}
{{- end -}}
{{- $on := list -}}
{{- range $t := $targets -}}
{{- if not (and (hasKey $a $t) (kindIs "invalid" (index $a $t))) -}}
{{- $on = append $on $t -}}
{{- end -}}
{{- end -}}
{{- if not $on -}}
{{- fail (printf "%s.autoscaling: every scaling target is null: set at least one (%s)" $role (join ", " $targets)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Where a role's engines run, as ClusterConfig._device says: the role's engine.device, else
serve.engine.device, else cpu; auto is cuda exactly when each replica asks for a GPU. Called
with (list serve.engine role-values).
*/}}
{{- define "tandem.device" -}}
{{- $shared := index . 0 | default (dict) -}}
{{- $v := index . 1 -}}
{{- $device := "cpu" -}}
{{- range $engine := list $shared ($v.engine | default (dict)) -}}
{{- if and (hasKey $engine "device") (not (kindIs "invalid" (index $engine "device"))) -}}
{{- $device = toString (index $engine "device") -}}
{{- end -}}
{{- end -}}
{{- if eq $device "auto" -}}
{{- $device = ternary "cuda" "cpu" (gt (float64 (default 0 $v.numGpus)) 0.0) -}}
{{- end -}}
{{- $device -}}
{{- end -}}

{{- define "tandem.validateRole" -}}
{{- $role := index . 0 -}}
{{- $v := index . 1 -}}
{{- $autoscaler := index . 2 -}}
{{- if $v.autoscaling.enabled -}}
{{- $min := int $v.autoscaling.min_replicas -}}
{{- $max := int $v.autoscaling.max_replicas -}}
{{- if gt $min $max -}}
{{- fail (printf "%s.autoscaling: min_replicas (%d) is above max_replicas (%d)" $role $min $max) -}}
{{- end -}}
{{- if or (lt (int $v.replicas) $min) (gt (int $v.replicas) $max) -}}
{{- fail (printf "%s.replicas (%d) is the initial count when autoscaling: it must lie within min_replicas..max_replicas (%d..%d)" $role (int $v.replicas) $min $max) -}}
{{- end -}}
{{- /* Without the in-tree autoscaler nothing adds pods: the group keeps its
ceil(replicas / replicasPerPod) pods, and a Serve replica beyond their slots stays pending. */ -}}
{{- if not $autoscaler -}}
{{- $per := int $v.replicasPerPod -}}
{{- $pods := include "tandem.ceilDiv" (list $v.replicas $per) | int -}}
{{- if gt $max (mul $pods $per) -}}
{{- fail (printf "%s.autoscaling.max_replicas (%d) needs room for %d replicas, but with autoscaler.enabled=false the %s group keeps its %d pod(s) x replicasPerPod (%d) = %d: set autoscaler.enabled=true, or %s.replicas / %s.replicasPerPod so that the pods hold max_replicas, or a lower max_replicas" $role $max $max $role $pods $per (mul $pods $per) $role $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- include "tandem.validatePacking" (list $role $v) -}}
{{- include "tandem.validateShm" (list $role $v) -}}
{{- $gpus := mulf $v.numGpus $v.replicasPerPod -}}
{{- if ne (floor $gpus) (float64 $gpus) -}}
{{- fail (printf "%s: replicasPerPod (%v) x numGpus (%v) = %v GPUs per pod: it must be a whole number" $role $v.replicasPerPod $v.numGpus $gpus) -}}
{{- end -}}
{{- end -}}

{{/* A group's memory-backed /dev/shm (shmSize) must hold the object store the chart sizes for
it (tandem.objectStoreBytes): Ray refuses one under 75Mi. Called with (list group values). */}}
{{- define "tandem.validateShm" -}}
{{- $group := index . 0 -}}
{{- $v := index . 1 -}}
{{- with include "tandem.objectStoreBytes" $v -}}
{{- if lt (int64 .) 78643200 -}}
{{- fail (printf "%s.shmSize (%v) and %s.memory (%v) leave Ray's object store %s bytes (the smaller of 80 %% of /dev/shm and 30 %% of memory): Ray needs at least 75Mi; set a larger %s.shmSize (128Mi or more) and memory, or null for no memory-backed /dev/shm" $group $v.shmSize $group $v.memory . $group) -}}
{{- end -}}
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

{{/*
The chart's ports (ports.*) must not be one Ray (or, with serve.ingress haproxy, Ray Serve's
HAProxy ingress) listens on itself: the head's GCS (rayStartParams port, 6379) and Ray client
server (ray-client-server-port, 10001), each node's dashboard agent (dashboard-agent-listen-port,
52365) and worker processes (min-worker-port..max-worker-port, 10002-19999, per group), and
HAProxy's stats (8404) and metrics (9101) ports and the router replicas' own HTTP (30000-31000)
and gRPC (40000-41000) ports. Ray's defaults unless the group's rayStartParams set them.
*/}}
{{- define "tandem.validateRayPorts" -}}
{{- $head := .Values.head.rayStartParams | default (dict) -}}
{{- $rayPorts := include "tandem.headRayPorts" . | fromJson -}}
{{- $owners := list
  (dict "lo" (int $rayPorts.gcs) "what" "Ray's GCS port (the head's rayStartParams port, default 6379)")
  (dict "lo" (int $rayPorts.client) "what" "the Ray client server's port (the head's rayStartParams ray-client-server-port, default 10001)") -}}
{{- $groups := dict "head" $head -}}
{{- range $group := prepend (include "tandem.roles" . | fromJsonArray) "router" -}}
{{- $_ := set $groups $group ((index $.Values $group).rayStartParams | default (dict)) -}}
{{- end -}}
{{- range $group := keys $groups | sortAlpha -}}
{{- $params := index $groups $group -}}
{{- $agent := int (index $params "dashboard-agent-listen-port" | default 52365) -}}
{{- $owners = append $owners (dict "lo" $agent "what" (printf "Ray's dashboard agent port on the %s pods (rayStartParams dashboard-agent-listen-port, default 52365)" $group)) -}}
{{- $lo := int (index $params "min-worker-port" | default 10002) -}}
{{- $hi := int (index $params "max-worker-port" | default 19999) -}}
{{- $owners = append $owners (dict "lo" $lo "hi" $hi "what" (printf "Ray's worker ports %d-%d on the %s pods (rayStartParams min-worker-port..max-worker-port, default 10002-19999)" $lo $hi $group)) -}}
{{- end -}}
{{- if eq .Values.serve.ingress "haproxy" -}}
{{- $owners = append $owners (dict "lo" 8404 "what" "HAProxy's stats port (serve.ingress haproxy; RAY_SERVE_HAPROXY_STATS_PORT)") -}}
{{- $owners = append $owners (dict "lo" 9101 "what" "HAProxy's metrics port (serve.ingress haproxy; RAY_SERVE_HAPROXY_METRICS_PORT)") -}}
{{- $owners = append $owners (dict "lo" 30000 "hi" 31000 "what" "the router replicas' own HTTP ports behind HAProxy, 30000-31000 (serve.ingress haproxy)") -}}
{{- $owners = append $owners (dict "lo" 40000 "hi" 41000 "what" "the router replicas' own gRPC ports behind HAProxy, 40000-41000 (serve.ingress haproxy)") -}}
{{- end -}}
{{- range $name := list "http" "grpc" "direct" "metrics" "dashboard" -}}
{{- $port := int (index $.Values.ports $name) -}}
{{- if $port -}}
{{- range $owner := $owners -}}
{{- if and (ge $port (int $owner.lo)) (le $port (int (default $owner.lo $owner.hi))) -}}
{{- fail (printf "ports.%s (%d) is taken by %s: choose another port" $name $port $owner.what) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The head's rayStartParams `port` (the GCS) and `ray-client-server-port`: the head container
exposes them (tandem.headRayPorts) and KubeRay joins the workers to the GCS at `port`, so each
must be one port number (a string, as every rayStartParams value), apart from the other and
from the ports Ray gives the head's worker processes and dashboard agent.
*/}}
{{- define "tandem.validateHeadPorts" -}}
{{- $params := .Values.head.rayStartParams | default (dict) -}}
{{- $what := dict "port" "the GCS port (default 6379)" "ray-client-server-port" "the Ray client server's port (default 10001)" -}}
{{- range $key := list "port" "ray-client-server-port" -}}
{{- if hasKey $params $key -}}
{{- $value := toString (index $params $key) -}}
{{- /* no leading zero: Helm's int would read it as octal, Ray as decimal */ -}}
{{- if not (and (regexMatch "^[1-9][0-9]{0,4}$" $value) (le (int $value) 65535)) -}}
{{- fail (printf "head.rayStartParams.%s (%q), %s, must be a port number, 1-65535, given as a string (e.g. --set-string head.rayStartParams.%s=%s): the chart exposes it as the head container's %s port" $key $value (index $what $key) $key (ternary "6380" "9001" (eq $key "port")) (ternary "gcs" "client" (eq $key "port"))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $rayPorts := include "tandem.headRayPorts" . | fromJson -}}
{{- $gcs := int $rayPorts.gcs -}}
{{- $client := int $rayPorts.client -}}
{{- if eq $gcs $client -}}
{{- fail (printf "head.rayStartParams port and ray-client-server-port are both %d: the GCS and the Ray client server need a port each" $gcs) -}}
{{- end -}}
{{- $lo := int (index $params "min-worker-port" | default 10002) -}}
{{- $hi := int (index $params "max-worker-port" | default 19999) -}}
{{- $agent := int (index $params "dashboard-agent-listen-port" | default 52365) -}}
{{- range $key, $port := dict "port" $gcs "ray-client-server-port" $client -}}
{{- if and (ge $port $lo) (le $port $hi) -}}
{{- fail (printf "head.rayStartParams.%s (%d) lies in Ray's worker ports %d-%d on the head (rayStartParams min-worker-port..max-worker-port, default 10002-19999): choose another port" $key $port $lo $hi) -}}
{{- end -}}
{{- if eq $port $agent -}}
{{- fail (printf "head.rayStartParams.%s (%d) is Ray's dashboard agent port on the head (rayStartParams dashboard-agent-listen-port, default 52365): choose another port" $key $port) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The chart's default image (no image.tag) of variant cpu has a torch without CUDA: a role
that runs on CUDA would fail as each replica starts. */}}
{{- define "tandem.validateImage" -}}
{{- if and (eq .Values.image.variant "cpu") (not .Values.image.tag) -}}
{{- range $role := include "tandem.roles" . | fromJsonArray -}}
{{- $device := include "tandem.device" (list $.Values.serve.engine (index $.Values $role)) -}}
{{- if hasPrefix "cuda" $device -}}
{{- fail (printf "%s runs on '%s' but image.variant is cpu (its torch has no CUDA): set image.variant=cuda, or run %s on cpu (%s.numGpus 0 or engine.device cpu)" $role $device $role $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
