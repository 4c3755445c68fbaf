"""Persistent recall: omitted pages paged in from the host tier stay on the device, within a token budget.

A resident read (:func:`kvcert.attention.resident.resident_read`) that needs omitted pages to certify a KV head
pages them in from the host tier. With persistent recall those pages stay on the device (exact, in the host
tier's dtype) for every later read of that (row, KV head): they are read like resident tokens, their summary
bounds no longer enter the certificate, and they are never paged in again while held — their bytes count once.
The held tokens of every layer share one :class:`RecallPool`, the room the cache's device budget leaves
(``CertifiedCache(device_budget=F)``: the device bytes of every layer — resident codes, summaries and held pages —
stay within ``F`` times the fp16 K/V bytes of every token written, resident or omitted; ``docs/eviction.md``): a (row,
KV head) may hold what it held plus what the pool has free. When a read's pages exceed that, the pages with the lowest
*score* go back to their summaries (the summary is never dropped, so releasing costs nothing and keeps every bound
sound): the score of a page is its exact attention mass at the read (worst cell of the KV head), kept as ``max(mass,
decay · previous)`` over the reads that held it, so a page that stopped being read fades out. A released page that a
later read needs is paged in (and counted) again.

Nothing here changes a certificate: which pages are held only
decides which tokens a read serves exactly; the certificate of every read is computed from what it serves
(``docs/math.md#resident-certificate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DECAY = 0.5  # per read: a held page's score halves each read it is not needed at full mass


@dataclass
class RecallPool:
    """Tokens the held pages of all layers may still add (``free``), shared by every layer's :class:`HeldPages`;
    the cache refreshes it from its device budget once per forward."""

    free: int = 0  # negative: the held pages must shrink by that much


@dataclass
class HeldPages:
    """The omitted pages of one layer held on the device after a recall (``[B, Hkv, P]`` masks and scores).

    ``counts[P]`` tokens per page (archive order, ``page_size`` tokens, the last page possibly fewer),
    ``bytes_per_token`` device bytes of one held token (K and V, exact), ``pool`` the room shared with the other
    layers.
    """

    held: torch.Tensor
    score: torch.Tensor
    counts: torch.Tensor
    bytes_per_token: int
    pool: RecallPool

    @classmethod
    def empty(cls, batch: int, heads: int, counts: torch.Tensor, bytes_per_token: int, pool: RecallPool) -> HeldPages:
        """Nothing held yet (``counts[P]`` tokens per page, all positive: ``ValueError`` otherwise)."""
        if counts.dim() != 1 or bool((counts <= 0).any()):
            raise ValueError(f"counts must be a positive count per page, got {counts.tolist()}")
        pages = counts.shape[0]
        return cls(
            torch.zeros(batch, heads, pages, dtype=torch.bool, device=counts.device),
            torch.zeros(batch, heads, pages, dtype=torch.float64, device=counts.device),
            counts.to(torch.int64),
            bytes_per_token,
            pool,
        )

    def pages_of(self, row: int, head: int) -> torch.Tensor:
        """Indices of the pages held for ``(row, head)`` (ascending)."""
        return self.held[row, head].nonzero().flatten()

    def admit(self, row: int, head: int, read: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """After a read of ``(row, head)`` that served the distinct pages ``read[k]`` (held ones included) with exact
        masses ``mass[k]`` (worst cell): update their scores and keep the highest-scoring ones that fit in the tokens it
        held plus the pool's free tokens
        (ties: the earlier page). Returns the pages of ``read`` that were *not* held before the read (the page-in
        of this read). Pages not in ``read`` keep their state (a read serves every held page, so there are none
        unless the caller skipped the head)."""
        before = self.held[row, head].clone()
        own = (self.counts * before).sum()  # tokens held before, on the device (no read-back)
        score = torch.maximum(mass.to(torch.float64), DECAY * self.score[row, head, read])
        order = torch.argsort(score, descending=True, stable=True)
        fits = self.counts[read[order]].cumsum(0) <= own + self.pool.free
        self.held[row, head, read[order]] = fits  # the pages of read that fit are held, the others not (read: unique)
        self.score[row, head] = torch.where(self.held[row, head], self.score[row, head], 0.0)
        self.score[row, head, read[order]] = torch.where(fits, score[order], 0.0)
        self.pool.free -= int((self.counts * self.held[row, head]).sum() - own)  # the pool's one sync
        return read[~before[read]]

    def carry(self, carried: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """After a re-selection: the new archive puts each (row, head)'s ``carried[B, Hkv]`` tokens that were held
        before (and stay omitted) first, so they fill its first pages; hold those pages, scored by the largest
        ``score[B, Hkv, N]`` (archive order) of their tokens. A last page they fill only in part is held as well
        when the pool has room for its other tokens (granted in (row, head) order up to the first that does not
        fit: those tokens are paged in); otherwise the carried tokens in it go back to their summary (sound either
        way: the summary covers every omitted token). Replaces what was held; every token held afterwards is
        charged to the pool, which the caller has just refreshed without this layer's held pages, so the pool
        stays exact (negative when the carried tokens alone exceed it: the next reads hand pages back). Returns
        ``[B, Hkv]`` the tokens paged in to complete a page."""
        ps, pages = int(self.counts[0]), self.counts.shape[0]
        dev = self.held.device
        carried = carried.to(dev, torch.int64)
        whole, rest = carried // ps, carried % ps
        part = rest > 0
        fill = torch.where(part, self.counts[whole.clamp(max=pages - 1)] - rest, 0)
        room = self.pool.free - int(carried.sum())
        granted = part & ((fill == 0) | (fill.flatten().cumsum(0) <= room).view(fill.shape))  # 0: a short last page
        fill = torch.where(granted, fill, 0)
        self.held = torch.arange(pages, device=dev) < (whole + granted.to(torch.int64)).unsqueeze(-1)
        pad = pages * ps - score.shape[-1]
        best = torch.nn.functional.pad(score.to(dev, torch.float64), (0, pad)).reshape(*self.held.shape, ps)
        self.score = torch.where(self.held, best.amax(-1), 0.0)
        self.pool.free -= self.tokens
        return fill

    @property
    def tokens(self) -> int:
        """Tokens held over every (row, KV head)."""
        return int((self.held.to(torch.int64) * self.counts).sum())

    @property
    def nbytes(self) -> int:
        """Device bytes of the held tokens (K and V, exact) plus the masks and scores."""
        return self.tokens * self.bytes_per_token + self.held.numel() * (1 + self.score.element_size())
