"""Events the certified cache emits on every write and read, for observers such as the risk ledger.

The cache never depends on its observers; observers (``kvcert.ledger``, telemetry sinks) implement
:class:`CacheObserver` and are attached with ``CertifiedCache(..., observers=[...])``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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
    ``repaired[b, g]`` marks KV heads served exact from the host tier.
    """

    layer: int
    step: int
    rows: torch.Tensor
    n_slots: torch.Tensor
    certificate: torch.Tensor
    repaired: torch.Tensor
    first_slot: int = 0


class CacheObserver(Protocol):
    """Receives every write and read of a :class:`~kvcert.integrations.transformers.CertifiedCache`."""

    def on_write(self, event: WriteEvent) -> None:
        """Called once per layer per forward call, after the entries are stored."""

    def on_read(self, event: ReadEvent) -> None:
        """Called once per layer per forward call, after the certificate is computed."""
