"""Branch several KV schemes from one shared exact prefill and decode each greedily.

The prefill is computed once with an exact ``DynamicCache``; every scheme's cache then ingests those
exact K/V (as a serving engine would write them after prefill) and decodes greedily through its own
compressed cache. This makes a scheme-by-scheme comparison paired on identical prompts and cheap on a
CPU: the prefill dominates the cost of a long-context sample.

A scheme with a resident set selects it from the prefill's real attention, as a cache that ran the prefill itself
would: the same prefill forward records what the schemes' policies read of it
(:func:`~kvcert.attention.evict_driver.ingest_reads`, e.g. SnapKV's window rows, H2O's column sums;
:mod:`kvcert.eval.attention_record`) and every resident scheme ingests it. Without a resident scheme whose policy
reads attention, nothing is recorded and the prefill is the plain one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import reduce

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvcert.attention.evict_driver import EvictionConfig, default_select, ingest_reads
from kvcert.cache.gate import Gate
from kvcert.cache.store import DEFAULT_WITNESS, Witness
from kvcert.cache.telemetry import Telemetry
from kvcert.eval.attention_record import recorded_attention
from kvcert.evict import EvictionPolicy, PrefillAttention, PrefillReads
from kvcert.integrations.cache_config import StorageConfig
from kvcert.integrations.transformers import CertifiedCache
from kvcert.quant.bit_allocation import Allocation
from kvcert.quant.dither import DitherCodec
from kvcert.quant.per_head import PerHeadCodec


@dataclass(frozen=True)
class Scheme:
    """A KV configuration to evaluate: ``keys=None`` means the uncompressed dense baseline."""

    name: str
    keys: str | None = None
    values: str | None = None
    gate: Gate = field(default_factory=Gate.off)
    validate: bool = False
    key_options: tuple[tuple[str, object], ...] = ()
    resident: float | None = None  # resident set fraction (``EvictionConfig.resident_set(resident)``)
    select: Callable[[], EvictionPolicy] | None = None  # builds the resident set's policy, one per request
    summary: str = "int8"  # storage form of the omitted pages' summaries (``resident_set(summary=)``)
    recall: str = "persistent"  # recalled pages kept within the budget, paged in per read or swapped in (``recall=``)
    reselect: int | None = None  # re-select the resident set every N decode steps (``resident_set(reselect=)``)
    resident_alloc: str | None = None  # split of the resident set across layers (``resident_set(resident_alloc=)``)
    witness: Witness = DEFAULT_WITNESS  # storage of the write-time witnesses (``StorageConfig(witness=)``)
    device_budget: float | None = 1.0  # ``StorageConfig(device_budget=)`` (its default: never above fp16)
    allocation: Allocation | None = None  # per-(layer, KV head) key widths and value codecs (replace keys/values)
    exact_sinks: int = 0  # the first positions kept exact (``StorageConfig(exact_sinks=)``)
    upgrade: tuple[str, str] | None = None  # persistent repairs re-encode in these (``StorageConfig(upgrade_keys=)``)
    heavy_share: float | None = None  # token tiers: this share of the prompt in the upgrade codecs (``heavy_share=``)
    heavy_values: tuple[str, float] | None = None  # token tiers' heavy values: (codec, share) (``heavy_values=``)
    bands: int = 8  # key-witness bands of whole RoPE pairs (``StorageConfig(bands=)``)
    write_block: int = 16  # pending tokens are encoded in blocks of this many (``StorageConfig(write_block=)``)

    @property
    def is_dense(self) -> bool:
        """True for the uncompressed baseline."""
        return self.keys is None

    def storage(self) -> StorageConfig:
        """The cache's storage (values default to the keys' codec; an allocation gives both, per layer)."""
        assert self.keys is not None
        keys: str | tuple[DitherCodec, ...] = self.keys
        values: str | tuple[str | PerHeadCodec, ...] = self.values or self.keys
        if self.allocation is not None:
            keys, values = self.allocation.key_codecs(), self.allocation.value_codecs()
        return StorageConfig(
            keys,
            values,
            key_options=dict(self.key_options),
            device_budget=self.device_budget,
            witness=self.witness,
            exact_sinks=self.exact_sinks,
            upgrade_keys=None if self.upgrade is None else self.upgrade[0],
            upgrade_values=None if self.upgrade is None else self.upgrade[1],
            heavy_share=self.heavy_share,
            heavy_values=None if self.heavy_values is None else self.heavy_values[0],
            heavy_value_share=None if self.heavy_values is None else self.heavy_values[1],
            bands=self.bands,
            write_block=self.write_block,
        )

    def eviction(self) -> EvictionConfig | None:
        """The cache's resident set (a fresh ``select`` policy per request; ``None`` without a resident set)."""
        if self.resident is None:
            return None
        return EvictionConfig.resident_set(
            self.resident,
            select=None if self.select is None else self.select(),
            summary=self.summary,
            recall=self.recall,
            reselect=self.reselect,
            resident_alloc=self.resident_alloc or "uniform",
        )

    def cache(self, model: PreTrainedModel, seed: int = 0) -> CertifiedCache:
        """A fresh :class:`CertifiedCache` of this (non-dense) scheme on ``model``: its gate, validate mode, storage and
        resident set, the dither keyed by ``seed``."""
        return CertifiedCache(
            model,
            gate=self.gate,
            validate=self.validate,
            seed=seed,
            storage=self.storage(),
            eviction=self.eviction(),
        )

    @property
    def prefill_reads(self) -> PrefillReads:
        """What this scheme's cache reads of a recorded prefill attention: :func:`ingest_reads` of its resident set's
        policy, and the attention rows its token tiers are chosen from (the default select policy's); nothing
        without either."""
        reads = PrefillReads()
        if self.heavy_share is not None:
            reads = default_select().prefill_reads
        if self.resident is None:
            return reads
        return reads | ingest_reads(default_select() if self.select is None else self.select())


