from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest

from processor.mechanisms.noise import NodeNoise

#: a fixed 256-bit test key (tests only), and the hex text a secret file holds
TEST_SECRET_HEX = "6f1d9c3a5e27b48c0a9f13d6e2b75c48d19a0e6f3b2c7d85a41e96f0c3d28b57"
TEST_SECRET = bytes.fromhex(TEST_SECRET_HEX)
#: the noise label of replays a test compares with each other or with a worker (a fresh state
#: directory would otherwise draw a random one: docs/privacy.md, "Noise"): the label of a worker
#: with the default app id and no budget section (processor.adapters.worker.worker_noise_label)
TEST_LABEL = "worker:dpstream:1"


@dataclass
class Record:
    """A consumed Kafka record as the worker core sees it (processor.adapters.worker)."""

    offset: int
    key: Optional[bytes]
    value: Optional[bytes]
    timestamp: int


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
