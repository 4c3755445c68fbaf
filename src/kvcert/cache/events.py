"""Events the certified cache emits on every write and read, for observers such as the risk ledger.

The cache never depends on its observers; observers (``kvcert.ledger``, telemetry sinks) implement
:class:`CacheObserver` and are attached with ``CertifiedCache(..., observers=[...])``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvcert.bounds import dither_witness_moments

if TYPE_CHECKING:
    from kvcert.cache.store import LayerStore


@dataclass(frozen=True)
class WriteEvent:
    """One layer's write of ``T`` new tokens for a batch of ``B`` rows.

    ``rows[b]`` is the request UID owning batch row ``b`` (``-1`` when the caller gave none: the write
    is unattributable and the cache stores it exact). ``positions[b, t]`` are the logical positions
    (slots) written; padded positions are ``-1``. ``compressed[b, h, t]`` is False where the entry is
    stored exact (non-finite input, unattributable, pending KIVI block, persistent repair).
    ``witness[b, h, t]`` is the scalar key witness ``W = Σ_b ρ_b ≥ ‖Δk‖`` (0 where exact) and
    ``value_witness`` the value residual norm. ``tier_b`` says the key codec is the dithered one; then
    ``witness_mean[b, h, t] ≥ E W`` and ``witness_c[b, h, t]`` (McDiarmid's constant) are the inputs of
    the drift e-process factor (:func:`kvcert.bounds.radii.dither_witness_moments`), else ``None``.
    """

    layer: int
    rows: torch.Tensor
    positions: torch.Tensor
    compressed: torch.Tensor
    witness: torch.Tensor
    value_witness: torch.Tensor
    codec: str
    tier_b: bool
    nonfinite: int = 0
    witness_mean: torch.Tensor | None = None
    witness_c: torch.Tensor | None = None


@dataclass(frozen=True)
class ReadEvent:
    """One layer's attention read at decode/prefill step ``step`` for ``B`` rows.

    ``n_slots[b]`` physical slots were read by row ``b``, starting at absolute slot ``first_slot``
    (non-zero after sliding-window trims); ``certificate[b, h]`` is the
    served Tier-A meter per query head (clipped to [0, 1]) for the last query of the step;
    ``repaired[b, g]`` marks KV heads served exact from the host tier. With a Tier-B gate
    (``Gate.certified(tau, box=True, tier_b=True)``) ``tier_b_cells[b]`` cells of row ``b`` were served on the
    partially certified bound, each charged ``delta_loc`` against the request's failure budget (else ``None``).
    """

    layer: int
    step: int
    rows: torch.Tensor
    n_slots: torch.Tensor
    certificate: torch.Tensor
    repaired: torch.Tensor
    first_slot: int = 0
    tier_b_cells: torch.Tensor | None = None
    delta_loc: float | None = None


class CacheObserver(Protocol):
    """Receives every write and read of a :class:`~kvcert.integrations.transformers.CertifiedCache`."""

    def on_write(self, event: WriteEvent) -> None:
        """Called once per layer per forward call, after the entries are stored."""

    def on_read(self, event: ReadEvent) -> None:
        """Called once per layer per forward call, after the certificate is computed."""


def dither_moments(store: LayerStore, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """E-process inputs ``(witness_mean, witness_c)`` of the dither writes ``[lo, hi)`` (empty if not dithered)."""
    if store.k_steps is None:
        return {}
    codec = store.key_codec
    mask = None if codec.channel_mask is None else codec.channel_mask.view(1, -1, 1, codec.channel_mask.shape[-1])
    mean, c = dither_witness_moments(
        store.k_steps.view()[:, :, lo:hi].to(torch.float64),
        codec.group_size,
        store.bands,
        store.pairing,
        channel_mask=mask,
    )
    return {"witness_mean": mean, "witness_c": c}


def last_write_event(store: LayerStore, rows: torch.Tensor, nonfinite: int = 0) -> WriteEvent | None:
    """The :class:`WriteEvent` of the entries ``store``'s last append encoded (``None``: it encoded none), for
    rows owned by ``rows[B]``; ``nonfinite`` non-finite inputs were stored exact by that append. Every adapter
    that feeds observers (the transformers cache, the vLLM runtime) builds its write events here."""
    assert store.k is not None
    if store.k.last_encoded <= 0:
        return None
    lo, hi = store.k.n_encoded - store.k.last_encoded, store.k.n_encoded
    return WriteEvent(
        layer=store.layer,
        rows=rows.clone(),
        positions=store.positions.view()[:, 0, lo:hi].clone(),  # logical (= base + slot w/o eviction)
        compressed=~store.k.exact.view()[:, :, lo:hi].clone(),
        witness=store.k_band.view()[:, :, lo:hi].sum(-1).clone(),
        value_witness=store.v_res.view()[:, :, lo:hi].clone(),
        codec=store.key_codec.name,
        tier_b=bool(store.key_codec.tier_b),
        nonfinite=nonfinite,
        **dither_moments(store, lo, hi),
    )
