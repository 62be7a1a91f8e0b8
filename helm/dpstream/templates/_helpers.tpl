{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "dpstream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: "<release>-<chart>" unless the release name already contains the chart name.
Truncated so that PVC names (data-<fullname>-<ordinal>) and the pod-index label stay short.
*/}}
{{- define "dpstream.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dpstream.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "dpstream.labels" -}}
helm.sh/chart: {{ include "dpstream.chart" . }}
{{ include "dpstream.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the worker pods (immutable in the StatefulSet: never change them). */}}
{{- define "dpstream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dpstream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "dpstream.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dpstream.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "dpstream.headlessServiceName" -}}
{{- printf "%s-headless" (include "dpstream.fullname" .) }}
{{- end }}

{{/* The Secret holding the noise key: noiseKey.existingSecret, else "<fullname>-noise-key". */}}
{{- define "dpstream.noiseKeySecretName" -}}
{{- default (printf "%s-noise-key" (include "dpstream.fullname" .)) .Values.noiseKey.existingSecret }}
{{- end }}

{{- define "dpstream.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Fixed paths inside the container. */}}
{{- define "dpstream.configDir" -}}/etc/dpstream{{- end }}
{{- define "dpstream.stateDir" -}}/var/lib/dpstream{{- end }}
{{- define "dpstream.noiseKeyDir" -}}/var/run/secrets/dpstream/noise-key{{- end }}
{{- define "dpstream.kafkaTlsDir" -}}/var/run/secrets/dpstream/kafka-tls{{- end }}
{{- define "dpstream.kafkaPropertiesDir" -}}/var/run/secrets/dpstream/kafka{{- end }}
{{/* DPSTREAM_KAFKA_PROPERTIES_FILE: the ConfigMap's file, then the Secret's (later ones win) */}}
{{- define "dpstream.kafkaPropertiesFiles" -}}
{{- $files := list -}}
{{- if .Values.kafka.properties -}}{{- $files = append $files (printf "%s/kafka-client.properties" (include "dpstream.configDir" .)) -}}{{- end -}}
{{- if .Values.kafka.propertiesSecret.name -}}{{- $files = append $files (printf "%s/%s" (include "dpstream.kafkaPropertiesDir" .) .Values.kafka.propertiesSecret.key) -}}{{- end -}}
{{- join "," $files -}}
{{- end }}

{{/* Fail early on value combinations the schema cannot express. */}}
{{- define "dpstream.validate" -}}
{{- $protocol := .Values.kafka.security.protocol }}
{{- if hasPrefix "SASL_" $protocol }}
{{- if not .Values.kafka.sasl.existingSecret }}
{{- fail (printf "kafka.sasl.existingSecret is required with kafka.security.protocol %s (a Secret with the SASL username and password)" $protocol) }}
{{- end }}
{{- if not .Values.kafka.sasl.mechanism }}
{{- fail (printf "kafka.sasl.mechanism is required with kafka.security.protocol %s" $protocol) }}
{{- end }}
{{- end }}
{{- if and .Values.kafka.tls.existingSecret (not (has $protocol (list "SSL" "SASL_SSL"))) }}
{{- fail (printf "kafka.tls.existingSecret needs kafka.security.protocol SSL or SASL_SSL, not %s" $protocol) }}
{{- end }}
{{- $tls := .Values.kafka.tls }}
{{- if ne (empty $tls.certificateKey) (empty $tls.keyKey) }}
{{- fail "kafka.tls.certificateKey and kafka.tls.keyKey go together (a client certificate and its private key)" }}
{{- end }}
{{- if and (or $tls.certificateKey $tls.keyPasswordKey) (not $tls.existingSecret) }}
{{- fail "kafka.tls.certificateKey, keyKey and keyPasswordKey name keys in kafka.tls.existingSecret, which is empty" }}
{{- end }}
{{- if and $tls.keyPasswordKey (not $tls.keyKey) }}
{{- fail "kafka.tls.keyPasswordKey is the password of kafka.tls.keyKey, which is empty" }}
{{- end }}
{{- if .Values.noiseKey.create }}
{{- if .Values.noiseKey.existingSecret }}
{{- fail "noiseKey.create and noiseKey.existingSecret are exclusive: give the name of a Secret you created, or (not recommended) a value to create one from" }}
{{- end }}
{{- if lt (len .Values.noiseKey.value) 16 }}
{{- fail "noiseKey.create needs noiseKey.value with at least 16 characters" }}
{{- end }}
{{- else if .Values.noiseKey.value }}
{{- fail "noiseKey.value is set but noiseKey.create is false: remove the secret from your values (use noiseKey.existingSecret)" }}
{{- end }}
{{- if and (eq .Values.assignment "group") (ne .Values.delivery "exactly-once") }}
{{- fail "assignment group needs delivery exactly-once: a partition's state moves through its changelog, written in the transactions of its outputs (docs/operations.md, Elastic workers)" }}
{{- end }}
{{- if not .Values.queriesYaml }}
{{- if not (or (hasKey .Values.queries "queries") (hasKey .Values.queries "dynamic")) }}
{{- fail "queries must be a mapping with a 'queries' list (and optionally 'dynamic'), as in examples/queries.yaml" }}
{{- end }}
{{- $budget := .Values.queries.budget }}
{{- if and $budget (eq .Values.assignment "group") (not $budget.start) }}
{{- fail "queries.budget.start is required with assignment group: every worker charges the same windows from the same public start (docs/privacy.md, Windows and budget)" }}
{{- end }}
{{- if and $budget (gt (int .Values.replicas) 1) (not $budget.start) }}
{{- fail (printf "queries.budget.start is required with replicas %d: every worker charges the same windows from the same public start (docs/privacy.md, Windows and budget)" (int .Values.replicas)) }}
{{- end }}
{{- end }}
{{- include "dpstream.validateQueries" . }}
{{- include "dpstream.validateReplicas" . }}
{{- end }}

{{/* The queries config as YAML text: queriesYaml verbatim, else the queries mapping. */}}
{{- define "dpstream.queriesConfig" -}}
{{- if .Values.queriesYaml }}
{{- .Values.queriesYaml }}
{{- else }}
{{- toYaml .Values.queries }}
{{- end }}
{{- end }}

{{/* Milliseconds of a duration as the config loader reads it ('1d', '15m', '30s', '250ms' or an
integer number of ms), or nothing when it is not one. */}}
{{- define "dpstream.durationMs" -}}
{{- if or (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) }}
{{- int64 . }}
{{- else if and (kindIs "string" .) (regexMatch `^\s*[0-9]+\s*(ms|s|m|h|d)\s*$` .) }}
{{- $digits := regexReplaceAll `^0+([0-9])` (regexFind `[0-9]+` .) "${1}" }}
{{- mul (int64 $digits) (get (dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000 "d" 86400000) (regexFind `(ms|s|m|h|d)` .)) }}
{{- end }}
{{- end }}

{{/* Fields of a query, a dynamic query and the config (processor/config.py: QueryConfig,
DynamicQueryConfig, DpstreamConfig; tests/test_helm_chart.py keeps them equal). */}}
{{- define "dpstream.queryFields" -}}
name tenant input_topic output_topic user_field key_fields value_field time_field aggregate clamp contribution_bound window allowed_lateness max_skew input_format triggers key_threshold epsilon delta beta key_selection_share composition counter per_key_bound perturbation_steps selection_weights resolution hierarchy level_shares public_keys public_keys_file
{{- end }}
{{- define "dpstream.dynamicFields" -}}
name tenant input_topic output_topic item_field op_field time_field start tick allowed_lateness max_skew unit_field contribution_bound items epsilon delta beta partition_share mechanism static_release shards envelope
{{- end }}
{{- define "dpstream.configFields" -}}
queries dynamic budget input_format schema_registry kafka
{{- end }}

{{/*
Refuse at render time what the worker's config loader (processor/config.py) would refuse at start
and a template can check, for `queries` and `queriesYaml` alike (values.schema.json checks the
types of `queries` too): the messages name the field as the loader does.
*/}}
{{- define "dpstream.validateQueries" -}}
{{- $config := include "dpstream.queriesConfig" . | fromYaml }}
{{- if hasKey $config "Error" }}
{{- fail (printf "queriesYaml: not a YAML mapping with a 'queries' list: %s" (get $config "Error")) }}
{{- end }}
{{- $where := ternary "queriesYaml" "queries" (ne .Values.queriesYaml "") }}
{{- range $key, $_ := $config }}
{{- if not (has $key (splitList " " (include "dpstream.configFields" $))) }}
{{- fail (printf "%s: %s: unknown field" $where $key) }}
{{- end }}
{{- end }}
{{- $queries := $config.queries | default list }}
{{- $dynamic := $config.dynamic | default list }}
{{- if not (and (kindIs "slice" $queries) (kindIs "slice" $dynamic)) }}
{{- fail (printf "%s: 'queries' and 'dynamic' must be lists" $where) }}
{{- end }}
{{- if not (or $queries $dynamic) }}
{{- fail (printf "%s: the config needs at least one query (under 'queries' or 'dynamic')" $where) }}
{{- end }}
{{- $names := list }}
{{- $fields := splitList " " (include "dpstream.queryFields" .) }}
{{- range $i, $q := $queries }}
{{- $at := printf "%s: queries[%d]" $where $i }}
{{- if not (kindIs "map" $q) }}
{{- fail (printf "%s: must be a mapping of the query's fields" $at) }}
{{- end }}
{{- range $key, $_ := $q }}
{{- if not (has $key $fields) }}
{{- fail (printf "%s.%s: unknown field" $at $key) }}
{{- end }}
{{- end }}
{{- if not (and (kindIs "string" $q.name) (regexMatch `^[A-Za-z0-9][A-Za-z0-9_.-]*$` (toString $q.name)) (le (len (toString $q.name)) 100)) }}
{{- fail (printf "%s.name: required: letters, digits, '_', '.' and '-' (at most 100), got %v" $at $q.name) }}
{{- end }}
{{- $names = append $names $q.name }}
{{- if not (and (or (kindIs "float64" $q.epsilon) (kindIs "int64" $q.epsilon)) (gt (float64 $q.epsilon) 0.0)) }}
{{- fail (printf "%s.epsilon: must be a positive finite number, got %v" $at $q.epsilon) }}
{{- end }}
{{- if not (and (or (kindIs "float64" $q.delta) (kindIs "int64" $q.delta)) (gt (float64 $q.delta) 0.0) (lt (float64 $q.delta) 1.0)) }}
{{- fail (printf "%s.delta: must be in (0, 1), got %v" $at $q.delta) }}
{{- end }}
{{- $triggers := ternary $q.triggers 100 (hasKey $q "triggers") }}
{{- if not (and (or (kindIs "float64" $triggers) (kindIs "int64" $triggers) (kindIs "int" $triggers)) (eq (float64 $triggers) (floor $triggers)) (ge (float64 $triggers) 1.0) (le (float64 $triggers) 16777216.0)) }}
{{- fail (printf "%s.triggers: must be an integer in [1, 2^24], got %v" $at $triggers) }}
{{- end }}
{{- if hasKey $q "contribution_bound" }}
{{- $c := $q.contribution_bound }}
{{- if not (and (or (kindIs "float64" $c) (kindIs "int64" $c)) (eq (float64 $c) (floor $c)) (ge (float64 $c) 1.0)) }}
{{- fail (printf "%s.contribution_bound: must be an integer >= 1, got %v" $at $c) }}
{{- end }}
{{- end }}
{{- if and (hasKey $q "per_key_bound") (not (kindIs "invalid" $q.per_key_bound)) }}
{{- $k := $q.per_key_bound }}
{{- $cb := ternary $q.contribution_bound 32 (hasKey $q "contribution_bound") }}
{{- if not (and (or (kindIs "float64" $k) (kindIs "int64" $k)) (eq (float64 $k) (floor $k)) (ge (float64 $k) 1.0) (le (float64 $k) (float64 $cb))) }}
{{- fail (printf "%s.per_key_bound: must be an integer from 1 to contribution_bound (C = %v), got %v" $at $cb $k) }}
{{- end }}
{{- end }}
{{- $window := ternary $q.window "1d" (hasKey $q "window") }}
{{- $windowMs := include "dpstream.durationMs" $window }}
{{- if or (not $windowMs) (eq $windowMs "0") }}
{{- fail (printf "%s.window: must be a positive duration like '1d', '15m', '30s', got %v" $at $window) }}
{{- end }}
{{- if ne (mod (int64 $windowMs) (int64 $triggers)) 0 }}
{{- fail (printf "%s.triggers: the window (%v) must split into %v whole milliseconds" $at $window (int64 $triggers)) }}
{{- end }}
{{- range $field := list "allowed_lateness" "max_skew" }}
{{- if hasKey $q $field }}
{{- $ms := include "dpstream.durationMs" (get $q $field) }}
{{- if or (not $ms) (and (eq $field "max_skew") (eq $ms "0")) }}
{{- fail (printf "%s.%s: must be a duration like '1d', '15m', '30s'%s, got %v" $at $field (ternary " (positive)" "" (eq $field "max_skew")) (get $q $field)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $aggregate := $q.aggregate | default "count" }}
{{- if not (has $aggregate (list "count" "sum" "mean")) }}
{{- fail (printf "%s.aggregate: must be one of count, sum, mean, got %v" $at $aggregate) }}
{{- end }}
{{- if and (ne $aggregate "count") (not $q.value_field) }}
{{- fail (printf "%s.value_field: aggregate '%s' needs a value_field" $at $aggregate) }}
{{- end }}
{{- if and (eq $aggregate "count") $q.value_field }}
{{- fail (printf "%s.value_field: must be null for aggregate 'count' (COUNT(*))" $at) }}
{{- end }}
{{- end }}
{{- $dynFields := splitList " " (include "dpstream.dynamicFields" .) }}
{{- range $i, $q := $dynamic }}
{{- $at := printf "%s: dynamic[%d]" $where $i }}
{{- if not (kindIs "map" $q) }}
{{- fail (printf "%s: must be a mapping of the query's fields" $at) }}
{{- end }}
{{- range $key, $_ := $q }}
{{- if not (has $key $dynFields) }}
{{- fail (printf "%s.%s: unknown field" $at $key) }}
{{- end }}
{{- end }}
{{- if not (and (kindIs "string" $q.name) (regexMatch `^[A-Za-z0-9][A-Za-z0-9_.-]*$` (toString $q.name)) (le (len (toString $q.name)) 100)) }}
{{- fail (printf "%s.name: required: letters, digits, '_', '.' and '-' (at most 100), got %v" $at $q.name) }}
{{- end }}
{{- $names = append $names $q.name }}
{{- if not (and (or (kindIs "float64" $q.epsilon) (kindIs "int64" $q.epsilon)) (gt (float64 $q.epsilon) 0.0)) }}
{{- fail (printf "%s.epsilon: must be a positive finite number, got %v" $at $q.epsilon) }}
{{- end }}
{{- if not (and (or (kindIs "float64" $q.start) (kindIs "int64" $q.start)) (ge (float64 $q.start) 0.0)) }}
{{- fail (printf "%s.start: required: epoch ms of tick 1 (>= 0), got %v" $at $q.start) }}
{{- end }}
{{- if not (and (kindIs "slice" $q.items) $q.items) }}
{{- fail (printf "%s.items: required: the public list of items" $at) }}
{{- end }}
{{- end }}
{{- if ne (len $names) (len (uniq $names)) }}
{{- fail (printf "%s: duplicate query names in %v" $where $names) }}
{{- end }}
{{- with $config.budget }}
{{- $principal := .principal | default "query" }}
{{- $limits := .principals | default dict }}
{{- range $kind, $list := dict "queries" $queries "dynamic" $dynamic }}
{{- range $i, $q := $list }}
{{- $of := get (dict "query" $q.name "input_topic" ($q.input_topic | default (ternary "events" "dpstream-dynamic-updates" (eq $kind "queries"))) "tenant" ($q.tenant | default "")) $principal }}
{{- if not $of }}
{{- fail (printf "%s: %s[%d].tenant: budget.principal is 'tenant', so every query needs a tenant" $where $kind $i) }}
{{- end }}
{{- if and (not (hasKey $limits $of)) (not (get $config.budget "default")) }}
{{- fail (printf "%s: budget.principals: no budget for '%s' (%s[%d]) and no budget.default" $where $of $kind $i) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if .Values.queriesYaml }}
{{- $budget := $config.budget }}
{{- if and $budget (eq .Values.assignment "group") (not $budget.start) }}
{{- fail "queriesYaml: budget.start is required with assignment group: every worker charges the same windows from the same public start (docs/privacy.md, Windows and budget)" }}
{{- end }}
{{- if and $budget (gt (int .Values.replicas) 1) (not $budget.start) }}
{{- fail (printf "queriesYaml: budget.start is required with replicas %d: every worker charges the same windows from the same public start (docs/privacy.md, Windows and budget)" (int .Values.replicas)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
More replicas than partitions to own: the extra workers would own nothing (values.yaml,
inputPartitions). static: worker i owns p % replicas == i of every source topic; group: the
consumer group gives each input, repartition and dynamic-update partition one owner.
*/}}
{{- define "dpstream.validateReplicas" -}}
{{- $config := include "dpstream.queriesConfig" . | fromYaml }}
{{- $replicas := int64 .Values.replicas }}
{{- $partitions := int64 .Values.partitions }}
{{- $inputPartitions := int64 (.Values.inputPartitions | default .Values.partitions) }}
{{- $inputs := dict }}
{{- range $q := $config.queries | default list }}
{{- $_ := set $inputs (toString ($q.input_topic | default "events")) true }}
{{- end }}
{{- $updates := dict }}
{{- range $q := $config.dynamic | default list }}
{{- $_ := set $updates (toString ($q.input_topic | default "dpstream-dynamic-updates")) true }}
{{- end }}
{{- $repartitions := len ($config.queries | default list) }}
{{- if eq .Values.assignment "static" }}
{{- $most := max $partitions (ternary $inputPartitions 0 (gt (len $inputs) 0)) (ternary 1 0 (gt (len $updates) 0)) }}
{{- if gt $replicas $most }}
{{- fail (printf "replicas %d is more than any source topic's partitions (partitions %d, inputPartitions %d): with assignment static worker i owns partitions p %% %d == i, so %d of the workers would own nothing" $replicas $partitions $inputPartitions $replicas (sub $replicas $most)) }}
{{- end }}
{{- else }}
{{- $total := add (mul (len $inputs) $inputPartitions) (mul $repartitions $partitions) (len $updates) }}
{{- if gt $replicas $total }}
{{- fail (printf "replicas %d is more than the %d partitions the consumer group assigns (input topics: %d x inputPartitions %d, repartition topics: %d x partitions %d, dynamic-update topics: %d x 1): each has one owner, so %d of the workers would own nothing" $replicas $total (len $inputs) $inputPartitions $repartitions $partitions (len $updates) (sub $replicas $total)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The Kafka client settings of every dpstream process of the release (the workers and the reset
Job): the properties files, then the DPSTREAM_KAFKA_* variables (topics/client_properties.py),
and the schema registry's credentials. One definition, so that `dpstream reset` connects exactly
as the workers do (docs/operator-guide.md, "Operations (Kubernetes)").
*/}}
{{- define "dpstream.kafkaEnv" -}}
{{- $protocol := .Values.kafka.security.protocol -}}
- name: DPSTREAM_BROKER
  value: {{ .Values.kafka.bootstrapServers | quote }}
{{- with include "dpstream.kafkaPropertiesFiles" . }}
- name: DPSTREAM_KAFKA_PROPERTIES_FILE
  value: {{ . | quote }}
{{- end }}
{{- if or (ne $protocol "PLAINTEXT") (not (include "dpstream.kafkaPropertiesFiles" .)) }}
- name: DPSTREAM_KAFKA_SECURITY_PROTOCOL
  value: {{ $protocol | quote }}
{{- end }}
{{- if hasPrefix "SASL_" $protocol }}
- name: DPSTREAM_KAFKA_SASL_MECHANISM
  value: {{ .Values.kafka.sasl.mechanism | quote }}
- name: DPSTREAM_KAFKA_SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kafka.sasl.existingSecret }}
      key: {{ .Values.kafka.sasl.usernameKey }}
- name: DPSTREAM_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kafka.sasl.existingSecret }}
      key: {{ .Values.kafka.sasl.passwordKey }}
{{- end }}
{{- if .Values.kafka.tls.existingSecret }}
- name: DPSTREAM_KAFKA_SSL_CA_LOCATION
  value: {{ include "dpstream.kafkaTlsDir" . }}/{{ .Values.kafka.tls.caKey }}
{{- end }}
{{- if .Values.kafka.tls.certificateKey }}
- name: DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION
  value: {{ include "dpstream.kafkaTlsDir" . }}/{{ .Values.kafka.tls.certificateKey }}
- name: DPSTREAM_KAFKA_SSL_KEY_LOCATION
  value: {{ include "dpstream.kafkaTlsDir" . }}/{{ .Values.kafka.tls.keyKey }}
{{- end }}
{{- if .Values.kafka.tls.keyPasswordKey }}
- name: DPSTREAM_KAFKA_SSL_KEY_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kafka.tls.existingSecret }}
      key: {{ .Values.kafka.tls.keyPasswordKey }}
{{- end }}
{{- if .Values.schemaRegistry.userInfoSecret.name }}
- name: DPSTREAM_SCHEMA_REGISTRY_USER_INFO
  valueFrom:
    secretKeyRef:
      name: {{ .Values.schemaRegistry.userInfoSecret.name }}
      key: {{ .Values.schemaRegistry.userInfoSecret.key }}
{{- end }}
{{- end }}

{{/* The mounts of the queries config and the Kafka client files (workers and reset Job). */}}
{{- define "dpstream.configVolumeMounts" -}}
- name: config
  mountPath: {{ include "dpstream.configDir" . }}
  readOnly: true
{{- if .Values.kafka.tls.existingSecret }}
- name: kafka-tls
  mountPath: {{ include "dpstream.kafkaTlsDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.kafka.propertiesSecret.name }}
- name: kafka-properties
  mountPath: {{ include "dpstream.kafkaPropertiesDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The volumes of those mounts. */}}
{{- define "dpstream.configVolumes" -}}
- name: config
  configMap:
    name: {{ include "dpstream.fullname" . }}
{{- if .Values.kafka.propertiesSecret.name }}
- name: kafka-properties
  secret:
    secretName: {{ .Values.kafka.propertiesSecret.name }}
    items:
      - key: {{ .Values.kafka.propertiesSecret.key }}
        path: {{ .Values.kafka.propertiesSecret.key }}
    defaultMode: 288  # 0440: readable by the owner and the pod's fsGroup only
{{- end }}
{{- if .Values.kafka.tls.existingSecret }}
- name: kafka-tls
  secret:
    secretName: {{ .Values.kafka.tls.existingSecret }}
    items:
      - key: {{ .Values.kafka.tls.caKey }}
        path: {{ .Values.kafka.tls.caKey }}
      {{- if .Values.kafka.tls.certificateKey }}
      - key: {{ .Values.kafka.tls.certificateKey }}
        path: {{ .Values.kafka.tls.certificateKey }}
      - key: {{ .Values.kafka.tls.keyKey }}
        path: {{ .Values.kafka.tls.keyKey }}
        mode: 288  # 0440: the private key, readable by the owner and the pod's fsGroup only
      {{- end }}
    defaultMode: 292  # 0444
{{- end }}
{{- end }}

{{/* The TCP ports of kafka.bootstrapServers (host:port or kafka://host:port; no port: 9092,
librdkafka's default), deduplicated, as a JSON list: the NetworkPolicy's default Kafka egress. */}}
{{- define "dpstream.kafkaPorts" -}}
{{- $ports := list }}
{{- range $server := splitList "," .Values.kafka.bootstrapServers }}
{{- $address := regexReplaceAll "^[a-zA-Z]+://" (trim $server) "" }}
{{- if $address }}
{{- $port := regexFind "[0-9]+$" (regexFind ":[0-9]+$" $address) | default "9092" }}
{{- $ports = append $ports (int $port) }}
{{- end }}
{{- end }}
{{- $ports | uniq | toJson }}
{{- end }}

{{/* The TCP port of a URL (its explicit port, else 443 for https and 80 for http). */}}
{{- define "dpstream.urlPort" -}}
{{- $url := urlParse . }}
{{- $explicit := regexFind "[0-9]+$" (regexFind ":[0-9]+$" $url.host) }}
{{- $explicit | default (ternary "443" "80" (eq (lower $url.scheme) "https")) }}
{{- end }}

{{/* Ports of the HTTPS/HTTP services the configuration names (JSON list): the schema registry
(queries config, schema_registry.url) and an OIDC token endpoint (kafka.properties,
sasl.oauthbearer.token.endpoint.url). One in kafka.propertiesSecret cannot be seen here:
networkPolicy.extraEgress. */}}
{{- define "dpstream.endpointPorts" -}}
{{- $ports := list }}
{{- $config := include "dpstream.queriesConfig" . | fromYaml }}
{{- with $config.schema_registry }}{{- with .url }}
{{- $ports = append $ports (int (include "dpstream.urlPort" .)) }}
{{- end }}{{- end }}
{{- with get .Values.kafka.properties "sasl.oauthbearer.token.endpoint.url" }}
{{- $ports = append $ports (int (include "dpstream.urlPort" .)) }}
{{- end }}
{{- $ports | uniq | toJson }}
{{- end }}

{{/* Labels of the reset Job's pod: the release's, but not the workers' selector labels (the
Services, the PodDisruptionBudget and the StatefulSet must not count it as a worker). */}}
{{- define "dpstream.resetPodLabels" -}}
helm.sh/chart: {{ include "dpstream.chart" . }}
app.kubernetes.io/part-of: {{ include "dpstream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: reset
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}
