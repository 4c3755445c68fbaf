"""The three tiers every emitted number carries, ordered CERTIFIED > PARTIAL > EMPIRICAL
(``docs/contracts.md#tier-rules``).

- certified: a sound upper bound exists (and holds for every input satisfying its stated assumptions);
- partial: the bound holds only on a decidable subset (a runtime-checked premise, certified rows);
- empirical: an observation with no bound attached.

Composition takes the weakest tier: a fold never ranks above any of its elements.
"""

from __future__ import annotations

from enum import Enum


class Tier(Enum):
    """Tier of a number; compare with ``<``: ``Tier.EMPIRICAL < Tier.PARTIAL < Tier.CERTIFIED``."""

    CERTIFIED = "certified"
    PARTIAL = "partial"
    EMPIRICAL = "empirical"

    @property
    def rank(self) -> int:
        """Strength: 2 certified, 1 partial, 0 empirical."""
        return _RANK[self]

    @classmethod
    def parse(cls, value: Tier | str) -> Tier:
        """Return ``value`` as a Tier (accepts the lower-case names); ``ValueError`` otherwise."""
        if isinstance(value, Tier):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"tier must be one of {[t.value for t in cls]}, got {value!r}") from None

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Tier):
            return NotImplemented
        return self.rank < other.rank

    def __le__(self, other: object) -> bool:
        if not isinstance(other, Tier):
            return NotImplemented
        return self.rank <= other.rank

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Tier):
            return NotImplemented
        return self.rank > other.rank

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Tier):
            return NotImplemented
        return self.rank >= other.rank


_RANK = {Tier.EMPIRICAL: 0, Tier.PARTIAL: 1, Tier.CERTIFIED: 2}


def weakest(*tiers: Tier) -> Tier:
    """The weakest of ``tiers`` (their minimum); ``ValueError`` if none are given."""
    if not tiers:
        raise ValueError("tiers must contain at least one Tier")
    return min(Tier.parse(t) for t in tiers)
