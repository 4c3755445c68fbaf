"""Persistent recall: omitted pages paged in from the host tier stay on the device, within a token budget.

A resident read (:func:`kvcert.attention.resident.resident_read`) that needs omitted pages to certify a KV head
pages them in from the host tier. With persistent recall those pages stay on the device for every later read of that
(row, KV head): they are read like resident tokens, their summary bounds no longer enter the certificate, and they
are never paged in again while held — their bytes count once. A held page is a real device tensor: one *slot* of
``k_slots[n, page_size, Dk]`` / ``v_slots[n, page_size, Dv]`` in a 16-bit storage dtype (float16 when the host tier
is wider, the host dtype itself when it is already 16-bit, then exact), addressed by ``slot[B, Hkv, P]`` (``-1``: not
held). The slot tensors hold exactly the held pages (no spare capacity): admitting pages appends them, releasing
pages compacts the rest, so the device bytes of the held pages are the bytes of those tensors. A page whose K or V
has an entry outside the storage dtype's finite range (or a non-finite one) is never held (fail closed): it is paged
in, and counted, at every read that needs it.

The held tokens of every layer share one :class:`RecallPool`, the room the cache's device budget leaves
(``StorageConfig(device_budget=F)``: the device bytes of every layer — resident codes, summaries and held pages —
stay within ``F`` times the fp16 K/V bytes of every token written, resident or omitted; ``docs/eviction.md``), in
*slot tokens*: a held page costs ``page_size`` tokens of ``bytes_per_token`` 16-bit K/V bytes (a short last page
too: its slot is allocated whole). A (row, KV head) may hold what it held plus what the pool has free. When a read's
pages exceed that, the pages with the lowest *score* go back to their summaries (the summary is never dropped, so
releasing costs nothing and keeps every bound sound): the score of a page is its exact attention mass at the read
(worst cell of the KV head), kept as ``max(mass, decay · previous)`` over the reads that held it, so a page that
stopped being read fades out. A released page that a later read needs is paged in (and counted) again.

Nothing here changes a certificate: which pages are held only decides which tokens a read serves from their 16-bit
copies; the certificate of every read is computed from what it serves, with the copies' rounding radius
(:meth:`HeldPages.rounding_radius`, ``docs/math.md#resident-certificate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcert.bounds.rope import norm_up_f32, round_up_f32
from kvcert.checks import read_back

DECAY = 0.5  # per read: a held page's score halves each read it is not needed at full mass
#: per host dtype wider than 16 bits: ``(rel, tiny)`` with ``|x − fl16(x)| ≤ rel·|x| + tiny`` per entry of the float16
#: copy of a finite ``|x| ≤ 65504`` (round to nearest: ``2^-11·|x|`` on the normal range, half the subnormal spacing
#: ``2^-25`` below it); float64 goes through float32 first (double rounding: ``2^-24·|x|`` more, and ``2^-150`` for
#: float32 subnormals, inside the ``2^-23`` / ``2^-24`` given)
HALF_ROUNDING: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2.0**-11, 2.0**-25),
    torch.float64: (2.0**-11 + 2.0**-23, 2.0**-24),
}


def storage_dtype(host: torch.dtype) -> torch.dtype:
    """The 16-bit dtype held pages are stored in: ``host`` itself when it is 16-bit, else float16."""
    return host if host.itemsize == 2 else torch.float16


@dataclass
class RecallPool:
    """Slot tokens the held pages of all layers may still add (``free``; a held page takes ``page_size``), shared by
    every layer's :class:`HeldPages`; the cache refreshes it from its device budget once per forward."""

    free: int = 0  # negative: the held pages must shrink by that much


@dataclass(frozen=True)
class Admission:
    """One (row, head)'s admission planned on the device (:meth:`HeldPages.plan`), for :meth:`HeldPages.commit`:
    the pages ``read[k]`` served, their ``score[k]`` and descending ``order``, whether each (in that order) ``fits``,
    the held pages ``after[P]`` the admission leaves and those ``added`` / ``released``, which pages of ``read``
    ``was`` held before, the paged-in K/V ``fresh_k`` / ``fresh_v``, the ``counts[3]`` to read back (pages added,
    released, held before among ``read``) and the pool's free slot tokens ``free`` left after it (0-d)."""

    row: int
    head: int
    read: torch.Tensor
    order: torch.Tensor
    fits: torch.Tensor
    after: torch.Tensor
    added: torch.Tensor
    released: torch.Tensor
    was: torch.Tensor
    score: torch.Tensor
    fresh_k: torch.Tensor
    fresh_v: torch.Tensor
    counts: torch.Tensor
    free: torch.Tensor


