"""The Helm chart (helm/dpstream), checked without a cluster or a helm binary (docs/operations.md, "Checking the Helm chart").

The chart is rendered with helm-python-sdk (the Helm SDK in-process; output identical to
`helm template`), each manifest is validated against the bundled Kubernetes schemas with
kubernetes-validate in strict mode, the rendered output and values.yaml are linted with yamllint,
and the chart passes `helm lint --strict`. The ConfigMap's queries.yaml must load with the
project's own config loader. The Dockerfile is checked statically (no Docker engine here).
"""
from __future__ import annotations

import base64
import copy
import re
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "dpstream"
YAMLLINT_CONFIG = ROOT / "helm" / ".yamllint.yaml"
RELEASE, NAMESPACE = "dp", "stream"
FULLNAME = "dp-dpstream"
# The chart needs Kubernetes >= 1.28 (the apps.kubernetes.io/pod-index label); validate the
# oldest supported version, a common one and the newest that kubernetes-validate bundles.
KUBE_VERSIONS = ("1.28.0", "1.30.0", "1.37.0")
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}  # no bundled schema: checked by hand below

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
        "tls": {"existingSecret": "kafka-ca", "caKey": "ca.pem"},
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
VALUE_SETS = {"default": {}, "custom": CUSTOM, "create-secret": CREATE_SECRET, "queries-text": AS_STRING,
              "queries-mapping": AS_MAPPING, "dynamic-only": DYNAMIC_ONLY}


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
                "DPSTREAM_KAFKA_SSL_CA_LOCATION"} & env.keys()

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


@pytest.mark.parametrize("value_set", ["default", "custom", "create-secret"])
def test_helm_lint_strict(value_set):
    report = helm_python.lint(str(CHART), copy.deepcopy(VALUE_SETS[value_set]), strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


FREE_FORM = ("queries", "resources", "podSecurityContext", "securityContext")  # documented as a whole


def undocumented_values(text: str) -> list[str]:
    """Keys of values.yaml with no comment on the line above or on their own line. Groups
    (non-empty mappings) need none; the contents of free-form values are documented as a whole."""
    lines = text.splitlines()
    missing = []

    def walk(node, path):
        for key, value in node.value:
            key_path = path + (key.value,)
            free_form = key_path[0] in FREE_FORM
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
