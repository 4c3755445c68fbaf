"""The configuration of a :class:`~kvcert.integrations.transformers.CertifiedCache`, grouped by concern.

``CertifiedCache``'s keywords are collected into a few frozen dataclasses: :class:`StorageConfig` (codecs, witnesses,
write blocks, device budget: how each layer's store is built), :class:`GateConfig` (the gate or the ladder: which
read path serves), :class:`ValidationConfig` (certificates on or off, validate mode, the Tier-B failure budget) and
:class:`~kvcert.attention.evict_driver.EvictionConfig` (eviction policy and resident set). Each checks its own
arguments and names the one at fault.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvcert.attention.evict_driver import EvictionConfig
from kvcert.attention.ladder import LadderConfig
from kvcert.bounds import uniform_split
from kvcert.bounds.rope import Pairing
from kvcert.cache.gate import Gate
from kvcert.cache.store import DEFAULT_WITNESS, LayerStore, Witness
from kvcert.quant import Codec, resolve

__all__ = ["EvictionConfig", "GateConfig", "StorageConfig", "ValidationConfig"]


@dataclass(frozen=True)
class StorageConfig:
    """How each layer stores its K/V: codec names (or instances) and their options, band count and RoPE pairing of
    the key witness, dither ``seed``, ``write_block`` (pending tokens encode in whole blocks) and the device budget
    of persistent repairs (a fraction of the live tokens' fp16 bytes; ``None``: no cap) and the storage of the
    write-time witnesses (``"log8"`` or ``"f32"``, see ``docs/math.md#compact-witnesses``)."""

    keys: str | Codec = "int8"
    values: str | Codec = "int8"
    bands: int = 8
    pairing: Pairing = "rotate_half"
    seed: int = 0
    key_options: dict[str, Any] = field(default_factory=dict)
    value_options: dict[str, Any] = field(default_factory=dict)
    write_block: int = 16
    device_budget: float | None = 1.0
    witness: Witness = DEFAULT_WITNESS

    def store(self, layer: int) -> LayerStore:
        """A fresh store for decoder layer ``layer`` (codecs resolved per layer)."""
        return LayerStore(
            layer,
            resolve(self.keys, "key", self.key_options),
            resolve(self.values, "value", self.value_options),
            bands=self.bands,
            pairing=self.pairing,
            seed=self.seed,
            write_block=self.write_block,
            device_budget=self.device_budget,
            witness=self.witness,
        )


@dataclass(frozen=True)
class GateConfig:
    """Which read path serves: ``gate`` (the meter-gated path) or ``ladder`` (the RC tiered path with its own
    fallback rungs; the gate must then be off)."""

    gate: Gate
    ladder: LadderConfig | None = None

    @classmethod
    def of(cls, gate: Gate | None, ladder: bool | LadderConfig, validate: bool) -> GateConfig:
        """The cache's ``gate`` (default off) and ``ladder`` keywords (``True``: the default ladder)."""
        gate = gate or Gate.off()
        if not ladder:
            return cls(gate)
        if gate.mode != "off":
            raise ValueError("ladder=True has its own fallback rungs; use gate=Gate.off() with it")
        base = ladder if isinstance(ladder, LadderConfig) else LadderConfig()
        return cls(gate, dataclasses.replace(base, validate=validate))


@dataclass(frozen=True)
class ValidationConfig:
    """``certify`` (certificates on; ``False``: the uncertified baseline), ``validate`` (exact attention from the
    host tier, violations counted) and the Tier-B request failure budget ``delta_req`` split uniformly over
    ``layers · heads · max_steps`` cells (:attr:`delta_loc`)."""

    certify: bool = True
    validate: bool = False
    delta_req: float = 1e-2
    max_steps: int = 256
    delta_loc: float = 0.0

    @classmethod
    def of(
        cls, certify: bool, validate: bool, gate: Gate, delta_req: float, max_steps: int, layers: int, heads: int
    ) -> ValidationConfig:
        """The cache's keywords; an uncertified cache has neither a gate nor validate mode."""
        if not certify and (gate.mode != "off" or validate):
            raise ValueError("certify=False cannot be combined with a gate or validate=True")
        return cls(certify, validate, delta_req, max_steps, uniform_split(delta_req, layers, heads, max_steps))
