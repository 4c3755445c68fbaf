"""The configuration of a :class:`~kvcert.integrations.transformers.CertifiedCache`, grouped by concern.

``CertifiedCache(model, keys, values, gate=..., validate=...)`` takes the knobs almost every user sets flat; the rare
ones travel in frozen dataclasses: :class:`StorageConfig` (``storage=``: codecs and their options, witnesses, write
blocks, device budget: how each layer's store is built), :class:`ValidationConfig` (``validation=``: certificates on
or off, the Tier-B failure budget) and :class:`~kvcert.attention.evict_driver.EvictionConfig` (``eviction=``: an
eviction policy or a resident set). :class:`GateConfig` is the cache's own grouping of its ``gate`` and ``ladder``
keywords (which read path serves). Each checks its own arguments and names the one at fault.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvcert.attention.evict_driver import EvictionConfig, default_select
from kvcert.attention.ladder import LadderConfig
from kvcert.attention.tier_choice import check_heavy_share
from kvcert.bounds import uniform_split
from kvcert.bounds.rope import Pairing
from kvcert.cache.gate import Gate
from kvcert.cache.store import DEFAULT_WITNESS, LayerStore, Witness
from kvcert.evict import EvictionPolicy
from kvcert.quant import Codec, resolve

__all__ = ["EvictionConfig", "GateConfig", "StorageConfig", "ValidationConfig", "expect", "resolve_storage"]

T = TypeVar("T")


def expect(value: Any, kind: type[T], name: str) -> T | None:
    """``value`` if it is ``None`` or a ``kind``; ``TypeError`` naming the keyword otherwise."""
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} must be a kvcert.{kind.__name__}, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class StorageConfig:
    """How each layer stores its K/V: codec names (or instances; or a tuple of them, entry ``l`` for decoder layer
    ``l``, e.g. :meth:`~kvcert.quant.Allocation.key_codecs`) and their options (``key_options`` /
    ``value_options``, e.g. ``{"bypass": 4}``), band count and RoPE pairing of the key witness, dither ``seed``
    (``None``: the cache draws one at random, so dither is never reused across caches), ``write_block`` (pending
    tokens encode in whole blocks of this many tokens, exact until then), the device budget of persistent repairs
    and recalled pages (a fraction of the live tokens' fp16 K/V bytes, default ``1.0``: never more than fp16;
    ``None``: no cap; see ``docs/architecture.md``), the storage of the write-time witnesses (``"log8"``: 8-bit
    codes that decode to values never below the true ones, or ``"f32"``; see ``docs/math.md#compact-witnesses``)
    and ``exact_sinks``: the tokens at the first ``exact_sinks`` logical positions (attention sinks) are stored
    exact, with zero residual and radius, and their bytes count as device bytes (default 0;
    ``docs/read-path.md#exact-sinks``). ``upgrade_keys`` / ``upgrade_values`` (both or neither; options as
    ``key_options`` / ``value_options``): a persistent repair re-encodes the repaired entries in these wider codecs
    instead of holding them exact, within the device budget (``docs/read-path.md#upgrade-repair``). ``heavy_share``
    (needs the upgrade codecs): token tiers, the share of each (layer, KV head)'s prompt tokens its prefill attention
    singles out (ranked by ``heavy_select``, default :func:`~kvcert.attention.evict_driver.default_select`) is stored
    in the upgrade codecs *instead of* the light ones (``docs/read-path.md#token-tiers``); ``heavy_values`` (a
    per-token codec, default the upgrade value codec) and ``heavy_value_share`` (default ``heavy_share``) give the
    heavy values a codec and a share of their own, the top of the same ranking (``docs/read-path.md#heavy-values``)."""

    keys: str | Codec | tuple[str | Codec, ...] = "int8"
    values: str | Codec | tuple[str | Codec, ...] = "int8"
    bands: int = 8
    pairing: Pairing = "rotate_half"
    seed: int | None = None
    key_options: dict[str, Any] = field(default_factory=dict)
    value_options: dict[str, Any] = field(default_factory=dict)
    write_block: int = 16
    device_budget: float | None = 1.0
    witness: Witness = DEFAULT_WITNESS
    exact_sinks: int = 0
    upgrade_keys: str | Codec | None = None
    upgrade_values: str | Codec | None = None
    heavy_share: float | None = None
    heavy_select: EvictionPolicy | None = None
    heavy_values: str | Codec | None = None
    heavy_value_share: float | None = None

    def __post_init__(self) -> None:
        """Fail on a wrong type (each message names the argument); value ranges are the store's to check."""
        for name in ("keys", "values"):
            given = getattr(self, name)
            entries = given if isinstance(given, tuple) else (given,)
            bad = [type(e).__name__ for e in entries if not isinstance(e, (str, Codec))]
            if bad or not entries:
                raise TypeError(
                    f"{name} must be a codec name, a Codec or a non-empty tuple of them (one per layer), "
                    f"got {type(given).__name__}" + (f" holding {', '.join(bad)}" if bad else "")
                )
        for name in ("key_options", "value_options"):
            if not isinstance(getattr(self, name), dict):
                raise TypeError(f"{name} must be a dict of codec options, got {type(getattr(self, name)).__name__}")
        if (self.upgrade_keys is None) != (self.upgrade_values is None):
            raise ValueError("upgrade_keys and upgrade_values go together: give both codecs or neither")
        for name in ("upgrade_keys", "upgrade_values"):
            if not isinstance(getattr(self, name), (str, Codec, type(None))):
                raise TypeError(
                    f"{name} must be a codec name, a Codec or None, got {type(getattr(self, name)).__name__}"
                )
        self._check_tiers()
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")

    def _check_tiers(self) -> None:
        """``ValueError`` naming the argument unless the token-tier settings fit (module doc of
        :mod:`kvcert.attention.tier_choice`)."""
        if self.heavy_share is None:
            for name in ("heavy_select", "heavy_values", "heavy_value_share"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is a setting of token tiers: give heavy_share too")
            return
        check_heavy_share(self.heavy_share)
        if self.heavy_value_share is not None:
            try:
                check_heavy_share(self.heavy_value_share)
            except ValueError as err:
                raise ValueError(f"heavy_value_share: {err}") from None
        if not isinstance(self.heavy_values, (str, Codec, type(None))):
            raise TypeError(
                f"heavy_values must be a codec name, a Codec or None, got {type(self.heavy_values).__name__}"
            )
        if self.upgrade_keys is None:
            raise ValueError("heavy_share stores the heavy tokens in the upgrade codecs: give upgrade_keys/_values")
        select = self.tier_select()
        if not isinstance(select, EvictionPolicy):
            raise TypeError(f"heavy_select must be a kvcert.evict.EvictionPolicy, got {type(select).__name__}")

    def tier_select(self) -> EvictionPolicy:
        """The policy that ranks the heavy tokens (``heavy_select`` or the default)."""
        return default_select() if self.heavy_select is None else self.heavy_select

    def store(self, layer: int) -> LayerStore:
        """A fresh store for decoder layer ``layer`` (codecs resolved per layer); the seed must be set."""
        if self.seed is None:
            raise ValueError("StorageConfig.store needs a seed (resolve_storage draws one)")
        return LayerStore(
            layer,
            resolve(_of_layer(self.keys, layer, "keys"), "key", self.key_options),
            resolve(_of_layer(self.values, layer, "values"), "value", self.value_options),
            bands=self.bands,
            pairing=self.pairing,
            seed=self.seed,
            write_block=self.write_block,
            device_budget=self.device_budget,
            witness=self.witness,
            exact_sinks=self.exact_sinks,
            upgrade=self._upgrade(),
            token_tiers=self.heavy_share is not None,
            heavy_values=None if self.heavy_values is None else resolve(self.heavy_values, "value", self.value_options),
        )

    def _upgrade(self) -> tuple[Codec, Codec] | None:
        """The resolved upgrade codecs, or ``None``."""
        if self.upgrade_keys is None or self.upgrade_values is None:
            return None
        return resolve(self.upgrade_keys, "key", self.key_options), resolve(
            self.upgrade_values, "value", self.value_options
        )


def _of_layer(given: str | Codec | tuple[str | Codec, ...], layer: int, name: str) -> str | Codec:
    """The codec of decoder layer ``layer``: ``given`` itself, or its entry ``layer`` when it is a per-layer tuple
    (``ValueError`` naming ``name`` when the tuple is shorter than the model)."""
    if not isinstance(given, tuple):
        return given
    if layer >= len(given):
        raise ValueError(f"{name} lists codecs for {len(given)} layers; the model has a layer {layer}")
    return given[layer]


def resolve_storage(
    storage: StorageConfig | None, keys: str | Codec | None, values: str | Codec | None, seed: int | None
) -> StorageConfig:
    """The storage of a cache given its flat ``keys`` / ``values`` / ``seed`` and its ``storage``: each setting comes
    from exactly one place (``ValueError`` naming it when given in both), codecs default to int8 and a missing seed
    is drawn at random."""
    given = expect(storage, StorageConfig, "storage")
    base = StorageConfig() if given is None else given
    if given is not None:
        for name, flat in (("keys", keys), ("values", values)):
            if flat is not None:
                raise ValueError(
                    f"{name} given both flat and in storage=StorageConfig(...): pass the codecs in one place "
                    f"(StorageConfig(keys=..., values=..., ...) when storage is given)"
                )
        if seed is not None and base.seed is not None:
            raise ValueError("seed given both flat and in storage=StorageConfig(seed=...): pass it in one place")
    if seed is None:
        seed = base.seed if base.seed is not None else int.from_bytes(os.urandom(4), "little")
    return dataclasses.replace(
        base,
        keys=base.keys if keys is None else keys,
        values=base.values if values is None else values,
        seed=seed,
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
        if not isinstance(gate, Gate):
            raise TypeError(f"gate must be a kvcert.Gate, got {type(gate).__name__}")
        if not ladder:
            return cls(gate)
        if gate.mode != "off":
            raise ValueError("ladder=True has its own fallback rungs; use gate=Gate.off() with it")
        base = ladder if isinstance(ladder, LadderConfig) else LadderConfig()
        return cls(gate, dataclasses.replace(base, validate=validate))


@dataclass(frozen=True)
class ValidationConfig:
    """``certify`` (certificates on; ``False``: the uncertified baseline that serves the compressed cache with plain
    SDPA and records nothing, used to measure the certificate's cost) and the Tier-B request failure budget
    ``delta_req`` in ``(0, 1]``, split uniformly over ``layers · heads · max_steps`` cells (:meth:`delta_loc`)."""

    certify: bool = True
    delta_req: float = 1e-2
    max_steps: int = 256

    def __post_init__(self) -> None:
        """Fail on a wrong argument (each message names it)."""
        if not isinstance(self.certify, bool):
            raise TypeError(f"certify must be a bool, got {type(self.certify).__name__}")
        d = self.delta_req
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 < d <= 1.0:
            raise ValueError(f"delta_req must lie in (0, 1], got {d!r}")
        n = self.max_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_steps must be a positive int, got {n!r}")

    def check(self, gate: Gate, validate: bool) -> None:
        """An uncertified cache has neither a gate nor validate mode."""
        if not self.certify and (gate.mode != "off" or validate):
            raise ValueError("certify=False cannot be combined with a gate or validate=True")

    def delta_loc(self, layers: int, heads: int) -> float:
        """Per-cell failure budget ``δ_loc = δ_req / (layers · heads · max_steps)`` (rounded down)."""
        return uniform_split(self.delta_req, layers, heads, self.max_steps)
