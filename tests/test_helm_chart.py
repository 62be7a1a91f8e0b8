"""The Helm chart (helm/dpstream), checked without a cluster or a helm binary (docs/operations.md, "Checking the Helm chart").

The chart is rendered with helm-python-sdk (the Helm SDK in-process; output identical to
`helm template`), each manifest is validated against the bundled Kubernetes schemas with
kubernetes-validate in strict mode, the rendered output and values.yaml are linted with yamllint,
and the chart passes `helm lint --strict`. The ConfigMap's queries.yaml must load with the
project's own config loader, and the configs the chart refuses, the loader refuses too. The
dashboard's and the alerts' PromQL is parsed with promql-parser, and its metric names are found
on a running worker's /metrics (a broker test; docs/operations.md, "Dashboards and alerts"). The
Dockerfile is checked statically (no Docker engine here).
"""
from __future__ import annotations

import base64
import copy
import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "dpstream"
YAMLLINT_CONFIG = ROOT / "helm" / ".yamllint.yaml"
RELEASE, NAMESPACE = "dp", "stream"
FULLNAME = "dp-dpstream"
# The chart needs Kubernetes >= 1.28 (the apps.kubernetes.io/pod-index label); validate the
# oldest supported version, a common one and the newest that kubernetes-validate bundles.
KUBE_VERSIONS = ("1.28.0", "1.30.0", "1.37.0")
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"),  # no bundled schema: checked by hand below
             ("monitoring.coreos.com/v1", "PrometheusRule")}

try:
    import helm_python

    helm_python.helm_sdk_version()  # loads the native Helm library
except Exception as exc:  # ImportError, or the shared library failing to load
    pytest.skip(
        f"HELM CHART NOT CHECKED: helm-python-sdk (import helm_python) is unusable here: {type(exc).__name__}: {exc}. "
        "Install the test extras: pip install -c constraints.txt -e '.[test]'",
        allow_module_level=True,
    )
try:
    import kubernetes_validate
    import promql_parser  # the PromQL of the dashboard and the alerts (docs/operations.md, "Dashboards and alerts")
    from yamllint import linter as yamllint_linter
    from yamllint.config import YamlLintConfig
except ImportError as exc:
    pytest.skip(f"HELM CHART NOT CHECKED: {exc}. Install the test extras: pip install -c constraints.txt -e '.[test]'",
                allow_module_level=True)

from dpstream.processor.config import load_config  # noqa: E402

