from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest

from dpstream.processor.mechanisms.noise import NodeNoise

#: a fixed 256-bit test key (tests only), and the hex text a secret file holds
TEST_SECRET_HEX = "6f1d9c3a5e27b48c0a9f13d6e2b75c48d19a0e6f3b2c7d85a41e96f0c3d28b57"
TEST_SECRET = bytes.fromhex(TEST_SECRET_HEX)
#: the run nonce of in-process workers (dpstream.processor.adapters.worker.DpstreamWorker) a test
#: compares with each other or with a replay: the workers of one application share one run
#: (dpstream.processor.adapters.run_identity); a worker on Kafka draws its own, which tests read
#: from its releases or its status.json
TEST_RUN_NONCE = "7e57" * 8
#: the noise label of replays a test compares with each other or with such a worker (a fresh
#: state directory would otherwise draw a random one: docs/privacy.md, "Noise"): the label of a
#: worker with the default app id, no budget section and run nonce TEST_RUN_NONCE
#: (dpstream.processor.adapters.worker.worker_noise_label)
TEST_LABEL = f"worker:dpstream:1:{TEST_RUN_NONCE}"


def without_run(record: dict) -> dict:
    """A release without the fields about the run that made it (dpstream.topics.records.RUN_FIELDS):
    what a worker and a replay under its noise label publish alike."""
    from dpstream.topics.records import RUN_FIELDS

    return {k: v for k, v in record.items() if k not in RUN_FIELDS}


@dataclass
class Record:
    """A consumed Kafka record as the worker core sees it (dpstream.processor.adapters.worker)."""

    offset: int
    key: Optional[bytes]
    value: Optional[bytes]
    timestamp: int
    timestamp_type: int = 0  # CreateTime (a producer's stamp); 1: LogAppendTime (the broker's)


@pytest.fixture(scope="session")
def noise() -> NodeNoise:
    return NodeNoise(TEST_SECRET)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261121)


# ---------------------------------------------------------------- the test broker (docs/operations.md, "A test broker")
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BROKER_PORT = int(os.environ.get("DPSTREAM_TEST_BROKER_PORT", "19092"))
#: every worker and replay the tests start keeps its sampler tables in one directory for the
#: whole run (state/noise_tables.py), not in each fresh state directory: each table is built
#: once per run instead of at every worker start (about a CPU-second each at the lattice scale).
#: The docs' procedures run without it, as pasted (tests/test_docs_blocks.py).
NOISE_TABLE_DIR = ROOT / ".pytest-noise-tables"
os.environ.setdefault("DPSTREAM_NOISE_TABLE_DIR", str(NOISE_TABLE_DIR))


def _broker_answers(address: str) -> bool:
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": address, "socket.timeout.ms": 1000}).list_topics(timeout=2)
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def broker() -> str:
    """A real Kafka-protocol broker: the one answering on the test port, else one started by the
    project's own script. Under pytest-xdist the first process to need it starts it (under a
    file lock, so only one does) and the run's controller stops it at the end
    (:func:`pytest_unconfigure`); a broker that was already running is left alone."""
    import fcntl

    address = f"127.0.0.1:{BROKER_PORT}"
    BROKER_RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(BROKER_RUN_DIR / f"test-start-{BROKER_PORT}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = False
        if not _broker_answers(address):
            proc = subprocess.run([str(ROOT / "scripts" / "broker"), "start", str(BROKER_PORT)], capture_output=True, text=True)
            if proc.returncode != 0:
                message = f"TEST BROKER COULD NOT START (scripts/broker start {BROKER_PORT}):\n{proc.stdout}{proc.stderr}"
                if os.environ.get("CI"):
                    pytest.fail(message)
                pytest.skip(message)
            started = True
            _STARTED_MARK.write_text(os.environ.get(RUN_VARIABLE, ""))
    yield address
    if started and not os.environ.get("PYTEST_XDIST_WORKER"):
        _stop_started_broker()


#: the test broker's files (scripts/broker: DPSTREAM_BROKER_DIR, else .broker in the checkout)
BROKER_RUN_DIR = Path(os.environ.get("DPSTREAM_BROKER_DIR", ROOT / ".broker"))
#: written by the process that started the test broker: the run it belongs to
_STARTED_MARK = BROKER_RUN_DIR / f"broker-{BROKER_PORT}.started-by-tests"
#: set by the run's first process (pytest_configure) and inherited by pytest-xdist's processes
RUN_VARIABLE = "DPSTREAM_TEST_RUN"


def _stop_started_broker() -> None:
    subprocess.run([str(ROOT / "scripts" / "broker"), "stop", str(BROKER_PORT)], capture_output=True)
    _STARTED_MARK.unlink(missing_ok=True)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or the one process without xdist)
        import uuid

        os.environ[RUN_VARIABLE] = uuid.uuid4().hex