@dataclass
class Prefill:
    """An exact prefill: its cache, the logits it kept and, when recorded, what was read of each layer's attention."""

    cache: DynamicCache
    logits: torch.Tensor  # [1, logits_to_keep (or T), vocab]
    attentions: list[PrefillAttention] | None

    @property
    def first(self) -> torch.Tensor:
        """The greedy first token ``[1, 1]`` (from the last position's logits)."""
        return self.logits[:, -1:].argmax(-1)


@dataclass
class BranchResult:
    """Greedy continuation of one scheme and, for kvcert schemes, its telemetry."""

    scheme: Scheme
    tokens: list[int]
    telemetry: Telemetry | None


def layer_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``[B, Hkv, n, D]`` one layer of a transformers cache holds (``DynamicLayer`` and its
    subclasses: sliding-window and quantized layers); ``ValueError`` naming the layer's type for a layer that
    holds none (a linear-attention or dummy layer, or one never written)."""
    if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
        raise ValueError(f"a {type(layer).__name__} cache layer holds no keys and values")
    return layer.keys, layer.values


def copy_cache(
    model: PreTrainedModel,
    src: DynamicCache,
    transform: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> DynamicCache:
    """A copy of ``src`` (each layer's keys and values cloned, a sliding-window layer's count of tokens seen kept);
    with ``transform``, layer ``i`` holds ``transform(i, keys, values)`` of its clones instead (same shapes), e.g. the
    entries a codec would serve."""
    out = DynamicCache(config=model.config)
    for i, layer in enumerate(src.layers):
        keys, values = (t.clone() for t in layer_kv(layer))
        if transform is not None:
            keys, values = transform(i, keys, values)
        out.update(keys, values, i)
    for dst, s in zip(out.layers, src.layers, strict=True):
        if isinstance(s, DynamicSlidingWindowLayer) and isinstance(dst, DynamicSlidingWindowLayer):
            dst.cumulative_length = s.cumulative_length  # tokens seen, beyond the window it keeps
    return out


def greedy_from(
    model: PreTrainedModel, first: torch.Tensor, cache: object, max_new_tokens: int, eos_ids: Sequence[int]
) -> list[int]:
    """Greedy decode starting from token ``first[1, 1]`` through ``cache`` until EOS or the token budget."""
    toks: list[int] = []
    nxt = first
    with torch.no_grad():
        for _ in range(max_new_tokens):
            t = int(nxt.item())
            if t in eos_ids:
                break
            toks.append(t)
            if len(toks) == max_new_tokens:
                break
            out = model(nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
    return toks


def exact_prefill(
    model: PreTrainedModel, input_ids: torch.Tensor, reads: PrefillReads | None = None, logits_to_keep: int = 1
) -> Prefill:
    """Prefill ``input_ids[1, T]`` into an exact ``DynamicCache``, recording ``reads`` of every layer's attention in
    the same forward (:func:`~kvcert.eval.attention_record.recorded_attention`; ``None`` or a read of nothing: no
    recording, the model's plain forward, ``attentions`` is ``None``).

    By default only the last position's logits are computed (``logits_to_keep=1``): the first token needs no other,
    and the full ``[T, vocab]`` logits would dominate the prefill of a large-vocabulary model (Gemma-3: 262k
    entries, 2 GB of float32 logits at T = 2048); ``logits_to_keep=0`` keeps every position's.
    """
    if input_ids.shape[0] != 1:
        raise ValueError("branches take one prompt at a time (batch 1)")
    pre = DynamicCache(config=model.config)
    with torch.no_grad():
        if reads is None or not reads.anything:
            out = model(input_ids, cache=pre, use_cache=True, logits_to_keep=logits_to_keep)
            return Prefill(pre, out.logits, None)
        with recorded_attention(model, reads) as recorded:
            out = model(input_ids, cache=pre, use_cache=True, logits_to_keep=logits_to_keep)
    return Prefill(pre, out.logits, [recorded[i] for i in range(len(pre.layers))])


def run_branches(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    schemes: Sequence[Scheme],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    seed: int = 0,
) -> list[BranchResult]:
    """Prefill ``input_ids[1, T]`` once (exact), recording what the resident schemes read of its attention (module
    doc), then decode each scheme from that prefill."""
    reads = reduce(PrefillReads.__or__, (s.prefill_reads for s in schemes), PrefillReads())
    prefill = exact_prefill(model, input_ids, reads)
    pre, first = prefill.cache, prefill.first
    results = []
    for scheme in schemes:
        if scheme.keys is None:  # the dense baseline (Scheme.is_dense)
            toks = greedy_from(model, first, copy_cache(model, pre), max_new_tokens, eos_ids)
            results.append(BranchResult(scheme, toks, None))
            continue
        cache = scheme.cache(model, seed)
        try:
            cache.ingest(pre, prefill.attentions if scheme.prefill_reads.anything else None)
            toks = greedy_from(model, first, cache, max_new_tokens, eos_ids)
        finally:
            cache.detach()
        results.append(BranchResult(scheme, toks, cache.telemetry()))
    return results