CUSTOM = {
    "assignment": "static",
    "replicas": 3,
    "partitions": 12,
    "appId": "dpstream-prod",
    "web": {"port": 9500},
    "metrics": {"annotations": False, "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}, "interval": "15s"}},
    "persistence": {"storageClassName": "fast-ssd", "size": "50Gi"},
    "kafka": {
        "bootstrapServers": "kafka-0.kafka:9093,kafka-1.kafka:9093",
        "security": {"protocol": "SASL_SSL"},
        "sasl": {"mechanism": "SCRAM-SHA-512", "existingSecret": "kafka-credentials", "usernameKey": "user", "passwordKey": "pass"},
        "tls": {"existingSecret": "kafka-ca", "caKey": "ca.pem", "certificateKey": "client.pem", "keyKey": "client.key",
                "keyPasswordKey": "client.key.password"},
    },
    "noiseKey": {"existingSecret": "prod-noise", "secretKey": "secret.bin"},
    "podDisruptionBudget": {"enabled": False},
    "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}},
    "image": {"repository": "registry.example.com/dpstream", "tag": "0.1.0-rc1"},
    "extraEnv": [{"name": "DPSTREAM_QUERY_PAGE_CLICKS_EPSILON", "value": "3"}],
    "fetchRecords": 25000,
}
NOISE_VALUE = "an-insecure-test-secret-0123456789"
CREATE_SECRET = {"noiseKey": {"create": True, "value": NOISE_VALUE}}
EXAMPLE_QUERIES_TEXT = (ROOT / "examples" / "queries.yaml").read_text()
AS_STRING = {"queriesYaml": EXAMPLE_QUERIES_TEXT}  # verbatim text instead of the mapping
AS_MAPPING = {"queries": yaml.safe_load(EXAMPLE_QUERIES_TEXT)}  # has `dynamic:` too
DYNAMIC_ONLY = {"queries": {"queries": None, "dynamic": AS_MAPPING["queries"]["dynamic"]}}  # null drops the default list
MONITORING = {  # the dashboard and the alerts, with non-default settings
    "grafanaDashboard": {"enabled": True, "namespace": "grafana", "label": "grafana.example.com/dashboard", "labelValue": "dp",
                         "annotations": {"grafana_folder": "streams"}, "labels": {"team": "data"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}, "selector": f'job="{FULLNAME}-metrics"',
                       "severity": "page", "triggerOverdue": {"seconds": 120, "for": "3m"}, "deadLetters": {"ratio": 0.05}},
    "metrics": {"serviceMonitor": {"enabled": True}},
}
KAFKA_PROPERTIES = {  # client properties as a map (non-secret) and as a Secret's properties file
    "kafka": {"bootstrapServers": "kafka:9093", "properties": {"ssl.endpoint.identification.algorithm": "none",
                                                               "sasl.mechanism": "SCRAM-SHA-256"},
              "propertiesSecret": {"name": "kafka-client", "key": "client.properties"}},
}
SCHEMA_REGISTRY = {  # Avro input against a registry whose password is a Secret's
    "queries": {**yaml.safe_load(EXAMPLE_QUERIES_TEXT), "input_format": "avro",
                "schema_registry": {"url": "https://registry.example.com:8081", "ssl_ca_location": "/var/run/secrets/dpstream/kafka-tls/ca.pem"}},
    "schemaRegistry": {"userInfoSecret": {"name": "registry-credentials", "key": "user-info"}},
}
RESET = {**CUSTOM, "reset": {"enabled": True, "confirm": True},  # the reset Job of a secured release
         "kafka": {**CUSTOM["kafka"], "propertiesSecret": {"name": "kafka-client", "key": "client.properties"}},
         "schemaRegistry": SCHEMA_REGISTRY["schemaRegistry"]}
VALUE_SETS = {"default": {}, "custom": CUSTOM, "create-secret": CREATE_SECRET, "queries-text": AS_STRING,
              "queries-mapping": AS_MAPPING, "dynamic-only": DYNAMIC_ONLY, "monitoring": MONITORING,
              "kafka-properties": KAFKA_PROPERTIES, "schema-registry": SCHEMA_REGISTRY, "reset": RESET}


def render_files(values: dict | None = None) -> dict[str, str]:
    """{template path: text} as `helm template` prints it, without NOTES.txt and empty files."""
    with helm_python.Chart.load(str(CHART)) as chart:
        files = chart.render(copy.deepcopy(values or {}), name=RELEASE, namespace=NAMESPACE)
    return {path: text for path, text in files.items() if not path.endswith("NOTES.txt") and text.strip()}


def manifests(files: dict[str, str]) -> list[dict]:
    return [doc for text in files.values() for doc in yaml.safe_load_all(text) if doc]


_CACHE: dict[str, tuple[dict[str, str], list[dict]]] = {}


def rendered(value_set: str) -> tuple[dict[str, str], list[dict]]:
    if value_set not in _CACHE:
        files = render_files(VALUE_SETS[value_set])
        _CACHE[value_set] = files, manifests(files)
    return _CACHE[value_set]


def only(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def worker(docs: list[dict]) -> tuple[dict, dict, dict]:
    """(statefulset, pod spec, worker container)."""
    sts = only(docs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return sts, pod, container


def env_of(container: dict) -> dict[str, dict]:
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names)), f"duplicate env vars: {names}"
    return {e["name"]: e for e in container["env"]}


def mount(container: dict, volume: str) -> dict:
    (m,) = [m for m in container["volumeMounts"] if m["name"] == volume]
    return m


def volume(pod: dict, name: str) -> dict:
    (v,) = [v for v in pod["volumes"] if v["name"] == name]
    return v


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- what is rendered -------------------------------------------------------------------------

def dpstream_version() -> str:
    import dpstream

    return dpstream.__version__


def test_chart_metadata_matches_the_package():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    import dpstream

    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "dpstream"
    # one version: the package's (dpstream.__version__, read by pyproject.toml), the image's and the chart's
    assert chart["version"] == chart["appVersion"] == dpstream.__version__
    assert "version" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dynamic"]


def test_default_render_has_exactly_the_expected_resources():
    _, docs = rendered("default")
    kinds = sorted((d["apiVersion"], d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted([
        ("apps/v1", "StatefulSet", FULLNAME),
        ("v1", "Service", f"{FULLNAME}-headless"),
        ("v1", "Service", f"{FULLNAME}-metrics"),
        ("v1", "ConfigMap", FULLNAME),
        ("v1", "ServiceAccount", FULLNAME),
        ("policy/v1", "PodDisruptionBudget", FULLNAME),
        ("networking.k8s.io/v1", "NetworkPolicy", FULLNAME),
    ])
    assert all(d["metadata"]["namespace"] == NAMESPACE for d in docs)


@pytest.mark.parametrize("value_set, replicas", [("default", 1), ("custom", 3)])
def test_statefulset_workers_and_their_layout(value_set, replicas):
    _, docs = rendered(value_set)
    sts, pod, container = worker(docs)
    spec = sts["spec"]
    assert spec["replicas"] == replicas
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    assert selects(spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"])
    headless = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == spec["serviceName"]]
    assert len(headless) == 1, "serviceName must name the rendered headless Service"
    assert headless[0]["spec"]["clusterIP"] == "None"
    assert selects(headless[0]["spec"]["selector"], spec["template"]["metadata"]["labels"])
    assert pod["serviceAccountName"] == only(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False

    env = env_of(container)
    if value_set == "custom":
        # static: worker i of N: N = replicas, i = the pod ordinal from the downward API
        assert env["DPSTREAM_ASSIGNMENT"]["value"] == "static"
        assert env["DPSTREAM_WORKERS"]["value"] == str(replicas)
        assert env["DPSTREAM_WORKER_INDEX"] == {
            "name": "DPSTREAM_WORKER_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
        }
        assert "DPSTREAM_INSTANCE_ID" not in env
    else:
        # the default: a consumer group; each pod's name names its transactional producers, and
        # no layout is passed (scaling is not a new epoch)
        assert env["DPSTREAM_ASSIGNMENT"]["value"] == "group"
        assert env["DPSTREAM_INSTANCE_ID"] == {"name": "DPSTREAM_INSTANCE_ID",
                                               "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
        assert "DPSTREAM_WORKERS" not in env and "DPSTREAM_WORKER_INDEX" not in env
    assert env["DPSTREAM_PARTITIONS"]["value"] == ("12" if value_set == "custom" else "8")
    assert env["DPSTREAM_APP_ID"]["value"] == ("dpstream-prod" if value_set == "custom" else "dpstream")
    assert env["DPSTREAM_FETCH_RECORDS"]["value"] == ("25000" if value_set == "custom" else "100000")
    assert env["DPSTREAM_BROKER"]["value"] == ("kafka-0.kafka:9093,kafka-1.kafka:9093" if value_set == "custom" else "kafka:9092")
    assert "DPSTREAM_NOISE_KEY" not in env, "the noise secret must come from a mounted file, never an env var"
    assert container["image"] == ("registry.example.com/dpstream:0.1.0-rc1" if value_set == "custom" else f"dpstream:{dpstream_version()}")
    if value_set == "custom":
        assert env["DPSTREAM_QUERY_PAGE_CLICKS_EPSILON"]["value"] == "3"


@pytest.mark.parametrize("value_set, size, storage_class", [("default", "10Gi", None), ("custom", "50Gi", "fast-ssd")])
def test_state_lives_on_a_volume_claim_per_worker(value_set, size, storage_class):
    _, docs = rendered(value_set)
    sts, pod, container = worker(docs)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == size
    assert claim["spec"].get("storageClassName") == storage_class
    assert "data" not in {v["name"] for v in pod["volumes"]}, "the state volume must come from the claim template"
    state = mount(container, "data")
    assert not state.get("readOnly")
    assert env_of(container)["DPSTREAM_STATE_DIR"]["value"] == state["mountPath"] == "/var/lib/dpstream"


def test_storage_class_dash_disables_dynamic_provisioning():
    sts, _, _ = worker(manifests(render_files({"persistence": {"storageClassName": "-"}})))
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == ""


@pytest.mark.parametrize("value_set, port", [("default", 9400), ("custom", 9500)])
def test_probes_hit_health_endpoints_on_the_web_port(value_set, port):
    _, docs = rendered(value_set)
    _, _, container = worker(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert env_of(container)["DPSTREAM_WEB_PORT"]["value"] == str(port)
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert ports.get(get["port"], get["port"]) == port, probe
    metrics = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics")][0]
    (svc_port,) = metrics["spec"]["ports"]
    assert svc_port["name"] == "metrics"
    assert ports[svc_port["targetPort"]] == port


def test_graceful_termination():
    _, docs = rendered("default")
    _, pod, _ = worker(docs)
    assert pod["terminationGracePeriodSeconds"] == 60


# --- the noise secret ---------------------------------------------------------------------------

@pytest.mark.parametrize("value_set, secret_name, key", [
    ("default", f"{FULLNAME}-noise-key", "noise.key"),
    ("custom", "prod-noise", "secret.bin"),
])
def test_noise_key_is_mounted_read_only_from_an_existing_secret(value_set, secret_name, key):
    _, docs = rendered(value_set)
    _, pod, container = worker(docs)
    secret = volume(pod, "noise-key")["secret"]
    assert secret["secretName"] == secret_name
    assert secret["items"] == [{"key": key, "path": key}]
    assert secret["defaultMode"] == 0o440
    m = mount(container, "noise-key")
    assert m["readOnly"] is True
    assert env_of(container)["DPSTREAM_NOISE_KEY_FILE"]["value"] == f"{m['mountPath']}/{key}"
    # no secret material anywhere: no Secret rendered, no data/stringData outside the ConfigMap
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert not [d for d in docs if d["kind"] != "ConfigMap" and ("data" in d or "stringData" in d)]


def test_creating_the_noise_secret_from_values_is_opt_in_and_consistent():
    _, docs = rendered("create-secret")
    secret = only(docs, "Secret")
    assert secret["metadata"]["name"] == f"{FULLNAME}-noise-key"
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert base64.b64decode(secret["data"]["noise.key"]).decode() == NOISE_VALUE
    _, pod, _ = worker(docs)
    assert volume(pod, "noise-key")["secret"]["secretName"] == secret["metadata"]["name"]


@pytest.mark.parametrize("values, message", [
    ({"noiseKey": {"create": True}}, "at least 16"),
    ({"noiseKey": {"create": True, "value": "too-short"}}, "at least 16"),
    ({"noiseKey": {"value": NOISE_VALUE}}, "create is false"),
    ({"noiseKey": {"create": True, "value": NOISE_VALUE, "existingSecret": "x"}}, "exclusive"),
    ({"kafka": {"security": {"protocol": "SASL_SSL"}}}, "kafka.sasl.existingSecret is required"),
    ({"kafka": {"security": {"protocol": "SASL_PLAINTEXT"}, "sasl": {"existingSecret": "c"}}}, "kafka.sasl.mechanism is required"),
    ({"kafka": {"tls": {"existingSecret": "ca"}}}, "needs kafka.security.protocol SSL or SASL_SSL"),
    ({"kafka": {"security": {"protocol": "SSL"}, "tls": {"existingSecret": "ca", "certificateKey": "c.pem"}}},
     "certificateKey and kafka.tls.keyKey go together"),
    ({"kafka": {"security": {"protocol": "SSL"}, "tls": {"certificateKey": "c.pem", "keyKey": "c.key"}}},
     "which is empty"),
    ({"kafka": {"security": {"protocol": "SSL"}, "tls": {"existingSecret": "ca", "keyPasswordKey": "p"}}},
     "keyPasswordKey is the password of kafka.tls.keyKey"),
    ({"queries": {"queries": None}}, "queries must be a mapping with a 'queries' list"),  # null removes the default list
    ({"assignment": "static", "replicas": 2, "queries": {"budget": {"principal": "query", "default": {"max_epsilon": 60}}}},
     "queries.budget.start is required with replicas 2"),
    ({"queries": {"budget": {"principal": "query", "default": {"max_epsilon": 60}}}},
     "queries.budget.start is required with assignment group"),
    ({"delivery": "at-least-once"}, "assignment group needs delivery exactly-once"),
])
def test_inconsistent_values_fail_to_render(values, message):
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        render_files(values)


@pytest.mark.parametrize("values", [
    {"replica": 3},  # a typo must not be ignored
    {"replicas": 0},
    {"assignment": "dynamic"},
    {"fetchRecords": 0},
    {"kafka": {"security": {"protocol": "SSL_PLAINTEXT"}}},
    {"persistence": {"size": "lots"}},
    {"queries": "queries: []"},
    {"queriesYaml": {"queries": []}},
])
def test_schema_rejects_bad_values(values):
    with pytest.raises(helm_python.HelmValuesError):
        render_files(values)


# --- security ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value_set", ["default", "custom"])
def test_pods_run_locked_down(value_set):
    _, docs = rendered(value_set)
    _, pod, container = worker(docs)
    psc, csc = pod["securityContext"], container["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 10001 and psc["fsGroup"] == 10001
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert csc["runAsNonRoot"] is True and csc["runAsUser"] == 10001
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"] == {"drop": ["ALL"]}
    assert csc["seccompProfile"] == {"type": "RuntimeDefault"}
    # with a read-only root, everything the worker writes is a volume: its state and /tmp
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/var/lib/dpstream", "/tmp"}
    assert "emptyDir" in volume(pod, "tmp")


def test_kafka_security_settings_become_client_env_vars():
    _, docs = rendered("default")
    env = env_of(worker(docs)[2])
    assert env["DPSTREAM_KAFKA_SECURITY_PROTOCOL"]["value"] == "PLAINTEXT"
    assert not {"DPSTREAM_KAFKA_SASL_MECHANISM", "DPSTREAM_KAFKA_SASL_USERNAME", "DPSTREAM_KAFKA_SASL_PASSWORD",
                "DPSTREAM_KAFKA_SSL_CA_LOCATION", "DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION", "DPSTREAM_KAFKA_SSL_KEY_LOCATION",
                "DPSTREAM_KAFKA_SSL_KEY_PASSWORD"} & env.keys()

    _, docs = rendered("custom")
    _, pod, container = worker(docs)
    env = env_of(container)
    assert env["DPSTREAM_KAFKA_SECURITY_PROTOCOL"]["value"] == "SASL_SSL"
    assert env["DPSTREAM_KAFKA_SASL_MECHANISM"]["value"] == "SCRAM-SHA-512"
    assert env["DPSTREAM_KAFKA_SASL_USERNAME"]["valueFrom"] == {"secretKeyRef": {"name": "kafka-credentials", "key": "user"}}
    assert env["DPSTREAM_KAFKA_SASL_PASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "kafka-credentials", "key": "pass"}}
    assert volume(pod, "kafka-tls")["secret"]["secretName"] == "kafka-ca"
    ca = mount(container, "kafka-tls")
    assert ca["readOnly"] is True
    assert env["DPSTREAM_KAFKA_SSL_CA_LOCATION"]["value"] == f"{ca['mountPath']}/ca.pem"
    # a client certificate (a listener with ssl.client.auth=required): its files from the same
    # Secret, the key readable by the pod's group only; the key's password never in the manifest
    assert env["DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION"]["value"] == f"{ca['mountPath']}/client.pem"
    assert env["DPSTREAM_KAFKA_SSL_KEY_LOCATION"]["value"] == f"{ca['mountPath']}/client.key"
    assert env["DPSTREAM_KAFKA_SSL_KEY_PASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "kafka-ca",
                                                                                    "key": "client.key.password"}}
    items = {i["key"]: i for i in volume(pod, "kafka-tls")["secret"]["items"]}
    assert set(items) == {"ca.pem", "client.pem", "client.key"}
    assert items["client.key"]["mode"] == 0o440 and "mode" not in items["client.pem"]


def test_kafka_properties_reach_every_client_as_properties_files(tmp_path):
    from dpstream.topics.client_properties import PROPERTIES_FILE_ENV, read_properties_file

    _, docs = rendered("kafka-properties")
    _, pod, container = worker(docs)
    env = env_of(container)
    files = env[PROPERTIES_FILE_ENV]["value"].split(",")
    config_dir, secret_dir = mount(container, "config")["mountPath"], mount(container, "kafka-properties")["mountPath"]
    # the map first, the Secret's file after it (its settings win)
    assert files == [f"{config_dir}/kafka-client.properties", f"{secret_dir}/client.properties"]
    # a security protocol only the files set: no PLAINTEXT variable overriding them
    assert "DPSTREAM_KAFKA_SECURITY_PROTOCOL" not in env
    text = only(docs, "ConfigMap")["data"]["kafka-client.properties"]
    (tmp_path / "p").write_text(text)
    assert read_properties_file(str(tmp_path / "p")) == {"sasl.mechanism": "SCRAM-SHA-256",
                                                         "ssl.endpoint.identification.algorithm": "none"}
    secret = volume(pod, "kafka-properties")["secret"]
    assert secret["secretName"] == "kafka-client" and secret["defaultMode"] == 0o440
    assert mount(container, "kafka-properties")["readOnly"] is True
    _, docs = rendered("default")
    assert PROPERTIES_FILE_ENV not in env_of(worker(docs)[2])
    assert "kafka-client.properties" not in only(docs, "ConfigMap")["data"]


# --- metrics and availability -------------------------------------------------------------------

def test_prometheus_scrape_annotations_follow_the_value():
    _, docs = rendered("default")
    annotations = worker(docs)[0]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9400"
    assert annotations["prometheus.io/path"] == "/metrics"
    _, docs = rendered("custom")
    annotations = worker(docs)[0]["spec"]["template"]["metadata"]["annotations"]
    assert not [a for a in annotations if a.startswith("prometheus.io/")]


def test_service_monitor_only_when_enabled():
    _, docs = rendered("default")
    assert not [d for d in docs if d["kind"] == "ServiceMonitor"]
    _, docs = rendered("custom")
    monitor = only(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s"}
    services = [d for d in docs if d["kind"] == "Service"]
    chosen = [s["metadata"]["name"] for s in services if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert chosen == [f"{FULLNAME}-metrics"], "the ServiceMonitor must select the metrics Service only (no double scrape)"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def test_pod_disruption_budget_by_default_and_removable():
    _, docs = rendered("default")
    pdb = only(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1
    assert selects(pdb["spec"]["selector"]["matchLabels"], worker(docs)[0]["spec"]["template"]["metadata"]["labels"])
    _, docs = rendered("custom")
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"]


# --- network policy (docs/threat-model.md) -------------------------------------------------------

def label_selector_matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes LabelSelector (matchLabels and the In / NotIn / Exists / DoesNotExist
    expressions) against a pod's labels."""
    if not selects(selector.get("matchLabels", {}), labels):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": present and value in e.get("values", []), "NotIn": not present or value not in e.get("values", []),
              "Exists": present, "DoesNotExist": not present}[e["operator"]]
        if not ok:
            return False
    return True


def egress_ports(policy: dict) -> list[set[tuple[int, str]]]:
    return [{(p["port"], p["protocol"]) for p in rule["ports"]} for rule in policy["spec"]["egress"]]


@pytest.mark.parametrize("value_set, web_port, kafka_port", [("default", 9400, 9092), ("custom", 9500, 9093)])
def test_network_policy_by_default_admits_monitoring_to_the_web_port_only_and_lets_out_kafka_and_dns(value_set, web_port,
                                                                                                      kafka_port):
    _, docs = rendered(value_set)
    policy = only(docs, "NetworkPolicy")
    spec = policy["spec"]
    assert label_selector_matches(spec["podSelector"], worker(docs)[0]["spec"]["template"]["metadata"]["labels"])
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    (ingress,) = spec["ingress"]
    assert ingress["ports"] == [{"port": web_port, "protocol": "TCP"}]
    assert ingress["from"] == [{"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}]}}]
    assert label_selector_matches(ingress["from"][0]["namespaceSelector"], {"kubernetes.io/metadata.name": "monitoring"})
    assert not label_selector_matches(ingress["from"][0]["namespaceSelector"], {"kubernetes.io/metadata.name": NAMESPACE})
    # the brokers' port (both custom servers listen on 9093: one port) and DNS, to any address; nothing else
    assert egress_ports(policy) == [{(kafka_port, "TCP")}, {(53, "UDP"), (53, "TCP")}]
    assert not [rule for rule in spec["egress"] if "to" in rule]


def test_network_policy_can_be_turned_off():
    assert not [d for d in manifests(render_files({"networkPolicy": {"enabled": False}})) if d["kind"] == "NetworkPolicy"]


def test_network_policy_follows_its_values():
    kafka_peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kafka"}},
                  "podSelector": {"matchLabels": {"app": "kafka"}}}
    dns_peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
    extra = {"to": [{"ipBlock": {"cidr": "203.0.113.7/32"}}], "ports": [{"port": 443, "protocol": "TCP"}]}
    values = {"kafka": {"bootstrapServers": "kafka://a.kafka:9093, b.kafka:9094,c.kafka,[fd00::7]:9093"},
              "networkPolicy": {"ingress": {"namespaceSelector": {"matchLabels": {"team": "obs"}},
                                            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                                            "extraFrom": [{"ipBlock": {"cidr": "10.1.0.0/16"}}]},
                                "egress": {"kafka": {"to": [kafka_peer]}, "dns": {"to": [dns_peer]}},
                                "extraEgress": [extra]}}
    docs = manifests(render_files(values))
    spec = only(docs, "NetworkPolicy")["spec"]
    assert spec["ingress"][0]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "obs"}},
                                           "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
                                          {"ipBlock": {"cidr": "10.1.0.0/16"}}]
    kafka_rule, dns_rule, extra_rule = spec["egress"]
    # every bootstrap server's port, 9092 where none is given, each once
    assert kafka_rule["ports"] == [{"port": p, "protocol": "TCP"} for p in (9093, 9094, 9092)]
    assert kafka_rule["to"] == [kafka_peer] and dns_rule["to"] == [dns_peer] and extra_rule == extra
    # namespaces by name; and no peer at all admits nothing (a rule with an empty `from` would admit everyone)
    docs = manifests(render_files({"networkPolicy": {"ingress": {"namespaces": ["mon", "ops"]}}}))
    (rule,) = only(docs, "NetworkPolicy")["spec"]["ingress"]
    assert rule["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == ["mon", "ops"]
    docs = manifests(render_files({"networkPolicy": {"ingress": {"namespaces": []}}}))
    assert only(docs, "NetworkPolicy")["spec"]["ingress"] == []
    # explicit broker ports win over the bootstrap servers'; DNS can be left out
    docs = manifests(render_files({**values, "networkPolicy": {"egress": {"kafka": {"ports": [9095]}, "dns": {"enabled": False}}}}))
    assert egress_ports(only(docs, "NetworkPolicy")) == [{(9095, "TCP")}]


@pytest.mark.parametrize("values, ports", [
    (SCHEMA_REGISTRY, {8081}),  # the registry of the queries config (a mapping)
    ({"queriesYaml": EXAMPLE_QUERIES_TEXT + "input_format: avro\nschema_registry:\n  url: http://registry.internal\n"}, {80}),
    ({"kafka": {"properties": {"sasl.oauthbearer.token.endpoint.url": "https://idp.example.com/oauth2/token"}}}, {443}),
])
def test_network_policy_lets_out_the_registry_and_token_endpoint_the_config_names(values, ports):
    docs = manifests(render_files(values))
    (kafka, dns, endpoints) = egress_ports(only(docs, "NetworkPolicy"))
    assert endpoints == {(p, "TCP") for p in ports}
    off = copy.deepcopy(values) | {"networkPolicy": {"egress": {"endpointsFromConfig": False}}}
    assert len(egress_ports(only(manifests(render_files(off)), "NetworkPolicy"))) == 2


@pytest.mark.parametrize("values", [
    {"networkPolicy": {"egress": {"kafka": {"ports": [0]}}}},
    {"networkPolicy": {"ingress": {"namespaceSelector": {"matchLabel": {"a": "b"}}}}},  # a typo
    {"networkPolicy": {"egress": {"kafka": {"to": [{"ipblock": {"cidr": "10.0.0.0/8"}}]}}}},
    {"networkPolicy": {"extraEgress": [{"too": []}]}},
    {"networkPolicy": {"enable": False}},
])
def test_schema_rejects_bad_network_policy_values(values):
    with pytest.raises(helm_python.HelmValuesError):
        render_files(values)


# --- the dead-letter topic's retention ----------------------------------------------------------

def test_dead_letter_retention_reaches_the_worker_as_the_code_reads_it():
    from dpstream.topics.kafka import DEAD_LETTER_RETENTION_ENV, dead_letter_retention_ms

    for values, ms in (({}, 7 * 86_400_000), ({"deadLetterRetention": "36h"}, 36 * 3_600_000)):
        env = env_of(worker(manifests(render_files(values)))[2])
        assert dead_letter_retention_ms({DEAD_LETTER_RETENTION_ENV: env[DEAD_LETTER_RETENTION_ENV]["value"]}) == ms
    with pytest.raises(helm_python.HelmValuesError):
        render_files({"deadLetterRetention": "a week"})


# --- the reset Job (docs/operator-guide.md, "Operations (Kubernetes)") -----------------------------

#: the worker's own settings, which `dpstream reset` does not read
WORKER_ONLY_ENV = {"DPSTREAM_STATE_DIR", "DPSTREAM_ASSIGNMENT", "DPSTREAM_INSTANCE_ID", "DPSTREAM_WORKER_INDEX", "DPSTREAM_WORKERS",
                   "DPSTREAM_PARTITIONS", "DPSTREAM_WEB_PORT", "DPSTREAM_PARTITIONER", "DPSTREAM_FETCH_RECORDS",
                   "DPSTREAM_WATERMARK_DELAY", "DPSTREAM_BROKER_TIMEOUT", "DPSTREAM_BATCH_LINGER", "DPSTREAM_DELIVERY",
                   "DPSTREAM_ALLOW_CREATE_TIME", "DPSTREAM_NOISE_KEY_FILE", "DPSTREAM_DEAD_LETTER_RETENTION"}


def reset_job(docs: list[dict]) -> tuple[dict, dict, dict]:
    """(job, pod spec, reset container)."""
    job = only(docs, "Job")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return job, pod, container


def test_reset_job_only_when_asked():
    for value_set in VALUE_SETS:
        if value_set != "reset":
            assert not [d for d in rendered(value_set)[1] if d["kind"] == "Job"], value_set
    assert only(rendered("reset")[1], "Job")["metadata"]["name"] == f"{FULLNAME}-reset"


def test_reset_job_runs_with_the_workers_config_app_id_kafka_settings_and_secrets():
    _, docs = rendered("reset")
    _, worker_pod, worker_container = worker(docs)
    job, pod, container = reset_job(docs)
    assert job["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    worker_env, env = env_of(worker_container), env_of(container)
    shared = {name: e for name, e in worker_env.items() if name not in WORKER_ONLY_ENV}
    assert {"DPSTREAM_BROKER", "DPSTREAM_APP_ID", "DPSTREAM_KAFKA_SASL_PASSWORD", "DPSTREAM_KAFKA_SSL_KEY_PASSWORD",
            "DPSTREAM_KAFKA_PROPERTIES_FILE", "DPSTREAM_SCHEMA_REGISTRY_USER_INFO", "DPSTREAM_QUERY_PAGE_CLICKS_EPSILON"} <= set(shared)
    assert {n: e for n, e in env.items() if n != "DPSTREAM_STATE_DIR"} == shared
    # the same files at the same paths: the ConfigMap, the Kafka CA and client key, the properties Secret
    for name in ("config", "kafka-tls", "kafka-properties"):
        assert mount(container, name) == mount(worker_container, name), name
        assert volume(pod, name) == volume(worker_pod, name), name
    assert {m["name"] for m in container["volumeMounts"]} == {"config", "kafka-tls", "kafka-properties", "tmp"}
    assert "noise-key" not in {v["name"] for v in pod["volumes"]}, "reset does not need the noise secret"
    for field in ("image", "securityContext"):
        assert container[field] == worker_container[field], field
    for field in ("serviceAccountName", "automountServiceAccountToken", "securityContext"):
        assert pod[field] == worker_pod[field], field
    config_path = worker_container["args"][worker_container["args"].index("--config") + 1]
    assert container["args"] == ["reset", "--config", config_path, "--yes"]
    # its state directory is one that does not exist (the workers' volumes are deleted by hand)
    state_dir = env["DPSTREAM_STATE_DIR"]["value"]
    assert not [m for m in container["volumeMounts"] if m["mountPath"] == state_dir]


def test_reset_job_command_line_is_the_cli_s(monkeypatch):
    """The Job's args and literal env, given to dpstream's own parser: the app id, the broker and
    the state directory it resets are the workers'."""
    from dpstream.processor.cli import build_parser

    _, docs = rendered("reset")
    _, _, container = reset_job(docs)
    for name, e in env_of(container).items():
        if "value" in e:
            monkeypatch.setenv(name, e["value"])
    args = build_parser().parse_args(container["args"])
    assert args.func.__name__ == "cmd_reset"
    assert (args.app_id, args.broker, args.yes, args.delete_outputs) == ("dpstream-prod", CUSTOM["kafka"]["bootstrapServers"], True, False)
    assert args.state_dir == "/tmp/dpstream-state"
    dry = reset_job(manifests(render_files({"reset": {"enabled": True, "deleteOutputs": True}})))[2]
    assert dry["args"][-1] == "--delete-outputs" and "--yes" not in dry["args"]


def test_reset_pod_is_not_a_worker_but_is_under_the_network_policy():
    _, docs = rendered("reset")
    labels = reset_job(docs)[0]["spec"]["template"]["metadata"]["labels"]
    sts = worker(docs)[0]
    assert not selects(sts["spec"]["selector"]["matchLabels"], labels)
    for service in [d for d in docs if d["kind"] == "Service"]:
        assert not selects(service["spec"]["selector"], labels), service["metadata"]["name"]
    assert label_selector_matches(only(docs, "NetworkPolicy")["spec"]["podSelector"], labels)
    # and the policy selects nothing else of another release in the namespace
    assert not label_selector_matches(only(docs, "NetworkPolicy")["spec"]["podSelector"], {**labels, "app.kubernetes.io/instance": "other"})


def test_reset_job_is_refused_in_a_release_upgrade():
    with helm_python.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm_python.HelmRenderError, match=re.escape("--show-only templates/reset-job.yaml")):
            chart.render({"reset": {"enabled": True}}, name=RELEASE, namespace=NAMESPACE, is_upgrade=True, is_install=False)


def test_resources_come_from_values():
    _, docs = rendered("default")
    assert worker(docs)[2]["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    _, docs = rendered("custom")
    assert worker(docs)[2]["resources"] == CUSTOM["resources"]


# --- the queries config -------------------------------------------------------------------------

@pytest.mark.parametrize("value_set, names, dynamic", [
    ("default", ["page_clicks"], []),
    ("queries-mapping", ["url_clicks", "url_clicks_fine", "basket_value", "visits_by_place"], ["active_plans"]),
    ("queries-text", ["url_clicks", "url_clicks_fine", "basket_value", "visits_by_place"], ["active_plans"]),
    ("dynamic-only", [], ["active_plans"]),
])
def test_configmap_queries_load_with_the_project_loader(value_set, names, dynamic, tmp_path):
    _, docs = rendered(value_set)
    sts, pod, container = worker(docs)
    configmap = only(docs, "ConfigMap")
    assert volume(pod, "config")["configMap"]["name"] == configmap["metadata"]["name"]
    config_mount = mount(container, "config")
    assert config_mount["readOnly"] is True
    args = container["args"]
    assert args[0] == "worker"
    assert args[args.index("--config") + 1] == f"{config_mount['mountPath']}/queries.yaml"
    path = tmp_path / "queries.yaml"
    path.write_text(configmap["data"]["queries.yaml"])
    config = load_config(path, environ={})
    assert [q.name for q in config.queries] == names
    assert [q.name for q in config.dynamic] == dynamic
    if value_set == "default":
        (query,) = config.queries
        assert (query.epsilon, query.delta, query.triggers, query.window) == (6.0, 1e-9, 60, "1h")
    if value_set == "queries-text":
        assert configmap["data"]["queries.yaml"].strip() == EXAMPLE_QUERIES_TEXT.strip()


def test_config_checksum_rolls_pods_when_queries_change():
    def checksum(values):
        return worker(manifests(render_files(values)))[0]["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    base = checksum({})
    assert re.fullmatch(r"[0-9a-f]{64}", base)
    assert checksum({}) == base
    assert checksum({"replicas": 2}) == base, "only the config should move the checksum"
    changed = copy.deepcopy(yaml.safe_load((CHART / "values.yaml").read_text())["queries"])
    changed["queries"][0]["epsilon"] = 3.0
    assert checksum({"queries": changed}) != base
    assert checksum(AS_STRING) != base


# --- validation and lint ------------------------------------------------------------------------

@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_manifests_validate_strictly_against_kubernetes_schemas(value_set):
    _, docs = rendered(value_set)
    checked = 0
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']} {doc['metadata']['name']} invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}")
        checked += 1
    assert checked == len([d for d in docs if (d['apiVersion'], d['kind']) not in CRD_KINDS]) >= 5


def test_strict_validation_would_catch_a_mistake():
    """Guard against a validator that accepts anything (e.g. a missing schema)."""
    _, docs = rendered("default")
    sts = copy.deepcopy(worker(docs)[0])
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBE_VERSIONS[0], strict=True)


def _lint(text: str) -> list[str]:
    config = YamlLintConfig(file=str(YAMLLINT_CONFIG))
    return [f"{p.line}:{p.column} {p.level} {p.desc} ({p.rule})" for p in yamllint_linter.run(text, config)]


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_rendered_output_passes_yamllint(value_set):
    files, _ = rendered(value_set)
    stream = "".join(f"---\n# Source: {path}\n{text.strip()}\n" for path, text in files.items())
    assert _lint(stream) == []


def test_values_file_passes_yamllint():
    assert _lint((CHART / "values.yaml").read_text()) == []


@pytest.mark.parametrize("value_set", ["default", "custom", "create-secret", "monitoring", "reset"])
def test_helm_lint_strict(value_set):
    report = helm_python.lint(str(CHART), copy.deepcopy(VALUE_SETS[value_set]), strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


FREE_FORM = ("queries", "resources", "podSecurityContext", "securityContext",  # documented as a whole
             "reset.resources")


def undocumented_values(text: str) -> list[str]:
    """Keys of values.yaml with no comment on the line above or on their own line. Groups
    (non-empty mappings) need none; the contents of free-form values are documented as a whole."""
    lines = text.splitlines()
    missing = []

    def walk(node, path):
        for key, value in node.value:
            key_path = path + (key.value,)
            free_form = any(".".join(key_path[:i]) in FREE_FORM for i in range(1, len(key_path) + 1))
            if free_form or not (isinstance(value, yaml.MappingNode) and value.value):
                line = key.start_mark.line
                if not (line and lines[line - 1].strip().startswith("#")) and "#" not in lines[line]:
                    missing.append(".".join(key_path))
            if isinstance(value, yaml.MappingNode) and not free_form:
                walk(value, key_path)

    walk(yaml.compose(text), ())
    return missing


def test_every_value_is_documented():
    text = (CHART / "values.yaml").read_text()
    assert undocumented_values(text) == []
    # the check itself notices a value without a comment, also inside a group
    assert undocumented_values(text.replace("  pullPolicy: IfNotPresent", "  pullPolicy: IfNotPresent\n  extra: 1")) == ["image.extra"]
    assert undocumented_values(text + "\nsurprise: true\n") == ["surprise"]


def test_notes_tell_how_to_create_the_noise_secret():
    with helm_python.Chart.load(str(CHART)) as chart:
        files = chart.render({}, name=RELEASE, namespace=NAMESPACE)
    (notes,) = [text for path, text in files.items() if path.endswith("NOTES.txt")]
    assert f"kubectl -n {NAMESPACE} create secret generic {FULLNAME}-noise-key --from-file=noise.key=" in notes
    assert "new epoch" in notes


# --- the image ----------------------------------------------------------------------------------

def test_dockerfile_builds_the_pinned_package_as_a_non_root_user():
    dockerfile = (ROOT / "Dockerfile").read_text()
    instructions = [line.strip() for line in re.sub(r"\\\n", " ", dockerfile).splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in instructions
    assert [i for i in instructions if i.startswith("FROM ")][-1] == "FROM ${PYTHON_IMAGE}"
    install = [i for i in instructions if "pip install" in i]
    assert len(install) == 1 and "--no-cache-dir -c constraints.txt ." in install[0] and "[" not in install[0], install
    # the package's folders (pyproject's package-dir: dpstream and the four mapped under it)
    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert folders == {"dpstream", "accountant", "processor", "state", "topics"}
    for name in ("pyproject.toml", "constraints.txt", "README.md", *folders):
        assert re.search(rf"^COPY .*\b{re.escape(name)}\b", dockerfile, re.M), f"{name} is not copied"
    assert "USER 10001:10001" in instructions
    assert "--uid 10001" in dockerfile
    assert "EXPOSE 9400" in instructions
    assert 'ENTRYPOINT ["dpstream"]' in instructions
    assert 'CMD ["worker", "--config", "/etc/dpstream/queries.yaml"]' in instructions
    assert any(i.startswith("WORKDIR ") for i in instructions)
    # the chart runs the image as the same user and passes the same config path
    _, docs = rendered("default")
    assert worker(docs)[1]["securityContext"]["runAsUser"] == 10001
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")}
    assert {".venv", ".git", "tests", "benchmarks", ".broker"} <= ignored
    assert not ignored & {*folders, "pyproject.toml", "constraints.txt", "README.md"}


# --- dashboard and alerts (docs/operations.md, "Dashboards and alerts") ----------------------------

DASHBOARD_FILE = CHART / "dashboards" / "dpstream.json"
ALERTS = {"DpstreamConsumerLagGrowing", "DpstreamTriggerOverdue", "DpstreamTriggerSlow", "DpstreamBudgetLow",
          "DpstreamBudgetRefused", "DpstreamDeadLetters", "DpstreamNotReady", "DpstreamWorkerDown", "DpstreamWorkersAbsent"}
#: series Prometheus writes itself for every scrape target (not the worker's), and the alerts that read them
PROMETHEUS_SERIES = {"up"}
SCRAPE_ALERTS = {"alert DpstreamWorkerDown", "alert DpstreamWorkersAbsent"}
#: Grafana's own variables, as the test substitutes them before parsing a panel's PromQL
GRAFANA_BUILTINS = {"__rate_interval": "5m", "__interval": "1m", "__range": "6h"}
#: the fields of a rule group and of a rule in the PrometheusRule CRD (monitoring.coreos.com/v1)
RULE_GROUP_FIELDS = {"name", "interval", "rules", "labels", "limit", "partial_response_strategy", "query_offset"}
RULE_FIELDS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
PROM_DURATION = re.compile(r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$")


def dashboard_json() -> dict:
    import json

    return json.loads(DASHBOARD_FILE.read_text())


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target, Grafana variables substituted: $__rate_interval
    by a duration, $job and $query (only ever inside label matchers' strings) left as they are."""
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name in re.findall(r"\$\{?(\w+)", expr):
                assert name in defined or name in GRAFANA_BUILTINS, f"panel {panel['title']!r} uses undefined ${name}"
            for name, value in GRAFANA_BUILTINS.items():
                expr = expr.replace(f"${name}", value)
            out.append((f"panel {panel['title']!r} {target['refId']}", expr))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":  # label_values(<series selector>, <label>): the selector is PromQL
            (selector,) = re.fullmatch(r"label_values\((.+), *\w+\)", var["query"]).groups()
            out.append((f"variable ${var['name']}", selector))
    return out


def rule_queries(docs: list[dict]) -> list[tuple[str, str]]:
    rule = only(docs, "PrometheusRule")
    return [(f"alert {r['alert']}", r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"]]


def metric_names(where: str, expr: str) -> set[str]:
    """The metric names a PromQL expression reads; fails (naming ``where``) if it does not parse
    or type-check (promql-parser: the grammar, function names and argument types of Prometheus)."""
    try:
        ast = promql_parser.parse(expr)
    except ValueError as exc:
        pytest.fail(f"{where}: not valid PromQL ({exc}): {expr}")
    names = set()
    promql_parser.walk(ast, lambda node: names.add(node.name) if isinstance(node, promql_parser.VectorSelector) else None)
    assert None not in names and names, f"{where}: every selector must name its metric: {expr}"
    return names


def served_sample_names() -> set[str]:
    """The sample names the worker's registry can serve (processor/adapters/metrics.py), by type:
    counters with _total, histograms with _bucket/_sum/_count."""
    from dpstream.processor.adapters.metrics import PipelineMetrics

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return {family.name + suffix for family in PipelineMetrics().registry.collect() for suffix in suffixes[family.type]}


def test_monitoring_resources_only_when_enabled():
    for value_set in ("default", "custom"):
        _, docs = rendered(value_set)
        assert not [d for d in docs if d["kind"] == "PrometheusRule"]
        assert [d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"] == [FULLNAME]
    _, docs = rendered("monitoring")
    assert only(docs, "PrometheusRule")["metadata"]["name"] == FULLNAME
    assert sorted(d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap") == [FULLNAME, f"{FULLNAME}-dashboard"]


def test_dashboard_configmap_carries_the_chart_file_for_the_sidecar():
    import json

    _, docs = rendered("monitoring")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{FULLNAME}-dashboard"]
    assert cm["metadata"]["namespace"] == "grafana"
    labels = cm["metadata"]["labels"]
    assert labels["grafana.example.com/dashboard"] == "dp" and labels["team"] == "data"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "streams"}
    assert list(cm["data"]) == ["dpstream.json"]
    assert json.loads(cm["data"]["dpstream.json"]) == dashboard_json(), "the ConfigMap must carry the chart's file, whole"
    # the defaults: the sidecar's default label, in the release namespace
    (cm,) = [d for d in manifests(render_files({"grafanaDashboard": {"enabled": True}})) if d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == NAMESPACE


def test_dashboard_is_a_well_formed_grafana_dashboard():
    d = dashboard_json()
    assert d["uid"] == "dpstream" and d["title"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat") and p["title"] and p["description"], p
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["datasource"] == p["datasource"] and t["expr"] for t in p["targets"]), p["title"]
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_prometheus_rule_is_well_formed():
    _, docs = rendered("monitoring")
    rule = only(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"} and set(rule["spec"]) == {"groups"}
    assert rule["metadata"]["namespace"] == NAMESPACE and rule["metadata"]["labels"]["release"] == "prometheus"
    groups = rule["spec"]["groups"]
    assert [g["name"] for g in groups] == ["dpstream"]  # a list-map keyed by name: names unique and non-empty
    alerts = {}
    for group in groups:
        assert set(group) <= RULE_GROUP_FIELDS and group["rules"]
        for r in group["rules"]:
            assert set(r) <= RULE_FIELDS, r
            assert "alert" in r and "record" not in r and isinstance(r["expr"], str)
            assert re.fullmatch(r"[A-Z][A-Za-z]+", r["alert"]) and r["alert"] not in alerts
            if "for" in r:
                assert PROM_DURATION.match(r["for"]) and r["for"], r["for"]
            for field in ("labels", "annotations"):
                assert all(isinstance(k, str) and isinstance(v, str) for k, v in r[field].items()), (r["alert"], field)
            assert r["labels"]["severity"] == "page"
            assert {"summary", "description"} <= set(r["annotations"])
            alerts[r["alert"]] = r
    assert set(alerts) == ALERTS
    # the values reach the expressions, and the selector reaches every selector
    assert alerts["DpstreamTriggerOverdue"]["for"] == "3m" and alerts["DpstreamTriggerOverdue"]["expr"].endswith("> 120")
    assert alerts["DpstreamDeadLetters"]["expr"].rstrip().endswith("> 0.05")
    for where, expr in rule_queries(docs):
        ast = promql_parser.parse(expr)
        selectors = []
        promql_parser.walk(ast, lambda n: selectors.append(str(n)) if isinstance(n, promql_parser.VectorSelector) else None)
        assert selectors and all(f'job="{FULLNAME}-metrics"' in s for s in selectors), (where, selectors)


def test_worker_down_alerts_read_the_scrape_targets_of_the_workers():
    """A worker that cannot be scraped has stale metrics, not 0s: only Prometheus' own `up` shows it."""
    def scrape_alerts(values):
        rules = {r["alert"]: r for g in only(manifests(render_files(values)), "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
        return rules["DpstreamWorkerDown"], rules["DpstreamWorkersAbsent"]

    down, absent = scrape_alerts({"prometheusRule": {"enabled": True}})
    # the ServiceMonitor's job (the metrics Service's name) in the release namespace
    targets = f'up{{job="{FULLNAME}-metrics", namespace="{NAMESPACE}"}}'
    assert down["expr"] == f"{targets} == 0" and absent["expr"] == f"absent({targets})"
    assert down["for"] == absent["for"] == "5m"
    ast = promql_parser.parse(down["expr"])
    assert isinstance(ast, promql_parser.BinaryExpr) and str(ast.rhs) == "0"
    assert isinstance(promql_parser.parse(absent["expr"]), promql_parser.Call)
    # the selector follows the metrics Service's name: a scrape of it is what the alert watches
    assert only(rendered("monitoring")[1], "ServiceMonitor")["spec"]["selector"]
    services = {d["metadata"]["name"] for d in rendered("monitoring")[1] if d["kind"] == "Service"}
    assert f"{FULLNAME}-metrics" in services
    down, absent = scrape_alerts({"prometheusRule": {"enabled": True, "workerDown": {
        "for": "2m", "selector": 'job="kubernetes-pods", pod=~"dp-dpstream-[0-9]+"'}}})
    assert down["expr"] == 'up{job="kubernetes-pods", pod=~"dp-dpstream-[0-9]+"} == 0' and down["for"] == "2m"
    with pytest.raises(helm_python.HelmValuesError):
        render_files({"prometheusRule": {"enabled": True, "workerDown": {"selector": "{job='x'}"}}})


def test_alert_annotations_keep_prometheus_templates():
    """Helm must leave {{ $labels.x }} and {{ $value }} to Prometheus."""
    _, docs = rendered("monitoring")
    rules = {r["alert"]: r for g in only(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    assert "{{ $labels.query }}" in rules["DpstreamTriggerOverdue"]["annotations"]["summary"]
    assert "{{ $value | humanizeDuration }}" in rules["DpstreamTriggerOverdue"]["annotations"]["description"]


@pytest.mark.parametrize("value_set", ["monitoring", "rules-default"])
def test_every_query_parses_and_reads_a_metric_the_worker_defines(value_set):
    """Each panel's and each alert's PromQL parses (grammar, functions, argument types) and reads
    only sample names the worker's registry defines; tests/test_helm_chart.py::
    test_dashboard_and_alert_metrics_are_served_by_a_running_worker checks them on a real /metrics."""
    docs = rendered("monitoring")[1] if value_set == "monitoring" else manifests(render_files({"prometheusRule": {"enabled": True}}))
    served = served_sample_names()
    assert {"dpstream_events_in_total", "dpstream_trigger_duration_seconds_bucket", "dpstream_ready"} <= served
    for where, expr in [*dashboard_queries(dashboard_json()), *rule_queries(docs)]:
        names = metric_names(where, expr)
        if where in SCRAPE_ALERTS:  # Prometheus' own series only
            assert names == PROMETHEUS_SERIES, (where, names)
            continue
        unknown = names - served
        assert not unknown, f"{where} reads {sorted(unknown)}, which the worker does not serve: {expr}"


def test_the_metric_check_would_catch_a_misspelled_metric():
    """Guard the check above: a misspelled name, a histogram read without _bucket, and broken PromQL."""
    served = served_sample_names()
    assert metric_names("x", 'sum(rate(dpstream_event_in_total{job=~"$job"}[5m]))') - served == {"dpstream_event_in_total"}
    assert metric_names("x", "rate(dpstream_trigger_duration_seconds[5m])") - served == {"dpstream_trigger_duration_seconds"}
    with pytest.raises(pytest.fail.Exception, match="not valid PromQL"):
        metric_names("x", "sum(rate(dpstream_events_in_total[5m])")
    with pytest.raises(pytest.fail.Exception, match="not valid PromQL"):
        metric_names("x", "rate(dpstream_ready)")  # a range function given an instant vector


def test_dashboard_and_alert_metrics_are_served_by_a_running_worker(tmp_path, broker):
    """A real worker (the chart's default layout: a consumer group, with a budget ledger) fires a
    trigger; then every sample name the dashboard and the alerts read is on its /metrics."""
    import time

    from confluent_kafka import Producer

    from tests.test_kafka_worker import running

    wanted = {}
    for where, expr in [*dashboard_queries(dashboard_json()), *rule_queries(rendered("monitoring")[1])]:
        for name in metric_names(where, expr) - PROMETHEUS_SERIES:
            wanted.setdefault(name, where)
    with running(tmp_path, broker) as sc:
        started = time.time()
        start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
        sc.config.write_text(sc.config.read_text() + f"budget:\n  start: '{start}'\n  default:\n    max_epsilon: 1000\n    max_delta: 1.0e-3\n")
        w = sc.worker("m", extra=("--assignment", "group", "--instance-id", "m")).start()
        sc.workers.append(w)
        w.wait_ready()
        sc.write_events(2_000, users=200, keys=20, lead_s=1)
        sc.produce_events()
        p = Producer({"bootstrap.servers": sc.broker})
        p.produce(sc.input, b"{not json", b"u1")  # a dead letter
        assert p.flush(30) == 0
        deadline, missing = time.time() + 90, set(wanted)
        while time.time() < deadline:
            try:
                served = {name for (name, _), _ in w.metrics().items()}
            except OSError:  # busy firing: ask again
                served = set()
            missing = set(wanted) - served
            if not missing and w.metric("dpstream_triggers_fired_total", query=sc.query) > 0:
                break
            time.sleep(1)
        assert w.metric("dpstream_triggers_fired_total", query=sc.query) > 0, "no trigger fired"
        assert not missing, "read by the dashboard or the alerts, not served: " + ", ".join(f"{n} ({wanted[n]})" for n in sorted(missing))
        # the trigger gauges: the next is the fire time (end plus the allowed lateness) of a trigger
        # of the schedule, one every 3 s from a window's start, and not far ahead; it can be in the
        # past: it is the earliest still to fire on any owned partition (a worker behind on a loaded
        # machine was 22 s behind). The last fired since the worker started.
        now = time.time()
        next_ms = round(w.metric("dpstream_next_trigger_timestamp_seconds", query=sc.query) * 1000)
        window_ms = sc.window_s * 1000  # windows start at multiples of it (from the budget's start: now)
        assert int(started * 1000) // window_ms * window_ms < next_ms < (now + 15) * 1000
        assert (next_ms - sc.lateness_s * 1000) % (window_ms // sc.triggers) == 0, next_ms
        last = w.metric("dpstream_last_trigger_timestamp_seconds", query=sc.query)
        assert started <= last <= time.time()  # read after the scrape: a trigger may fire between the two
        # the budget remaining is the ledger's (1000 less what was charged), not the config's
        remaining = w.metric("dpstream_budget_epsilon_remaining", query=sc.query)
        assert remaining == w.metric("dpstream_ledger_epsilon_remaining", principal=sc.query) < 1000


# --- settings the chart refuses at render time ------------------------------------------------------

def one_query(**fields) -> dict:
    return {"name": "q", "epsilon": 1.0, "delta": 1e-9, "window": "1h", "triggers": 60, **fields}


@pytest.mark.parametrize("values, message", [
    # group: every input, repartition and dynamic-update partition has one owner
    ({"replicas": 17}, "replicas 17 is more than the 16 partitions the consumer group assigns"),
    ({"inputPartitions": 2, "replicas": 11}, "replicas 11 is more than the 10 partitions the consumer group assigns"),
    ({"queriesYaml": EXAMPLE_QUERIES_TEXT, "replicas": 42},
     "42 is more than the 41 partitions the consumer group assigns (input topics: 1 x inputPartitions 8, repartition "
     "topics: 4 x partitions 8, dynamic-update topics: 1 x 1)"),
    # static: worker i owns p % replicas == i of every topic
    ({"assignment": "static", "replicas": 9}, "replicas 9 is more than any source topic's partitions (partitions 8, inputPartitions 8)"),
    ({"assignment": "static", "replicas": 13, "inputPartitions": 12}, "(partitions 8, inputPartitions 12)"),
])
def test_more_replicas_than_partitions_fail_to_render(values, message):
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        render_files(values)


@pytest.mark.parametrize("values", [
    {"replicas": 16}, {"assignment": "static", "replicas": 8}, {"assignment": "static", "replicas": 12, "inputPartitions": 12},
    {"queriesYaml": EXAMPLE_QUERIES_TEXT, "replicas": 41},
    {"queriesYaml": (ROOT / "examples" / "worker.yaml").read_text(), "assignment": "static"},
])
def test_as_many_replicas_as_partitions_render(values):
    assert only(manifests(render_files(values)), "StatefulSet")["spec"]["replicas"] == values.get("replicas", 1)


def _yaml_text(config: dict) -> str:
    return yaml.safe_dump(config, sort_keys=False)


INVALID_CONFIGS = [  # (config, the chart's message): the worker's loader refuses each too
    ({"queries": [one_query(epsilon=-1)]}, "queries[0].epsilon: must be a positive finite number, got -1"),
    ({"queries": [one_query(epsilon=0)]}, "queries[0].epsilon: must be a positive finite number, got 0"),
    ({"queries": [one_query(delta=1)]}, "queries[0].delta: must be in (0, 1), got 1"),
    ({"queries": [one_query(triggers=0)]}, "queries[0].triggers: must be an integer in [1, 2^24], got 0"),
    ({"queries": [one_query(triggers=7)]}, "queries[0].triggers: the window (1h) must split into 7 whole milliseconds"),
    ({"queries": [one_query(window="1 hour")]}, "queries[0].window: must be a positive duration"),
    ({"queries": [one_query(max_skew="0s")]}, "queries[0].max_skew: must be a duration like '1d', '15m', '30s' (positive)"),
    ({"queries": [one_query(contribution_bound=0)]}, "queries[0].contribution_bound: must be an integer >= 1, got 0"),
    ({"queries": [one_query(per_key_bound=0)]}, "queries[0].per_key_bound: must be an integer from 1 to contribution_bound (C = 32), got 0"),
    ({"queries": [one_query(contribution_bound=4, per_key_bound=5)]},
     "queries[0].per_key_bound: must be an integer from 1 to contribution_bound (C = 4), got 5"),
    ({"queries": [{"epsilon": 1.0, "delta": 1e-9}]}, "queries[0].name: required"),
    ({"queries": [one_query(name="page clicks")]}, "queries[0].name: required"),
    ({"queries": [one_query(epsilonn=2)]}, "queries[0].epsilonn: unknown field"),
    ({"queries": [one_query(aggregate="sum")]}, "queries[0].value_field: aggregate 'sum' needs a value_field"),
    ({"queries": [one_query(value_field="amount")]}, "queries[0].value_field: must be null for aggregate 'count'"),
    ({"queries": [one_query(aggregate="median", value_field="amount")]}, "queries[0].aggregate: must be one of count, sum, mean"),
    ({"queries": [one_query(), one_query()]}, "duplicate query names in [q q]"),
    ({"queries": []}, "the config needs at least one query"),
    ({"queries": [one_query()], "budgett": {}}, "budgett: unknown field"),
    ({"dynamic": [{"name": "d", "start": 0, "epsilon": 1.0}]}, "dynamic[0].items: required"),
    ({"dynamic": [{"name": "d", "start": 0, "items": ["a"], "epsilon": 0}]}, "dynamic[0].epsilon: must be a positive finite number"),
    ({"queries": [one_query()], "budget": {"start": "2026-01-01", "principal": "tenant", "default": {"max_epsilon": 10}}},
     "queries[0].tenant: budget.principal is 'tenant', so every query needs a tenant"),
    ({"queries": [one_query()], "budget": {"start": "2026-01-01", "principals": {"other": {"max_epsilon": 10}}}},
     "budget.principals: no budget for 'q' (queries[0]) and no budget.default"),
]


@pytest.mark.parametrize("config, message", INVALID_CONFIGS)
def test_invalid_queries_text_fails_to_render_as_the_loader_fails(config, message, tmp_path):
    from dpstream.processor.config import ConfigError

    path = tmp_path / "queries.yaml"
    path.write_text(_yaml_text(config))
    with pytest.raises(ConfigError):
        load_config(path, environ={})
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(f"queriesYaml: {message}")):
        render_files({"queriesYaml": _yaml_text(config)})


@pytest.mark.parametrize("config, message", INVALID_CONFIGS)
def test_invalid_queries_mapping_fails_to_render(config, message):
    """The same configs as values: the schema refuses what it can (types, ranges, unknown fields),
    the templates the rest, with the loader's field names."""
    values = {"queries": {"queries": None, **config}}  # null drops the chart's example query
    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmRenderError)) as caught:
        render_files(values)
    if isinstance(caught.value, helm_python.HelmRenderError):
        assert f"queries: {message}" in str(caught.value)


@pytest.mark.parametrize("config", [
    {"queries": [one_query(triggers=7)]},
    {"queries": [one_query(contribution_bound=4, per_key_bound=5)]},
    {"queries": [one_query(aggregate="sum")]},
    {"queries": [one_query(), one_query()]},
])
def test_what_the_schema_cannot_see_the_templates_refuse(config):
    """Cross-field rules pass the schema: the templates must catch them (a schema-only check would not)."""
    with pytest.raises(helm_python.HelmRenderError):
        render_files({"queries": {"queries": None, **config}})


@pytest.mark.parametrize("text", [
    "- a list, not a mapping\n",
    "queries: [\n",
])
def test_queries_text_that_is_not_a_config_fails_to_render(text):
    with pytest.raises(helm_python.HelmRenderError, match=re.escape("queriesYaml: not a YAML mapping with a 'queries' list")):
        render_files({"queriesYaml": text})


def test_the_chart_knows_the_loaders_fields():
    """The templates' field lists and the schema's query definitions follow processor/config.py."""
    import json
    import typing

    from dpstream.processor.config import (
        BudgetConfig,
        BudgetLimit,
        DpstreamConfig,
        DynamicQueryConfig,
        QueryConfig,
    )
    from dpstream.processor.mechanisms.aggregates import AGGREGATES
    from dpstream.topics.decoding import DECODERS

    helpers = (CHART / "templates" / "_helpers.tpl").read_text()

    def listed(name: str) -> list[str]:
        (body,) = re.findall(r'define "dpstream\.%s" -}}\n(.*)\n' % name, helpers)
        return body.split()

    assert listed("queryFields") == list(QueryConfig.model_fields)
    assert listed("dynamicFields") == list(DynamicQueryConfig.model_fields)
    assert listed("configFields") == list(DpstreamConfig.model_fields)
    schema = json.loads((CHART / "values.schema.json").read_text())
    defs = schema["definitions"]
    for definition, model in (("query", QueryConfig), ("dynamicQuery", DynamicQueryConfig), ("budget", BudgetConfig),
                              ("budgetLimit", BudgetLimit)):
        assert set(defs[definition]["properties"]) == set(model.model_fields), definition
        required = {n for n, f in model.model_fields.items() if f.is_required()}
        assert set(defs[definition].get("required", [])) == required, definition
    assert set(schema["properties"]["queries"]["properties"]) == set(DpstreamConfig.model_fields)
    assert defs["query"]["properties"]["aggregate"]["enum"] == list(AGGREGATES)
    assert schema["properties"]["queries"]["properties"]["input_format"]["enum"] == list(DECODERS)
    for definition, model in (("query", QueryConfig), ("dynamicQuery", DynamicQueryConfig), ("budget", BudgetConfig)):
        for name, field in model.model_fields.items():
            if typing.get_origin(field.annotation) is typing.Literal:
                assert defs[definition]["properties"][name]["enum"] == list(typing.get_args(field.annotation)), name


def test_every_environment_variable_the_chart_names_is_read_by_the_worker():
    """The env vars the chart renders and its docs name (values.yaml, helm/README.md) are ones
    the code reads (processor/cli.py and the clients): a renamed flag must not leave the chart behind."""
    code = "".join(p.read_text() for folder in ("processor", "topics") for p in (ROOT / folder).rglob("*.py"))
    read = set(re.findall(r"DPSTREAM_[A-Z_]*[A-Z]", code))
    named = set()
    for value_set in VALUE_SETS:
        for container in [worker(rendered(value_set)[1])[2]]:
            named |= {e["name"] for e in container["env"] if not e["name"].startswith("DPSTREAM_QUERY_")}
    for doc in (CHART / "values.yaml", ROOT / "helm" / "README.md"):
        text = re.sub(r"DPSTREAM_[A-Z_]*_\*", "", doc.read_text())  # a family, e.g. DPSTREAM_KAFKA_*
        named |= {n for n in re.findall(r"DPSTREAM_[A-Z_]*[A-Z]", text) if not n.startswith("DPSTREAM_QUERY_")}
    assert {"DPSTREAM_BROKER", "DPSTREAM_ASSIGNMENT", "DPSTREAM_KAFKA_SASL_PASSWORD"} <= named
    assert named - read == set()


def _helm_commands(readme: str) -> list[list[str]]:
    """The `helm install` / `helm upgrade` commands of helm/README.md's bash blocks, as argv."""
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                if argv[:2] in (["helm", "install"], ["helm", "upgrade"]):
                    commands.append(argv)
    return commands


def _values_of(argv: list[str]) -> dict:
    """What Helm makes of a command's --set, --set-string, --set-file and -f flags (enough for the
    README's commands: dotted keys, true/false, integers and {a,b} lists typed as Helm types them)."""
    values: dict = {}

    def put(key: str, value) -> None:
        *path, last = key.split(".")
        node = values
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value

    args = iter(argv[2:])
    for arg in args:
        if arg in ("--set", "--set-string", "--set-file"):
            key, value = next(args).split("=", 1)
            if arg == "--set-file":
                value = (ROOT / value).read_text()
            elif arg == "--set":
                def typed(text: str):
                    return {"true": True, "false": False}.get(text, int(text) if text.isdigit() else text)

                # {a,b}: a list, as Helm's --set reads it
                value = [typed(v) for v in value[1:-1].split(",")] if value.startswith("{") and value.endswith("}") else typed(value)
            put(key, value)
        elif arg in ("-f", "--values"):
            values.update(yaml.safe_load((ROOT / next(args)).read_text()))
    return values


def test_the_readme_helm_commands_render():
    """helm/README.md's install and upgrade commands, rendered as Helm would (no cluster here)."""
    commands = _helm_commands((ROOT / "helm" / "README.md").read_text())
    assert len(commands) >= 2 and any(c[1] == "install" for c in commands)
    for argv in commands:
        assert "helm/dpstream" in argv, argv
        docs = manifests(render_files(_values_of(argv)))
        assert only(docs, "StatefulSet")
        if "prometheusRule.enabled=true" in argv:
            assert only(docs, "PrometheusRule")["metadata"]["labels"]["release"] == "prometheus"
        if "networkPolicy.egress.kafka.ports={9093}" in argv:
            assert only(docs, "NetworkPolicy")["spec"]["egress"][0]["ports"] == [{"port": 9093, "protocol": "TCP"}]
    # a queries file given with -f is read as values, and refused: the README must not say so
    with pytest.raises(helm_python.HelmValuesError):
        render_files(_values_of(["helm", "install", "dp", "helm/dpstream", "-f", "examples/queries.yaml"]))


def test_the_schema_registry_password_comes_from_a_secret_and_the_config_names_the_registry():
    files, docs = rendered("schema-registry")
    _, _, container = worker(docs)
    env = {e["name"]: e for e in container["env"]}
    assert env["DPSTREAM_SCHEMA_REGISTRY_USER_INFO"]["valueFrom"] == {
        "secretKeyRef": {"name": "registry-credentials", "key": "user-info"}}
    config = only(docs, "ConfigMap")["data"]
    assert "registry.example.com" in "".join(config.values()) and "user-info" not in "".join(config.values())
    with pytest.raises(Exception, match="schema_registry"):
        render_files({"queries": {**yaml.safe_load(EXAMPLE_QUERIES_TEXT), "schema_registry": {"uri": "x"}}})