def pytest_unconfigure(config):
    """The controller of an xdist run stops the test broker if one of its processes started it."""
    if hasattr(config, "workerinput") or not os.environ.get(RUN_VARIABLE):
        return
    try:
        if _STARTED_MARK.read_text() == os.environ[RUN_VARIABLE]:
            _stop_started_broker()
    except OSError:
        pass


# ---------------------------------------------------------------- the secured test broker (scripts/broker start-secure)


@dataclass
class SecureBroker:
    """An Apache Kafka broker of its own with a SASL_SSL (SCRAM-SHA-512) listener and an SSL
    listener requiring client certificates (scripts/broker start-secure; its client.json)."""

    sasl_ssl: str  # host:port of the SASL_SSL listener
    ssl: str  # host:port of the SSL listener (client certificate required)
    ca: str  # the CA (PEM) that signed the broker's and the client's certificates
    certificate: str  # the client's certificate (PEM)
    key: str  # its private key (PEM, encrypted with key_password)
    key_password: str
    username: str
    password: str
    sasl_mechanism: str
    other_ca: str  # a CA that signed nothing of this broker's

    @property
    def properties_file(self) -> str:
        """The SASL_SSL listener's settings as a Java client's properties file (SCRAM-SHA-512 in
        a sasl.jaas.config, the CA as a PEM trust store), as scripts/broker writes it."""
        return os.path.join(os.path.dirname(self.ca), "sasl_ssl.properties")

    def env(self, listener: str) -> dict[str, str]:
        """The DPSTREAM_KAFKA_* variables of a client of ``listener`` ("sasl_ssl" or "ssl")."""
        if listener == "sasl_ssl":
            return {"DPSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "DPSTREAM_KAFKA_SASL_MECHANISM": self.sasl_mechanism,
                    "DPSTREAM_KAFKA_SASL_USERNAME": self.username, "DPSTREAM_KAFKA_SASL_PASSWORD": self.password,
                    "DPSTREAM_KAFKA_SSL_CA_LOCATION": self.ca}
        return {"DPSTREAM_KAFKA_SECURITY_PROTOCOL": "SSL", "DPSTREAM_KAFKA_SSL_CA_LOCATION": self.ca,
                "DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION": self.certificate, "DPSTREAM_KAFKA_SSL_KEY_LOCATION": self.key,
                "DPSTREAM_KAFKA_SSL_KEY_PASSWORD": self.key_password}


def free_port_block(size: int) -> int:
    """A port p with p .. p + size - 1 all free (a test broker's listeners and its controller).

    Under pytest-xdist each process looks in a band of its own below Linux's ephemeral range
    (32768 and up), so two processes starting brokers at the same moment cannot pick the same
    ports, and no client's ephemeral port can take one between the check and the broker's bind."""
    import random
    import socket

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    band = int(worker[2:]) % 8 if worker.startswith("gw") and worker[2:].isdigit() else None
    for _ in range(200):
        if band is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        else:
            port = 20100 + 1500 * band + random.randrange(1500 - size)
        if port + size >= 65535:
            continue
        try:
            for q in range(port, port + size):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
            return port
        except OSError:
            continue
    raise RuntimeError("no block of free ports")