@dataclass
class HeldPages:
    """The omitted pages of one layer held on the device after a recall.

    ``slot[B, Hkv, P]`` (int32) the slot of each page (``-1``: not held), ``score[B, Hkv, P]`` its score,
    ``k_slots[n, page_size, Dk]`` / ``v_slots[n, page_size, Dv]`` the 16-bit copies of the ``n`` held pages (zero
    past a short last page's tokens). ``counts[P]`` tokens per page (archive order, ``page_size`` tokens, the last
    page possibly fewer), ``host`` the host tier's dtype, ``pool`` the room shared with the other layers.
    """

    slot: torch.Tensor
    score: torch.Tensor
    counts: torch.Tensor
    page_size: int
    k_slots: torch.Tensor
    v_slots: torch.Tensor
    host: torch.dtype
    pool: RecallPool
    #: ``recall="swap"``: ``[B, Hkv, P]`` the pages whose values were paged in since the archive was last summarised,
    #: held or not (their exact K/V were on the device at that read, so a swap may promote them at no page-in);
    #: ``None`` for persistent recall
    fresh: torch.Tensor | None = None

    @classmethod
    def empty(
        cls,
        batch: int,
        heads: int,
        counts: torch.Tensor,
        page_size: int,
        dims: tuple[int, int],
        host: torch.dtype,
        pool: RecallPool,
        track_fresh: bool = False,
    ) -> HeldPages:
        """Nothing held yet (``counts[P]`` tokens per page, all positive and at most ``page_size``: ``ValueError``
        otherwise; ``dims = (Dk, Dv)``; the host tier's dtype ``host``); ``track_fresh``: record :attr:`fresh`."""
        if counts.dim() != 1 or bool((counts <= 0).any()) or bool((counts > page_size).any()):
            raise ValueError(f"counts must be a positive count per page, at most {page_size}, got {counts.tolist()}")
        pages, dev, store = counts.shape[0], counts.device, storage_dtype(host)
        return cls(
            torch.full((batch, heads, pages), -1, dtype=torch.int32, device=dev),
            torch.zeros(batch, heads, pages, dtype=torch.float64, device=dev),
            counts.to(torch.int64),
            page_size,
            torch.zeros(0, page_size, dims[0], dtype=store, device=dev),
            torch.zeros(0, page_size, dims[1], dtype=store, device=dev),
            host,
            pool,
            torch.zeros(batch, heads, pages, dtype=torch.bool, device=dev) if track_fresh else None,
        )

    @property
    def held(self) -> torch.Tensor:
        """``[B, Hkv, P]``: which pages are held."""
        return self.slot >= 0

    @property
    def exact(self) -> bool:
        """Whether the copies are exact (the host tier is already 16-bit)."""
        return self.host not in HALF_ROUNDING

    @property
    def bytes_per_token(self) -> int:
        """Device bytes of one slot token (K and V, 16-bit)."""
        return (self.k_slots.shape[-1] + self.v_slots.shape[-1]) * self.k_slots.element_size()

    def rounding_radius(self, copy: torch.Tensor) -> torch.Tensor:
        """``e[...]`` (float64) with ``‖x − x̃‖ ≤ e`` for every row ``x̃ = copy[..., D]`` held for a host row ``x``.

        With ``|x_i − x̃_i| ≤ rel·|x_i| + tiny`` per entry (:data:`HALF_ROUNDING`; the held entries are finite and in
        range), ``‖x − x̃‖ ≤ rel·‖x‖ + √D·tiny ≤ rel·(‖x̃‖ + ‖x − x̃‖) + √D·tiny``, so
        ``‖x − x̃‖ ≤ (rel·‖x̃‖ + √D·tiny)/(1 − rel)``, evaluated from ``‖x̃‖`` rounded up to float32 and the result
        rounded up to float32 (it covers the float64 evaluation). Zero when the copies are exact."""
        if self.exact:
            return torch.zeros(copy.shape[:-1], dtype=torch.float64, device=copy.device)
        rel, tiny = HALF_ROUNDING[self.host]
        norm = norm_up_f32(copy).to(torch.float64)
        return round_up_f32((rel * norm + copy.shape[-1] ** 0.5 * tiny) / (1.0 - rel)).to(torch.float64)

    def fits(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[n]`` whether pages ``k[n, ·, Dk]`` / ``v[n, ·, Dv]`` (host values, any float dtype) may be held: every
        entry finite and within the storage dtype's range (``|x| ≤ 65504`` for float16)."""
        top = torch.finfo(self.k_slots.dtype).max
        return (k.abs() <= top).flatten(1).all(-1) & (v.abs() <= top).flatten(1).all(-1)  # NaN compares False

    def pages_of(self, row: int, head: int) -> torch.Tensor:
        """Indices of the pages held for ``(row, head)`` (ascending)."""
        return self.held[row, head].nonzero().flatten()

    def admit(
        self,
        row: int,
        head: int,
        read: torch.Tensor,
        mass: torch.Tensor,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
    ) -> torch.Tensor:
        """After a read of ``(row, head)`` that served the distinct pages ``read[k]`` with exact
        masses ``mass[k]`` (worst cell): update their scores and keep the highest-scoring ones that fit in the slot
        tokens it held plus the pool's free tokens (ties: the earlier page), and that :meth:`fits` the storage dtype.
        ``fresh_k[m, page_size, Dk]`` / ``fresh_v`` are the paged-in K/V of the ``m`` pages of ``read`` not held
        before, in the order of ``read`` (zero past a short last page's tokens): those admitted are copied into
        slots (the page-in is the caller's, already counted); released slots are compacted away. Returns the pages of
        ``read`` that were *not* held before the read (the page-in of this read). Pages not in ``read`` keep their
        state (a read serves every held page, so there are none unless the caller skipped the head).

        :meth:`plan` then :meth:`commit` with one read-back between them (the caller's deferred checks with it)."""
        adm = self.plan(row, head, read, mass, fresh_k, fresh_v, self.pool.free)
        return self.commit(adm, read_back([adm.counts]))

    def plan(
        self,
        row: int,
        head: int,
        read: torch.Tensor,
        mass: torch.Tensor,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
        free: int | torch.Tensor,
    ) -> Admission:
        """:meth:`admit`'s choice on the device, without a sync and without changing any state, against ``free``
        slot tokens in the pool (the pool's, or the :attr:`Admission.free` an earlier plan of the same read leaves:
        plans of distinct heads chained that way and committed in the same order are the admissions one after
        the other, since an admission changes only its own head's slots, scores and the pool)."""
        ps = self.page_size
        before = self.held[row, head].clone()
        was = before[read]
        # which pages of read may be held: those held before, and the fresh ones whose K/V fit the storage dtype
        spare = torch.ones(1, dtype=torch.bool, device=read.device)  # read may have no fresh page
        fresh_ok = torch.cat([self.fits(fresh_k, fresh_v), spare])
        ok = was | fresh_ok[(~was).cumsum(0) - 1]
        own = ps * before.sum()  # slot tokens held before, on the device (no read-back)
        score = torch.maximum(mass.to(torch.float64), DECAY * self.score[row, head, read])
        score = torch.where(ok, score, 0.0)
        order = torch.argsort(score, descending=True, stable=True)
        cost = ps * ok[order].to(torch.int64)  # a refused page costs nothing and is not held
        fits = ok[order] & (cost.cumsum(0) <= own + free)
        after = before.clone()
        after[read[order]] = fits  # the pages of read that fit are held, the others not (read: unique)
        added, released = after & ~before, before & ~after
        counts = torch.stack([added.sum(), released.sum(), was.sum()])
        left = free - ps * (counts[0] - counts[1])
        return Admission(
            row, head, read, order, fits, after, added, released, was, score, fresh_k, fresh_v, counts, left
        )

    def commit(self, adm: Admission, counts: Sequence[int]) -> torch.Tensor:
        """Apply the planned ``adm`` given its :attr:`Admission.counts` read back (pages added, released, and of
        ``read`` held before); returns :meth:`admit`'s value."""
        ps, row, head, read = self.page_size, adm.row, adm.head, adm.read
        n_add, n_rel, n_was = counts
        new = read[torch.argsort(adm.was.to(torch.int8), stable=True)[: read.numel() - n_was]]  # read[~was], in order
        if self.fresh is not None:
            self.fresh[row, head, new] = True
        self.score[row, head] = torch.where(adm.after, self.score[row, head], 0.0)
        self.score[row, head, read[adm.order]] = torch.where(adm.fits, adm.score[adm.order], 0.0)
        self.pool.free -= ps * (n_add - n_rel)
        if n_add or n_rel:
            pick = torch.argsort(adm.added[new].to(torch.int8), descending=True, stable=True)[:n_add]
            self._restore(row, head, adm.released, n_rel, new[pick], adm.fresh_k[pick], adm.fresh_v[pick])
        return new

    def _restore(
        self,
        row: int,
        head: int,
        released: torch.Tensor,
        n_rel: int,
        pages: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Free the slots of ``released[P]`` (of ``(row, head)``, ``n_rel`` pages) and give ``pages[m]`` new slots
        holding ``k`` / ``v`` ``[m, page_size, ·]`` in the storage dtype: the kept slots keep their order, compacted
        to the front, the new ones follow, and the slot tensors are reallocated at exactly the held size."""
        slot = self.slot.clone()
        slot[row, head] = torch.where(released, -1, slot[row, head])
        flat = slot.flatten().to(torch.int64)
        kept = self.k_slots.shape[0] - n_rel
        big = torch.iinfo(torch.int64).max
        keep = torch.argsort(torch.where(flat >= 0, flat, big))[:kept]  # flat page ids by old slot
        src = flat[keep]
        dev = self.slot.device
        fresh = (row * self.slot.shape[1] + head) * self.slot.shape[2] + pages
        new_flat = torch.full_like(flat, -1)
        new_flat[keep] = torch.arange(kept, dtype=torch.int64, device=dev)
        new_flat[fresh] = kept + torch.arange(pages.numel(), dtype=torch.int64, device=dev)
        self.slot = new_flat.view_as(self.slot).to(torch.int32)
        dt = self.k_slots.dtype
        self.k_slots = torch.cat([self.k_slots[src], k.to(dev, torch.float32).to(dt)])
        self.v_slots = torch.cat([self.v_slots[src], v.to(dev, torch.float32).to(dt)])

    def carry(
        self, carried: torch.Tensor, score: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """After a re-selection: the new archive ``keys[B, Hkv, N, Dk]`` / ``values`` (host tier) puts each (row,
        head)'s ``carried[B, Hkv]`` tokens that were held before (and stay omitted) first, so they fill its first
        pages; hold those pages, scored by the largest ``score[B, Hkv, N]`` (archive order) of their tokens. A last
        page they fill only in part is held as well when the pool has room for its slot (granted in (row, head)
        order up to the first that does not fit: its other tokens are paged in) and it :meth:`fits`; otherwise the
        carried tokens in it go back to their summary (sound either way: the summary covers every omitted token).
        Replaces what was held, slots included (rebuilt from the archive: a carried token's 16-bit copy is the same
        function of the same host value as before, so a deployment moves it device to device; only the completing
        tokens are a page-in). Every page held afterwards is charged to the pool, which the caller has just
        refreshed without this layer's held pages, so the pool stays exact (negative when the carried pages alone
        exceed it: the next reads hand pages back). Returns ``[B, Hkv]`` the tokens paged in to complete a page."""
        ps, pages = self.page_size, self.counts.shape[0]
        dev = self.slot.device
        b, h = self.slot.shape[:2]
        carried = carried.to(dev, torch.int64)
        tok = torch.arange(pages * ps, device=dev).clamp(max=keys.shape[2] - 1)
        k_all = keys.to(dev)[:, :, tok].view(b, h, pages, ps, -1)
        v_all = values.to(dev)[:, :, tok].view(b, h, pages, ps, -1)
        ok = self.fits(k_all.flatten(0, 2), v_all.flatten(0, 2)).view(b, h, pages)
        whole, rest = carried // ps, carried % ps
        last = whole.clamp(max=pages - 1)
        fill = torch.where(rest > 0, self.counts[last] - rest, 0)
        short = (rest > 0) & (fill == 0)  # a short last page every token of which is carried: whole as well
        need = (fill > 0) & ok.gather(-1, last.unsqueeze(-1)).squeeze(-1)
        room = self.pool.free - ps * int((whole + short.to(torch.int64)).sum())
        granted = short | (need & ((ps * need.to(torch.int64)).flatten().cumsum(0) <= room).view(need.shape))
        fill = torch.where(granted, fill, 0)
        held = torch.arange(pages, device=dev) < (whole + granted.to(torch.int64)).unsqueeze(-1)
        pad = pages * ps - score.shape[-1]
        best = torch.nn.functional.pad(score.to(dev, torch.float64), (0, pad)).reshape(b, h, pages, ps)
        self.score = torch.where(held, best.amax(-1), 0.0)
        n = int(held.sum())
        ids = torch.argsort((~held).flatten().to(torch.int8), stable=True)[:n]  # held pages, (row, head, page) order
        self.slot = torch.full((b * h * pages,), -1, dtype=torch.int32, device=dev)
        self.slot[ids] = torch.arange(n, dtype=torch.int32, device=dev)
        self.slot = self.slot.view(b, h, pages)
        valid = (torch.arange(pages * ps, device=dev) < keys.shape[2]).view(pages, ps, 1)
        dt = self.k_slots.dtype
        self.k_slots = torch.where(valid, k_all, 0).flatten(0, 2)[ids].to(torch.float32).to(dt)
        self.v_slots = torch.where(valid, v_all, 0).flatten(0, 2)[ids].to(torch.float32).to(dt)
        self.pool.free -= self.tokens
        return fill

    @property
    def tokens(self) -> int:
        """Slot tokens held over every (row, KV head): ``page_size`` per held page."""
        return self.k_slots.shape[0] * self.page_size

    @property
    def nbytes(self) -> int:
        """Device bytes of the held pages: the slot tensors, the slot index, the scores and :attr:`fresh`."""
        kept = [self.k_slots, self.v_slots, self.slot, self.score] + ([] if self.fresh is None else [self.fresh])
        return sum(t.numel() * t.element_size() for t in kept)
