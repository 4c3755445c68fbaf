import numpy as np
import pytest

from kvcert.ledger import Ledger


@pytest.fixture
def ledger() -> Ledger:
    return Ledger(delta_req=0.01, delta_e=0.01)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