@pytest.fixture(scope="session")
def secure_broker(tmp_path_factory) -> SecureBroker:
    """A secured Apache Kafka of the session's own, started (and stopped at the end) by the
    project's script on free ports. Skips with a loud message only when it cannot start here;
    fails in CI."""
    import json

    port = free_port_block(3)  # its two listeners and its controller
    script = str(ROOT / "scripts" / "broker")
    run_dir = Path(os.environ.get("DPSTREAM_BROKER_DIR", ROOT / ".broker"))  # as scripts/broker has it
    proc = subprocess.run([script, "start-secure", str(port)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        message = f"SECURED TEST BROKER COULD NOT START (scripts/broker start-secure {port}):\n{proc.stdout}{proc.stderr}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        c = json.loads((run_dir / f"secure-{port}" / "client.json").read_text())
        other = tmp_path_factory.mktemp("other-ca")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-noenc", "-days", "2", "-subj", "/CN=another CA",
                        "-keyout", str(other / "ca.key"), "-out", str(other / "ca.pem")], check=True, capture_output=True)
        yield SecureBroker(sasl_ssl=c["sasl_ssl"], ssl=c["ssl"], ca=c["ca"], certificate=c["certificate"], key=c["key"],
                           key_password=c["key_password"], username=c["username"], password=c["password"],
                           sasl_mechanism=c["sasl_mechanism"], other_ca=str(other / "ca.pem"))
    finally:
        subprocess.run([script, "stop", str(port)], capture_output=True)
        import shutil

        # its data, certificates and passwords (the log stays, for a failure's reader)
        shutil.rmtree(run_dir / f"kafka-{port}-data", ignore_errors=True)
        shutil.rmtree(run_dir / f"secure-{port}", ignore_errors=True)
        (run_dir / f"kafka-{port}.properties").unlink(missing_ok=True)


@dataclass
class OAuthBroker:
    """An Apache Kafka of its own whose SASL_PLAINTEXT listener takes OAUTHBEARER tokens from a
    local OIDC provider (scripts/broker start-oauth; tests/oidc_provider.py)."""

    oauth: str  # host:port of the OAUTHBEARER listener
    provider: object  # tests.oidc_provider.OidcProvider

    def properties(self, client_secret: str | None = None) -> str:
        """A Java client's properties file for the listener (client id and secret in a
        sasl.jaas.config), as Kafka's own tools and DPSTREAM_KAFKA_PROPERTIES_FILE take it."""
        secret = self.provider.client_secret if client_secret is None else client_secret
        return ("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=OAUTHBEARER\n"
                "sasl.login.callback.handler.class=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginCallbackHandler\n"
                f"sasl.oauthbearer.token.endpoint.url={self.provider.token_url}\n"
                "sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required "
                f'clientId="{self.provider.client_id}" clientSecret="{secret}" scope="kafka";\n')


@pytest.fixture(scope="session")
def oauth_broker() -> OAuthBroker:
    """scripts/broker start-oauth on free ports, its keys and tokens from a provider of the
    session's own. Skips loudly only when it cannot start here; fails in CI."""
    from tests.oidc_provider import OidcProvider

    provider = OidcProvider()
    port = free_port_block(3)
    script = str(ROOT / "scripts" / "broker")
    proc = subprocess.run([script, "start-oauth", str(port), provider.jwks_url], capture_output=True, text=True, timeout=600)
    try:
        if proc.returncode != 0:
            message = f"OAUTHBEARER TEST BROKER COULD NOT START (scripts/broker start-oauth {port}):\n{proc.stdout}{proc.stderr}"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        yield OAuthBroker(oauth=f"127.0.0.1:{port + 2}", provider=provider)
    finally:
        subprocess.run([script, "stop", str(port)], capture_output=True)
        import shutil

        run_dir = Path(os.environ.get("DPSTREAM_BROKER_DIR", ROOT / ".broker"))
        shutil.rmtree(run_dir / f"kafka-{port}-data", ignore_errors=True)
        (run_dir / f"kafka-{port}.properties").unlink(missing_ok=True)
        provider.close()


