from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest

from dpstream.processor.mechanisms.noise import NodeNoise

#: a fixed 256-bit test key (tests only), and the hex text a secret file holds
TEST_SECRET_HEX = "6f1d9c3a5e27b48c0a9f13d6e2b75c48d19a0e6f3b2c7d85a41e96f0c3d28b57"
TEST_SECRET = bytes.fromhex(TEST_SECRET_HEX)
#: the noise label of replays a test compares with each other or with a worker (a fresh state
#: directory would otherwise draw a random one: docs/privacy.md, "Noise"): the label of a worker
#: with the default app id and no budget section (dpstream.processor.adapters.worker.worker_noise_label)
TEST_LABEL = "worker:dpstream:1"


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


def _broker_answers(address: str) -> bool:
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": address, "socket.timeout.ms": 1000}).list_topics(timeout=2)
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def broker() -> str:
    """A real Kafka-protocol broker: the one answering on the test port, else Tansu started by
    the project's own script (and stopped by it at the end)."""
    address = f"127.0.0.1:{BROKER_PORT}"
    started = False
    if not _broker_answers(address):
        proc = subprocess.run([str(ROOT / "scripts" / "broker"), "start", str(BROKER_PORT)], capture_output=True, text=True)
        if proc.returncode != 0:
            message = f"TEST BROKER COULD NOT START (scripts/broker start {BROKER_PORT}):\n{proc.stdout}{proc.stderr}"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        started = True
    yield address
    if started:
        subprocess.run([str(ROOT / "scripts" / "broker"), "stop", str(BROKER_PORT)], capture_output=True)


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
)


def pytest_collection_modifyitems(config, items):
    """Markers from what a test uses, so a new test cannot forget them: ``broker`` for any test
    using the broker fixture; ``statistical`` and ``slow`` from the lists above."""
    for item in items:
        base = item.nodeid.split("[")[0]
        if "broker" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.broker)
        if base in STATISTICAL:
            item.add_marker(pytest.mark.statistical)
        if base in SLOW or item.nodeid.split("::")[0] in SLOW:
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say which broker the broker tests ran against (scripts/broker: Apache Kafka, or Tansu as
    a fallback), also under -q."""
    kind = ROOT / ".broker" / f"broker-{BROKER_PORT}.kind"
    name = kind.read_text().strip() if kind.exists() else "none started by scripts/broker (or already stopped)"
    terminalreporter.write_line(f"test broker on 127.0.0.1:{BROKER_PORT}: {name}")
