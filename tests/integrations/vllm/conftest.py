"""The vLLM plugin's tests run in the vLLM environment (``make test-vllm``, which ``make test`` calls and which
builds ``.venv-vllm`` when it is missing). In an environment without vLLM (the main ``.venv``) this folder is
not collected, unless ``KVCERT_REQUIRE_VLLM=1`` (set by ``make test-vllm``) makes a missing vLLM an error."""

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVCERT_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVCERT_REQUIRE_VLLM=1 but vllm is not importable: build .venv-vllm (make test-vllm)")
    collect_ignore_glob = ["test_*.py"]