# ---------------------------------------------------------------- markers (pyproject.toml: broker, slow, statistical)
#: many-sample checks of noise distributions and calibration, tolerances stated in each test
STATISTICAL = (
    "tests/test_honaker_statistics.py::test_prefix_noise_is_unbiased_with_eq2_variance",
    "tests/test_honaker_statistics.py::test_honaker_node_estimates_have_eq1_variance",
    "tests/test_honaker_statistics.py::test_disjoint_decomposition_nodes_are_uncorrelated",
    "tests/test_key_selection.py::test_false_release_rate_round0_without_gate",
    "tests/test_key_selection.py::test_false_release_rate_after_a_release",
    "tests/test_key_selection.py::test_subgaussian_single_leaf_tail_is_exact",
    "tests/test_key_selection.py::test_subgaussian_tail_bound_holds_for_the_integer_noise",
    "tests/test_noise.py::test_samples_follow_the_pmf_chi_square",
    "tests/test_noise.py::test_empirical_variance_matches",
    "tests/test_perturbation.py::test_releases_unbiased_with_prefix_variance",
    "tests/test_dynamic.py::test_discrete_laplace_sampler_moments_and_pmf",
    "tests/privacy/test_exact_laplace.py::test_distribution_matches_the_exact_pmf",
    "tests/test_aggregates.py::test_count_column_noise_matches_its_declared_stddev",
    "tests/test_counters.py::test_declared_step_variance_matches_the_noise",
)
#: tests over about 5 s on the 2-core CI machine (measured with --durations; the broker tests
#: are all slow too: 23-72 s each)
SLOW = (
    "tests/test_kafka_worker.py",
    "tests/test_kafka_security.py",
    "tests/test_client_properties.py::test_one_properties_file_serves_kafkas_console_producer_and_an_elastic_worker",
    "tests/test_client_properties.py::test_over_oauthbearer_the_console_producer_and_a_worker_share_one_properties_file",
    "tests/test_elastic_workers.py",
    "tests/test_kafka_chaos.py",
    "tests/test_status_page.py::test_status_page_in_a_browser_trigger_log_lines_and_committed_offsets",
    "tests/test_helm_chart.py::test_dashboard_and_alert_metrics_are_served_by_a_running_worker",
    "tests/test_dynamic.py::test_partitioner_matches_algorithm_2_and_respects_horizons",
    "tests/privacy/test_replay_clock.py::test_property_chunking_and_resume_do_not_change_anything",
    "tests/privacy/test_arrival_order.py::test_releases_do_not_depend_on_arrival_order",
    "tests/privacy/test_arrival_order.py::test_one_user_moves_perturbation_trees_by_at_most_c_times_l",
    "tests/privacy/test_arrival_order.py::test_hierarchy_levels_get_each_admitted_record_once",
    "tests/privacy/test_dynamic_ticks.py::test_property_releases_up_to_t_do_not_depend_on_updates_after_t",
    "tests/privacy/test_budget_schedule.py::test_property_one_users_records_never_change_refusals_spend_or_other_keys",
    "tests/test_change_streams.py::test_a_worker_on_a_debezium_topic_killed_mid_stream_releases_what_replay_does",
    "tests/test_change_streams.py::test_workers_on_a_partitioned_debezium_topic_one_killed_mid_stream_release_what_replay_does",
    "tests/test_dynamic_partitions.py::test_releases_under_any_partitioning_and_interleaving_are_one_partitions",
    "tests/test_dynamic_unit_partitions.py::test_releases_with_a_unit_bound_are_one_partitions_in_tick_partition_offset_order",
    "tests/test_dynamic_unit_partitions.py::test_removing_a_unit_changes_the_shards_inputs_by_at_most_c_of_its_own_updates",
)


#: fixtures that start or need an Apache Kafka broker
BROKER_FIXTURES = ("broker", "secure_broker", "oauth_broker", "chaos_kafka", "own_broker")


