"""``minmax-int2`` / ``minmax-int4``: per-token asymmetric min/max codes over wide channel groups, for values.

The KIVI value form (:class:`~kvcert.quant.kivi.KiviCodec` on ``axis="value"``: ``zero = min`` rounded down and
``scale = (max − zero)/(2^b − 1)`` rounded up, both fp16, per token and group of ``group_size`` channels;
``x̂ = zero + scale·round((x − zero)/scale)``, so ``|x̂ − x| ≤ scale/2``) with a default group of 64 channels (the
whole head when it has fewer) and no residual window: each token is encoded on its own, so the codec can hold the
light or heavy tokens of a token-tier store or an upgrade (``docs/codecs.md#minmax``).

At 2 bits the four levels span ``[min, max]`` of the group, where symmetric ``int2`` (``qmax = 1``) uses three, and
the zero-point costs the bytes the second scale of ``int2``'s 32-channel groups did: at ``D = 64`` both store
20 B per token and head (``docs/results.md#heavy-values`` measures the residuals on SmolLM2's values).
"""

from __future__ import annotations

from kvcert.quant.kivi import KiviCodec


class MinMaxCodec(KiviCodec):
    """``minmax-int{bits}``: :class:`KiviCodec` per token (``axis="value"``) over ``group_size`` channels, with no
    residual window (every token encoded at once, on its own)."""

    def __init__(self, bits: int, group_size: int = 64) -> None:
        super().__init__(bits, axis="value", group_size=group_size, residual_window=0)
        self.name = f"minmax-int{bits}"

    def channel_group(self, d: int) -> int:
        """``group_size`` channels per group, the whole head when it has fewer (``ValueError`` from the encode
        when ``group_size`` does not divide a larger ``d``)."""
        return min(self.group_size, d)
