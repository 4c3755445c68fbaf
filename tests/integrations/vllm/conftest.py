"""The vLLM plugin's tests run in the vLLM environment (``make test-vllm``, which ``make test`` calls and which
builds ``.venv-vllm`` when it is missing). In an environment without vLLM (the main ``.venv``) this folder is
not collected, unless ``KVCERT_REQUIRE_VLLM=1`` (set by ``make test-vllm``) makes a missing vLLM an error.

vLLM uses Triton's real (compiled) mode: the interpreter that ``tests/conftest.py`` turns on for kvcert's Triton
kernel tests breaks vLLM's kernel dispatcher, so it is switched off here (these tests never run a kvcert Triton
kernel)."""

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVCERT_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVCERT_REQUIRE_VLLM=1 but vllm is not importable: build .venv-vllm (make test-vllm)")
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ["TRITON_INTERPRET"] = "0"
