"""Peer KV caches measured beside kvcert: transformers' ``QuantizedCache`` (quanto int4 / int2, KIVI-style with a
full-precision residual window; fp8-e4m3 with one frozen per-tensor scale).

A peer decodes greedily from the same exact prefill as the kvcert branches (the prefill's K/V are written into
it layer by layer, as a prefill through it would: the first write quantizes the whole prompt), and its device
bytes are *measured* by walking the tensors it holds (:func:`held_bytes`): the quantized states (quanto's
packed data, scales and shifts, through ``__tensor_flatten__``; fp8 codes and scale) and the full-precision
residual window.
A peer has no certificate, gate or host tier.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, QuantizedCache
from transformers.cache_utils import BaseQuantizedLayer

from kvcert.eval.branching import exact_prefill, greedy_from, layer_kv

#: peer name -> (QuantizedCache backend, bits)
PEERS: dict[str, tuple[str, int]] = {"quanto-int4": ("quanto", 4), "quanto-int2": ("quanto", 2), "fp8-e4m3": ("fp8", 8)}


@dataclass(frozen=True)
class PeerSpec:
    """One peer cache: ``name`` from :data:`PEERS` and its full-precision ``residual_length`` window."""

    name: str
    residual_length: int = 128

    @property
    def label(self) -> str:
        """Report label, e.g. ``hf:quanto-int4(r=128)``, ``hf:fp8-e4m3`` (no residual window)."""
        window = "" if PEERS[self.name][0] == "fp8" else f"(r={self.residual_length})"
        return f"hf:{self.name}{window}"

    def build(self, model: PreTrainedModel) -> QuantizedCache:
        """A fresh ``QuantizedCache`` for ``model`` (``ImportError`` naming the missing backend package;
        ``ValueError`` naming the peer when transformers refuses the model, e.g. one with sliding-window layers)."""
        backend, bits = PEERS[self.name]
        if backend == "quanto" and importlib.util.find_spec("optimum.quanto") is None:
            raise ImportError(f"peer {self.name} needs optimum-quanto (pip install 'kvcert[eval]')")
        try:
            if backend == "fp8":
                return QuantizedCache(backend, model.config)
            return QuantizedCache(backend, model.config, nbits=bits, residual_length=self.residual_length)
        except ValueError as err:
            raise ValueError(
                f"peer {self.name}: transformers' QuantizedCache refuses this model ({err}); --peers '' leaves the "
                "peers out"
            ) from None


def parse_peers(text: str, residual_length: int = 128) -> list[PeerSpec]:
    """``"quanto-int4,quanto-int2"`` -> specs; ``""`` -> none. ``ValueError`` naming ``peers`` otherwise."""
    if residual_length < 1:
        raise ValueError(f"residual-length must be >= 1, got {residual_length}")
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise ValueError(f"peers: unknown {bad}; supported are {sorted(PEERS)}")
    return [PeerSpec(n, residual_length) for n in names]


def tensor_bytes(t: torch.Tensor | tuple[torch.Tensor, ...]) -> int:
    """``nbytes`` of a tensor; for a wrapper subclass (quanto's QTensor) or a tuple (fp8 codes and scale) the
    sum over its inner tensors."""
    if isinstance(t, tuple):
        return sum(tensor_bytes(x) for x in t)
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def held_bytes(cache: QuantizedCache) -> int:
    """Device bytes a ``QuantizedCache`` holds (measured): quantized states + residual window, all layers."""
    total = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values", "keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor | tuple):
                total += tensor_bytes(t)
    return total


@dataclass
class PeerResult:
    """Greedy continuation of one peer, the bytes it held at the end and its fp16 reference bytes."""

    spec: PeerSpec
    tokens: list[int]
    bytes_device: int
    bytes_fp16: int


def _tokens_seen(layer: object) -> int:
    """Tokens written into one layer of a ``QuantizedCache`` (quantized and residual alike)."""
    if not isinstance(layer, BaseQuantizedLayer):
        raise ValueError(f"a peer cache layer is a {type(layer).__name__}, not a quantized layer")
    return layer.cumulative_length


def run_peers(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    peers: Sequence[PeerSpec],
    max_new_tokens: int,
    eos_ids: Sequence[int],
) -> list[PeerResult]:
    """Prefill ``input_ids[1, T]`` once (exact), then decode each peer from that prefill."""
    prefill = exact_prefill(model, input_ids)
    pre, first = prefill.cache, prefill.first
    results = []
    for spec in peers:
        cache = spec.build(model)
        for i, layer in enumerate(pre.layers):
            keys, values = layer_kv(layer)
            cache.update(keys.clone(), values.clone(), i)
        toks = greedy_from(model, first, cache, max_new_tokens, eos_ids)
        keys0, values0 = layer_kv(pre.layers[0])
        kv = keys0.shape[1] * (keys0.shape[-1] + values0.shape[-1])
        fp16 = sum(_tokens_seen(layer) * kv * 2 for layer in cache.layers)  # batch 1, K and V at 2 bytes
        results.append(PeerResult(spec, toks, held_bytes(cache), fp16))
    return results
