"""The ``vllm.general_plugins`` entry point (``kvcert = kvcert.integrations.vllm.plugin:register``).

vLLM calls :func:`register` in every one of its processes (the API server loads it while it builds the engine
configuration, before any engine starts). Without ``KVCERT_VLLM=1`` it does nothing, so installing kvcert never
changes vLLM's behaviour. With it, the settings are validated first (a bad codec, gate or seed raises
``ValueError`` before any engine starts), then the platform is checked:

* on vLLM's **CPU** platform, ``CPU_ATTN`` (the backend the CPU platform always selects) is overridden by
  :class:`kvcert.integrations.vllm.backend.KvcertCPUBackend`;
* on any **other** platform (CUDA, ROCm, XPU, TPU, …) kvcert has no certified backend: :func:`register` raises
  :class:`UncertifiedPlatformError` (fail closed: the server does not start) unless ``--allow-uncertified``
  (``KVCERT_VLLM_ALLOW_UNCERTIFIED=1``) is given; then nothing is registered, vLLM serves with its own
  backend, and the response middleware marks every response uncertified (:func:`uncertified_reason`).
"""

from __future__ import annotations

import logging

from kvcert.integrations.vllm.settings import ALLOW_UNCERTIFIED, Settings, enabled

BACKEND = "kvcert.integrations.vllm.backend.KvcertCPUBackend"

log = logging.getLogger(__name__)


class UncertifiedPlatformError(RuntimeError):
    """vLLM runs on a platform for which kvcert has no certified attention backend."""


def _platform() -> tuple[str, bool]:
    """``(device name, is CPU)`` of vLLM's current platform (the one vLLM detected in this process)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_name), bool(current_platform.is_cpu())


def platform_reason(device: str, is_cpu: bool) -> str | None:
    """Why the plugin cannot certify reads on this platform (``None``: it can, i.e. vLLM's CPU platform)."""
    if is_cpu:
        return None
    return (
        f"vLLM platform {device!r}: kvcert's certified attention backend exists only for vLLM's CPU platform "
        "(CPU_ATTN); no GPU kernel reads kvcert's packed codes with their witnesses yet (docs/serving-vllm.md#cuda)"
    )


def uncertified_reason() -> str | None:
    """Why responses of this process's server are not certified (``None``: they are), for the middleware."""
    if not enabled():
        return "the kvcert plugin is off (KVCERT_VLLM is not 1)"
    return platform_reason(*_platform())


def register() -> None:
    """Override vLLM's CPU attention backend with kvcert's when ``KVCERT_VLLM=1``; refuse other platforms
    unless uncertified serving is allowed (see the module docstring)."""
    if not enabled():
        return
    settings = Settings.from_env()
    reason = platform_reason(*_platform())
    if reason is not None:
        if not settings.allow_uncertified:
            raise UncertifiedPlatformError(
                f"kvcert refuses to serve: {reason}. Pass --allow-uncertified ({ALLOW_UNCERTIFIED}=1) to serve "
                "with vLLM's own attention backend; every response is then marked uncertified."
            )
        log.warning("kvcert: %s; serving UNCERTIFIED with vLLM's own attention backend (--allow-uncertified)", reason)
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
