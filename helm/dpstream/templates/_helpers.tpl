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
{{- end }}
