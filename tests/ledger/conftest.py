import sys
from pathlib import Path

import numpy as np
import pytest

# helpers (ledger_workload.py, crash_child.py) live next to the tests; importable in any import mode
sys.path.insert(0, str(Path(__file__).parent))

from kvcert.ledger import Ledger


@pytest.fixture
def ledger() -> Ledger:
    return Ledger(delta_req=0.01, delta_e=0.01)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