#: tests that run one after another in one process under pytest-xdist (scripts/test: -n 6
#: --dist loadgroup, with :func:`pytest_xdist_make_scheduler`), by group; a key is a file or the
#: start of a test's node id, and the longest that matches wins:
#: * the broker fault trials of tests/test_kafka_chaos.py, which SIGKILL and blackhole their own
#:   broker and time what workers do meanwhile: one outage at a time per chaos broker, in two
#:   chains of about 300 s each (one chain of 600 to 700 s was the suite's critical path at 6
#:   processes), each on its process's own chaos broker;
#: * its start races (workers started together, concurrent topic creators), which fault no
#:   broker (the proxy only sends their CreateTopics requests together): a chain of their own,
#:   beside it, on a chaos broker of their process's own, so that the fault trials' chain is not
#:   the suite's critical path;
#: * the tests of the secured and the OAUTHBEARER brokers: session fixtures that start a broker
#:   of their own, so each starts once.
#: The outage tests (a broker of their own each), the kill loop (the shared broker) and the docs'
#: procedures (each on a broker of its own, in a network namespace of its own where the machine
#: allows it: tests/test_docs_blocks.py) run beside them like any other test.
SERIAL_GROUPS = {
    "tests/test_kafka_chaos.py": "broker-faults",
    # the second chain of fault trials, on a chaos broker of its own (about 300 s each chain)
    "tests/test_kafka_chaos.py::test_a_broker_sigkill_and_restart_20_s_later_stops_no_worker[static]": "broker-faults-2",
    "tests/test_kafka_chaos.py::test_a_20_s_blackhole_is_ridden_out": "broker-faults-2",
    "tests/test_kafka_chaos.py::test_a_blackhole_past_the_broker_timeout_waits_at_10_s_exits_at_the_timeout_and_resumes[group]":
        "broker-faults-2",
    "tests/test_kafka_chaos.py::test_harness_a_sigkilled_broker": "broker-faults-2",
    "tests/test_kafka_chaos.py::test_workers_started_together_on_a_new_app_id_all_become_ready": "start-races",
    "tests/test_kafka_chaos.py::test_topics_are_there_for_every_client_once_create_topics_returns": "start-races",
    "tests/test_kafka_security.py": "own-brokers", "tests/test_client_properties.py": "own-brokers",
}

def serial_group(nodeid: str) -> str | None:
    """The group of :data:`SERIAL_GROUPS` a test belongs to, if any."""
    matches = [key for key in SERIAL_GROUPS if nodeid == key or nodeid.startswith(key if "::" in key else key + "::")]
    return SERIAL_GROUPS[max(matches, key=len)] if matches else None


def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadgroup``: xdist's scheduling by scope, each test its own scope except the
    groups of :data:`SERIAL_GROUPS`, one scope each. (xdist's own ``xdist_group`` marker renames
    a test's node id, which pytest 9 no longer reads back: its groups are ignored.) Scopes go out
    largest first, then one test at a time to whichever process is nearly idle."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return serial_group(nodeid) or nodeid

    return FileGroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Markers from what a test uses, so a new test cannot forget them: ``broker`` for any test
    using a broker fixture (the shared one, the secured and OAUTHBEARER ones, the chaos and outage
    trials' own); ``statistical`` and ``slow`` from the lists above.

    Parallel runs (scripts/test runs pytest-xdist): the slow tests come first (in their files'
    order), so the long ones start at once and the short ones fill the processes at the end,
    instead of one long test starting last."""
    for item in items:
        base = item.nodeid.split("[")[0]
        names = set(getattr(item, "fixturenames", ()))
        if set(BROKER_FIXTURES) & names:
            item.add_marker(pytest.mark.broker)
        if base in STATISTICAL:
            item.add_marker(pytest.mark.statistical)
        if base in SLOW or item.nodeid.split("::")[0] in SLOW:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, item.get_closest_marker("broker") is None))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say which broker the broker tests ran against (scripts/broker: Apache Kafka, or Tansu as
    a fallback), also under -q."""
    kind = ROOT / ".broker" / f"broker-{BROKER_PORT}.kind"
    name = kind.read_text().strip() if kind.exists() else "none started by scripts/broker (or already stopped)"
    terminalreporter.write_line(f"test broker on 127.0.0.1:{BROKER_PORT}: {name}")
