"""vLLM CPU attention backend that serves every decode read through kvcert's certified read path.

Imported only inside vLLM processes (the plugin registers the class path; see
:mod:`kvcert.integrations.vllm.plugin`). :class:`KvcertCPUBackend` is vLLM's ``CPUAttentionBackend`` with
:class:`KvcertCPUImpl` as its implementation: ``forward`` first runs vLLM's own CPU kernel (so prefill rows
and vLLM's paged cache behave exactly as without the plugin), then hands the flat batch to the process's
:class:`~kvcert.integrations.vllm.runtime.Runtime`, which stores each sequence's K/V in kvcert's tiered store
and overwrites the decode rows' output with the certified read.

Request identity: vLLM's attention metadata carries no request ids, so the plugin wraps the CPU model runner's
``execute_model`` (once per process) to hand the runtime the step's row order (``input_batch.req_ids``) and the
requests vLLM finished. Forward calls outside ``execute_model`` (profiling and warm-up runs) have no identity
and pass vLLM's output through untouched.

What is *not* reduced yet: vLLM's paged ``kv_cache`` tensor is allocated and written by vLLM as before (full
precision), so vLLM's KV memory accounting is unchanged; kvcert's compressed tier lives beside it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from kvcert.integrations.vllm.runtime import Runtime
from kvcert.integrations.vllm.settings import SUPPORTED_MODEL_TYPES, Settings

_RUNTIME: Runtime | None = None


def runtime() -> Runtime | None:
    """This process's runtime (``None`` until the first kvcert attention layer is built)."""
    return _RUNTIME


def _ensure_runtime() -> Runtime:
    global _RUNTIME
    if _RUNTIME is None:
        cfg = get_current_vllm_config().model_config
        text = cfg.hf_text_config
        _RUNTIME = Runtime(Settings.from_env(), int(text.num_hidden_layers), int(text.num_attention_heads))
        _wrap_runner()
    return _RUNTIME


def _wrap_runner() -> None:
    """Wrap ``CPUModelRunner.execute_model`` once: tell the runtime each step's rows and finished requests."""
    original = CPUModelRunner.execute_model
    if getattr(original, "_kvcert", False):
        return

    @functools.wraps(original)
    def execute_model(self: CPUModelRunner, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        rt = _RUNTIME
        if rt is None:
            return original(self, scheduler_output, *args, **kwargs)
        batch = self.input_batch  # read when the first layer runs: execute_model orders the batch first
        rt.begin_step(lambda: list(batch.req_ids[: batch.num_reqs]), scheduler_output.finished_req_ids)
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            rt.end_step()

    execute_model._kvcert = True  # type: ignore[attr-defined]
    CPUModelRunner.execute_model = execute_model  # type: ignore[method-assign]


def check_supported(model_type: str, impl: CPUAttentionBackendImpl, dtype: torch.dtype) -> str | None:
    """Why this layer cannot be certified (``None``: it can). The read path certifies causal softmax attention
    with ``rotate_half`` RoPE keys, no sliding window, soft-capping, ALiBi or attention sinks, and an
    unquantized ("auto") vLLM KV cache in float32 / float16 / bfloat16."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} (certified: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if impl.attn_type != AttentionType.DECODER:
        return f"attention type {impl.attn_type!r} (only decoder self-attention)"
    if impl.sliding_window != -1:
        return f"sliding window {impl.sliding_window}"
    if impl.logits_soft_cap:
        return f"logit soft-capping {impl.logits_soft_cap}"
    if impl.alibi_slopes is not None or impl.sinks is not None:
        return "ALiBi slopes or attention sinks"
    if impl.kv_cache_dtype != "auto":
        return f"vLLM KV cache dtype {impl.kv_cache_dtype!r} (kvcert compresses; keep vLLM's cache at 'auto')"
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"model dtype {dtype}"
    return None


class KvcertCPUImpl(CPUAttentionBackendImpl):
    """``CPUAttentionBackendImpl`` whose decode reads are served by kvcert (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        vcfg = get_current_vllm_config()
        settings = Settings.from_env()
        reason = check_supported(vcfg.model_config.hf_text_config.model_type, self, vcfg.model_config.dtype)
        if reason is None and vcfg.cache_config.enable_prefix_caching:
            reason = "prefix caching (its cached blocks never pass through kvcert's store; --no-enable-prefix-caching)"
        self.kvcert = reason is None
        if reason is not None and not settings.allow_uncertified:
            raise ValueError(
                f"kvcert cannot certify this layer: {reason}. Refusing to serve it uncertified; pass "
                "--allow-uncertified (KVCERT_VLLM_ALLOW_UNCERTIFIED=1) to serve it with vLLM's own attention."
            )
        if self.kvcert:
            _ensure_runtime()

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM's own forward, then the certified read of every decode row (see the module docstring)."""
        out = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
        )
        rt = _RUNTIME
        if not self.kvcert or attn_metadata is None or rt is None or not rt.active:
            return out
        rows = rt.rows()
        if rows is None:  # profiling / warm-up forward: no request identity, nothing to store
            return out
        t = attn_metadata.num_actual_tokens
        qsl = attn_metadata.query_start_loc.tolist()[: len(rows) + 1]
        rt.forward_layer(
            extract_layer_index(layer.layer_name),
            self.scale,
            query[:t].view(t, self.num_heads, -1),
            key[:t].view(t, self.num_kv_heads, -1),
            value[:t].view(t, self.num_kv_heads, -1),
            qsl,
            attn_metadata.seq_lens.tolist(),
            output[:t].view(t, self.num_heads, -1),
        )
        return out


class KvcertCPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with :class:`KvcertCPUImpl` (registered over ``CPU_ATTN``)."""

    @staticmethod
    def get_impl_cls() -> type[KvcertCPUImpl]:
        """The kvcert implementation."""
        return KvcertCPUImpl
