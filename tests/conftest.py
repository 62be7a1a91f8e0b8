import numpy as np
import pytest

from processor.noise import NodeNoise

TEST_SECRET = b"dpstream-test-secret-not-for-production"


@pytest.fixture(scope="session")
def noise() -> NodeNoise:
    return NodeNoise(TEST_SECRET)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261121)
