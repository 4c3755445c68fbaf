"""The ``vllm.general_plugins`` entry point (``kvcert = kvcert.integrations.vllm.plugin:register``).

vLLM calls :func:`register` in every one of its processes. Without ``KVCERT_VLLM=1`` it does nothing, so
installing kvcert never changes vLLM's behaviour. With it, the settings are validated first (a bad codec,
gate or seed raises ``ValueError`` before any engine starts) and vLLM's ``CPU_ATTN`` backend is overridden by
:class:`kvcert.integrations.vllm.backend.KvcertCPUBackend` (the CPU platform always selects ``CPU_ATTN``).
"""

from __future__ import annotations

from kvcert.integrations.vllm.settings import Settings, enabled

BACKEND = "kvcert.integrations.vllm.backend.KvcertCPUBackend"


def register() -> None:
    """Override vLLM's CPU attention backend with kvcert's when ``KVCERT_VLLM=1`` (see the module docstring)."""
    if not enabled():
        return
    Settings.from_env()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
