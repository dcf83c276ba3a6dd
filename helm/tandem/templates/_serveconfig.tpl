{{/*
serveConfigV2: tandem's Serve config. `args` are cluster-config fields
(tandem.deploy.cluster_config.ClusterConfig); tests/helm validates every render with it and with
Ray's ServeDeploySchema. The router's replicas are pinned to the router worker group through a
deployment override (its `ray_actor_options` replace the code's). Optional settings (null in
values.yaml) are left out when unset, so the cluster config keeps its own defaults.
*/}}

{{/* What each replica of a group asks Ray for besides CPUs and GPUs: one unit of the group's
rayResource and its replicaRayResources (tandem.validate refuses rayResource among them). */}}
{{- define "tandem.replicaResources" -}}
{{- toJson (merge (dict .rayResource 1) (deepCopy (default (dict) .replicaRayResources))) -}}
{{- end -}}

{{- define "tandem.roleArgs" -}}
{{- $v := . -}}
{{- $args := dict
  "replicas" (int $v.replicas)
  "num_cpus" $v.numCpus
  "num_gpus" $v.numGpus
  "resources" (include "tandem.replicaResources" $v | fromJson)
  "torch_threads" (int $v.torchThreads)
  "drain_timeout_s" $v.drainTimeoutS
  "engine" $v.engine
-}}
{{- if hasKey $v "streamInterval" -}}
{{- $_ := set $args "stream_interval" (int $v.streamInterval) -}}
{{- end -}}
{{- if $v.autoscaling.enabled -}}
{{- $_ := set $args "autoscaling" (omit $v.autoscaling "enabled") -}}
{{- end -}}
{{- toJson $args -}}
{{- end -}}

{{- define "tandem.servedModelName" -}}
{{- .Values.model.servedName | default (base (trimSuffix "/" .Values.model.path)) -}}
{{- end -}}

{{- define "tandem.serveArgs" -}}
{{- $s := .Values.serve -}}
{{- $args := dict
  "model" .Values.model.path
  "served_model_name" (include "tandem.servedModelName" .)
  "app_name" "tandem"
  "mode" $s.mode
  "transport" $s.transport
  "transport_options" $s.transportOptions
  "engine" $s.engine
  "decode" (include "tandem.roleArgs" .Values.decode | fromJson)
  "router" (dict "replicas" (int .Values.router.replicas) "num_cpus" .Values.router.numCpus "request_timeout_s" $s.requestTimeoutS "tool_call_parser" ($s.toolCallParser | default "auto"))
  "routing" $s.routing
  "decode_routing" $s.decodeRouting
  "admission" $s.admission
  "slo" $s.slo
  "host" "0.0.0.0"
  "port" (int .Values.ports.http)
  "grpc_port" (int .Values.ports.grpc)
  "direct_port" (int .Values.ports.direct)
  "lease_s" $s.leaseS
  "stall_timeout_s" $s.stallTimeoutS
  "reserve_wait_s" $s.reserveWaitS
  "ack_timeout_s" $s.ackTimeoutS
  "cache_dir" "/tmp/tandem-cache"
  "log_level" $s.logLevel
-}}
{{- if ne $s.mode "colocated" -}}
{{- $_ := set $args "prefill" (include "tandem.roleArgs" .Values.prefill | fromJson) -}}
{{- end -}}
{{- if $s.reasoningParser -}}
{{- $_ := set $args.router "reasoning_parser" $s.reasoningParser -}}
{{- end -}}
{{- if .Values.model.tokenizerPath -}}
{{- $_ := set $args "tokenizer" .Values.model.tokenizerPath -}}
{{- end -}}
{{- if $s.chatTemplate -}}
{{- $_ := set $args "chat_template" $s.chatTemplate -}}
{{- end -}}
{{- /* [] is a value (CORS off): only null (or no key) is unset */ -}}
{{- if not (kindIs "invalid" $s.corsAllowedOrigins) -}}
{{- $_ := set $args.router "cors_allowed_origins" $s.corsAllowedOrigins -}}
{{- end -}}
{{- if not (kindIs "invalid" $s.logRequests) -}}
{{- $_ := set $args.router "log_requests" $s.logRequests -}}
{{- end -}}
{{- if not (kindIs "invalid" $s.responsesStoreSize) -}}
{{- $_ := set $args.router "responses_store_size" (int $s.responsesStoreSize) -}}
{{- end -}}
{{- if not (kindIs "invalid" $s.checksums) -}}
{{- $_ := set $args "checksums" $s.checksums -}}
{{- end -}}
{{- if not (kindIs "invalid" $s.chunkPublisher) -}}
{{- $_ := set $args "chunk_publisher" $s.chunkPublisher -}}
{{- end -}}
{{- toJson $args -}}
{{- end -}}

{{- define "tandem.serveConfig" -}}
{{- $router := .Values.router -}}
{{- $app := dict
  "name" "tandem"
  "route_prefix" "/"
  "import_path" "tandem.deploy.app_builder:app_builder"
  "args" (include "tandem.serveArgs" . | fromJson)
  "deployments" (list (dict
    "name" "router"
    "ray_actor_options" (dict "num_cpus" $router.numCpus "resources" (include "tandem.replicaResources" $router | fromJson))))
-}}
{{- $config := dict
  "proxy_location" "EveryNode"
  "http_options" (dict "host" "0.0.0.0" "port" (int .Values.ports.http))
  "applications" (list $app)
-}}
{{- toYaml $config -}}
{{- end -}}
