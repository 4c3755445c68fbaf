"""Block repair of every gated (row, KV head) of a read at once, on the read's device (any device: torch ops).

The certified read's block gate pages in whole token blocks of each KV head whose cells are over the threshold
(``docs/read-path.md``). :func:`repair_blocks` does this for all such heads together, as batched tensor
operations: the heads come listed from the read's decision (already on the host), and each doubling round waits for
the device once (whether any head is still over the threshold, the paged token count and the meter's fail-closed
checks in one read-back), none per head or per cell. Per head it makes exactly the choice of the per-head procedure
it replaces:

1. blocks ordered by their largest contribution ``Σ_{t∈b} p̃_t(e^{c_t} − 1)`` over the head's cells (descending,
   stable);
2. first guess: the shortest prefix of that order whose predicted e-form ``½(A_k² − 1)``, ``A_k = 1 +
   Σ_{b∉prefix} contribution_b``, is under the threshold for every cell (all blocks if none);
3. the served attention is recomputed with the prefix's tokens exact (host-tier K/V, radius 0) and the prefix
   doubled until the recomputed meter is under the threshold for every cell or every block is paged. With a box gate
   (``Gate.certified(tau, box=True)``) each round's certificate is ``min(meter, tv_box)``
   (:func:`kvcert.bounds.tv_box.box_refined`) over the same distribution and radii, and a shorter prefix is tried
   before step 2's (the one predicted under twice the threshold), so it never pages more blocks than the meter's
   gate.

With upgrade codecs (``LayerStore.upgrade``, ``docs/read-path.md#upgrade-repair``) a repair does not page exact
entries in: it serves the chosen entries from their *upgraded codes*. The entries of the head still at light codes are
planned (:meth:`LayerStore.plan_upgrade`: the upgrade codec's codes from the exact original, their decode and
witnesses, as a host-side encoder would send them), and the rounds recompute the read with the chosen blocks' entries
at their new values and at the Tier-A radii of their new witnesses (``key_radii``, computed as the read computes its
own). Planning is lazy: first only the light entries of the blocks up to :data:`PLAN_ROUNDS` doublings past the
meter's predicted prefix (at least :data:`PLAN_MIN_BLOCKS`); a head whose rounds would go past them runs again from
the start with every light entry planned, so the choice is the one planning every entry at once makes (tested bit
for bit). That recomputed read is served, its certificate is that of what is served, and a persistent gate keeps exactly
those codes (:meth:`LayerStore.commit_upgrade`, within the device budget). Its traffic is the new codes' and
witnesses' measured bytes (:attr:`BlockRepairs.upgrade_bytes`). A head that no prefix passes even with every light
entry upgraded is served with every light entry upgraded, and second rounds page in exact, over that, the blocks it
still needs (radius 0; a persistent gate holds them exact, :meth:`LayerStore.persist_heads` with ``exact=True``).
With ``partial`` radii (a Tier-B gate's ``min(c, u)``) the rounds' certificate is the partial bound (upgraded entries
at their Tier-A radii, which bound their errors on any event), and the meter over ``c`` is returned beside it.

The meter of the recomputed read is the certificate of what is served (paged tokens have radius 0, upgraded ones the
radii of their new codes, the others keep their radii, which bound their logit errors whatever the other tokens
are). On the numba backend its softmax and meter are the decode read's fused row kernel
(:func:`kvcert.kernels.numba_read.softmax_meter`, with that kernel's rounding allowance,
``docs/math.md#kernel-rounding``), elsewhere the eager forms (:func:`repaired_read`).
The host tier's K/V of the gated heads are paged to the device once, head by head from the host tier's slices
(pinned memory beside a GPU: asynchronous copies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcert.bounds.softmax_tv import probs64, served_meter
from kvcert.bounds.tv_box import box_refined
from kvcert.cache.gate import Gate
from kvcert.cache.store import LayerStore, UpgradePlan
from kvcert.checks import Checks, deferred
from kvcert.kernels import active, numba_box
from kvcert.kernels.numba_read import softmax_meter

__all__ = ["BlockRepairs", "KeyRadii", "block_contributions", "repair_blocks", "repaired_read"]

#: ``(heads, k_band [n, S, bands], k_hat_norm [n, S], k_wit [n, S]) -> [n, M, S]``: the Tier-A radii (float64, the
#: logit rounding slack included) of the read's cells of the (row, KV head) index pair ``heads`` over keys with these
#: witnesses, exactly as the read computes its own (:mod:`kvcert.attention.certified`)
KeyRadii = Callable[[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BlockRepairs:
    """The repaired heads of one read, in ``need.nonzero()`` order (``n`` heads; tensors on the read's device), and
    ``n_tokens``, the tokens paged over all of them (read back with the last doubling round's decision)."""

    heads: torch.Tensor  # [n, 2] int64 (row, KV head)
    out: torch.Tensor  # [n, M, Dv] float32 served output
    cert: torch.Tensor  # [n, M] meter of the repaired read (min(meter, box) with a box gate)
    raw: torch.Tensor  # [n, M] unclipped meter
    p: torch.Tensor  # [n, M, S] float64 served distribution
    v_res: torch.Tensor  # [n, S] value residual norms, 0 on paged tokens
    tokens: torch.Tensor  # [n, S] bool, the paged tokens
    n_blocks: torch.Tensor  # [n] int64 blocks paged
    n_tokens: int  # entries paged in exact
    upgrade_bytes: int  # the measured bytes of the upgraded entries' codes and witnesses served (host-side encoding)
    upgraded: torch.Tensor  # [n] bool, served on upgraded codes (False: paged everything it needed exact)
    values: torch.Tensor  # [n, S, Dv] float32 the values served (exact, upgraded or as stored)
    certified: torch.Tensor | None = None  # [n, M] with partial radii: the meter over the Tier-A radii


def block_contributions(p: torch.Tensor, c: torch.Tensor, block: int) -> torch.Tensor:
    """``Σ_{t∈b} p_t(e^{c_t} − 1)`` per block ``b`` of ``block`` consecutive slots (the last one possibly shorter):
    ``[..., M, nb]`` from a served distribution ``p`` and radii ``c`` ``[..., M, S]``, each block's share of the
    meter's first-order term; a block gate reads blocks exact in descending order of their largest value over the
    cells."""
    s = p.shape[-1]
    nb = -(-s // block)
    part = torch.nn.functional.pad(p * torch.expm1(c), (0, nb * block - s))
    return part.reshape(*p.shape[:-1], nb, block).sum(-1)


def repaired_read(logits: torch.Tensor, c: torch.Tensor, fused: bool) -> tuple[torch.Tensor, ...]:
    """``(p̃, meter, unclipped meter)`` of masked float32 ``logits[..., S]`` under radii ``c[..., S]``: with ``fused``
    (CPU) the fused row kernel :func:`kvcert.kernels.numba_read.softmax_meter` (numpy's ``exp``, the meter never
    below its formula at the computed ``p̃``), else :func:`probs64` and :func:`served_meter`."""
    if fused:
        p, _, cert, raw, _ = softmax_meter(logits, c)
        return p, cert, raw
    p = probs64(logits)
    return (p, *served_meter(p, c))


def repair_blocks(
    qg: torch.Tensor,
    store: LayerStore,
    need: torch.Tensor,
    pairs: list[tuple[int, int]],
    mask: torch.Tensor,
    c: torch.Tensor,
    p: torch.Tensor,
    scaling: float,
    gate: Gate,
    partial: torch.Tensor | None = None,
    key_radii: KeyRadii | None = None,
) -> BlockRepairs:
    """Page in token blocks of every (row, KV head) with ``need[B, Hkv]`` until each of its cells is under
    ``gate.threshold`` (see the module docstring). ``pairs``: the same heads on the host, ``need.nonzero()`` as
    ``(row, KV head)`` pairs in row-major order (the caller's read-back of its decision; no sync here).
    ``qg[B, Hkv, M, D]`` float32 grouped queries, ``mask[B, Hkv, M, S]`` visibility, ``c`` / ``p`` ``[B, Hkv, M, S]``
    the read's radii and served distribution. Persistent gates keep the paged entries exact within the store's
    device budget (:meth:`LayerStore.persist`). ``partial`` (``[B, Hkv, M, S]``, ``<= c``; a Tier-B gate's
    ``min(c, u)``): the radii the rounds take instead of ``c``, so their certificate is the partial bound; the meter of
    the last round over ``c`` is then returned as :attr:`BlockRepairs.certified`. With upgrade codecs ``key_radii``
    gives the Tier-A radii of the upgraded entries (module docstring).
    """
    assert store.k is not None and store.v is not None
    if not pairs:
        raise ValueError("repair_blocks needs at least one head to repair (pairs is empty)")
    # need's True entries in row-major order, found on the device: a stable descending sort puts them first
    flat = torch.argsort(need.flatten().to(torch.int8), descending=True, stable=True)[: len(pairs)]
    bi, hi = flat // need.shape[1], flat % need.shape[1]
    heads = torch.stack([bi, hi], -1)
    khat, vhat = store.k.served.view()[bi, hi], store.v.served.view()[bi, hi]  # [n, S, D] (copies: written below)
    dev = khat.device
    vres = store.v_res.view()[bi, hi]
    q, m, cc, pp = qg[bi, hi], mask[bi, hi], (c if partial is None else partial)[bi, hi], p[bi, hi]
    rounds = _Rounds(q, m, scaling, gate, active(dev) == "numba", (store.k.host.view(), store.v.host.view()), pairs)
    light = _light(store, pairs, pp.shape[-1], dev)  # [n, S] (all True without upgrade codecs)
    if store.upgrade is None:  # exact blocks, radius 0
        got = rounds.run(khat, cc, pp, light)
        exact, coded, on_codes, plans = got.tok, torch.zeros_like(got.under), torch.zeros_like(got.tok), []
        values, v_res, exact_heads = vhat, vres, list(range(len(pairs)))
    else:
        # upgrade repair: the chosen light entries served from their upgraded codes (radii from the new codes'
        # witnesses); a head that no choice of them passes is served with every light entry upgraded and the blocks it
        # still needs paged in exact over that (radius 0). Planned lazily: the light entries of each head's first
        # blocks in the rounds' order; a head whose rounds would go past them runs again from the start with every
        # light entry planned (the same rounds, so the same choice as planning every light entry at once)
        limit, planned = rounds.first_plan(cc, pp, light)
        up = _Upgrades.of(store, pairs, planned, khat, vhat, vres, key_radii, (bi, hi))
        got = rounds.run(khat, cc, pp, light, up.k, up.radii, limit)
        assert got.short_host is not None
        short = [i for i, gone in enumerate(got.short_host) if gone]
        if short:
            j = torch.tensor(short, device=dev)
            full = _Upgrades.of(
                store, [pairs[i] for i in short], light[j], khat[j], vhat[j], vres[j], key_radii, (bi[j], hi[j])
            )
            got = got.replaced(j, rounds.subset(short).run(khat[j], cc[j], pp[j], light[j], full.k, full.radii))
            up = up.replaced(short, full)
        coded = got.under
        on_codes, exact = torch.where(coded.unsqueeze(-1), got.tok, light), torch.zeros_like(got.tok)
        failed = exact_heads = [i for i, ok in enumerate(got.under_host) if not ok]
        if failed:
            j = torch.tensor(failed, device=dev)
            base_k = torch.where(light[j].unsqueeze(-1), up.k[j], khat[j])
            base_c = torch.where(light[j].unsqueeze(1), up.radii[j], cc[j])
            again = rounds.subset(failed).run(base_k, base_c, got.pm[j], torch.ones_like(light[j]))
            exact[j], on_codes[j] = again.tok, on_codes[j] & ~again.tok
            got = got.with_rows(j, again)
        plans = [plan.subset(on_codes[i]) for i, plan in enumerate(up.plans)]
        values = torch.where(on_codes.unsqueeze(-1), up.v, vhat)
        v_res = torch.where(on_codes, up.v_res, vres)
    if gate.persistent:  # kept within the store's device budget, else served for this read only
        for plan in plans:
            store.commit_upgrade(plan)
        store.persist_heads([pairs[i] for i in exact_heads], [exact[i] for i in exact_heads], exact=True)
    certified = None
    if partial is not None:  # the same served read under the Tier-A radii (a certified bound)
        tier_a = torch.where(on_codes.unsqueeze(1), got.radii, c[bi, hi])
        certified = repaired_read(got.logits, torch.where(exact.unsqueeze(1), 0.0, tier_a), rounds.fused)[1]
    if got.n_exact:  # the exact entries' values, from the host tier
        values = _mix(values.clone(), rounds.hosts[1], rounds.paged(1, dev), exact, pairs)
    out = got.pm.to(torch.float32) @ values
    return BlockRepairs(
        heads,
        out,
        got.cert,
        got.raw,
        got.pm,
        torch.where(exact, 0.0, v_res),
        exact | on_codes,
        got.blocks,
        got.n_exact,
        sum(plan.nbytes for plan in plans),  # what a host-side encoder sends: the new codes and witnesses
        coded,
        values,
        certified,
    )


@dataclass(frozen=True)
class _Round:
    """The doubling rounds' outcome for ``n`` heads: the substituted entries ``tok`` ``[n, S]``, whether every cell
    of the head is under the threshold (``under`` ``[n]``, and on the host ``under_host``), the last round's served
    distribution, certificates, logits and radii, the blocks substituted and the exact entries paged (``n_exact``)."""

    tok: torch.Tensor
    under: torch.Tensor
    under_host: list[bool]
    pm: torch.Tensor
    cert: torch.Tensor
    raw: torch.Tensor
    logits: torch.Tensor
    radii: torch.Tensor
    blocks: torch.Tensor
    n_exact: int
    short_host: list[bool] | None = None  # per head: stopped at the planned limit, not under (run again with more)

    def replaced(self, rows: torch.Tensor, other: _Round) -> _Round:
        """This outcome with the heads ``rows`` replaced by ``other``'s (their rounds run again from the start)."""
        names = ("tok", "under", "pm", "cert", "raw", "logits", "radii", "blocks")
        tensors = {name: getattr(self, name).index_copy(0, rows, getattr(other, name)) for name in names}
        under = list(self.under_host)
        for i, ok in zip(rows.tolist(), other.under_host, strict=True):
            under[i] = ok
        return _Round(under_host=under, n_exact=self.n_exact + other.n_exact, **tensors)

    def with_rows(self, rows: torch.Tensor, other: _Round) -> _Round:
        """This outcome with the heads ``rows`` taken from ``other`` (their substituted entries added to ours: the
        second rounds substitute over the first's)."""
        tensors = {
            name: getattr(self, name).index_copy(0, rows, getattr(other, name))
            for name in ("under", "pm", "cert", "raw", "logits", "radii", "blocks")
        }
        under = list(self.under_host)
        for i, ok in zip(rows.tolist(), other.under_host, strict=True):
            under[i] = ok
        tok = self.tok.index_copy(0, rows, self.tok[rows] | other.tok)
        return _Round(tok=tok, under_host=under, n_exact=self.n_exact + other.n_exact, **tensors)


@dataclass(frozen=True)
class _Rounds:
    """The doubling rounds of one read's repaired heads (module docstring, steps 1–3): queries ``q[n, M, D]``, their
    visibility ``m``, the gate, whether the fused row kernel evaluates them, the host tier's K and V (``hosts``) and
    the heads as (row, KV head) ``pairs``."""

    q: torch.Tensor
    m: torch.Tensor
    scaling: float
    gate: Gate
    fused: bool
    hosts: tuple[torch.Tensor, torch.Tensor]
    pairs: list[tuple[int, int]]

    def subset(self, rows: list[int]) -> _Rounds:
        """The same rounds over the heads ``rows`` only."""
        j = torch.tensor(rows, device=self.q.device)
        return _Rounds(
            self.q[j], self.m[j], self.scaling, self.gate, self.fused, self.hosts, [self.pairs[i] for i in rows]
        )

    def paged(self, tensor: int, device: torch.device) -> torch.Tensor | None:
        """The heads' slices of the host tier's ``tensor`` (0: K, 1: V) paged to ``device``; ``None`` where
        :func:`_mix` copies in place (CPU)."""
        return None if _in_place(device, self.hosts) else _page(self.hosts[tensor], self.pairs, device)

    def _order(
        self, radii: torch.Tensor, p: torch.Tensor, pageable: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rank [n, nb], k_first [n], k_meter [n])``: each block's place in the order of the rounds (descending
        largest contribution over the cells, stable), the prefix the rounds try first and the meter's predicted
        prefix (module docstring, steps 1–2)."""
        gate = self.gate
        n, rows, s = p.shape
        bs = gate.block_size
        nb = (s + bs - 1) // bs
        contrib = block_contributions(p, torch.where(pageable.unsqueeze(1), radii, 0.0), bs)  # [n, M, nb]
        order = torch.argsort(contrib.amax(1), dim=-1, descending=True, stable=True)  # [n, nb]
        ordered = torch.gather(contrib, 2, order.unsqueeze(1).expand(n, rows, nb))
        remaining = contrib.sum(-1, keepdim=True) - ordered.cumsum(-1)  # [n, M, nb]
        predicted = 0.5 * ((1.0 + remaining.clamp(min=0)) ** 2 - 1.0)  # [n, M, nb]

        def first_under(level: float) -> torch.Tensor:  # per head, the shortest prefix predicted under ``level``
            ok = (predicted <= level).all(1)
            return torch.where(ok.any(-1), ok.to(torch.int64).argmax(-1) + 1, nb)

        k_meter = first_under(gate.threshold)
        # a box gate tries first the prefix predicted under twice the threshold (to first order in the radii the
        # e-form is Σ p̃ c and the box supremum half of it where the radii are even, tanh(c/2) against c), then the
        # meter's prefix, then doubles as the meter's gate does: any prefix where the meter certifies the box
        # certifies too, so it never pages more blocks than the meter's gate (one round more at most)
        k = first_under(2.0 * gate.threshold) if gate.box else k_meter
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(nb, device=p.device).expand(n, nb))
        return rank, k, k_meter

    def first_plan(
        self, radii: torch.Tensor, p: torch.Tensor, pageable: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(limit [n], planned [n, S])``: the blocks an upgrade repair plans first, :data:`PLAN_ROUNDS` doublings
        past the meter's predicted prefix and at least :data:`PLAN_MIN_BLOCKS` (the rounds of most heads end within
        them), and the ``pageable`` entries of each head's first ``limit`` blocks in the rounds' order."""
        rank, k, k_meter = self._order(radii, p, pageable)
        limit = torch.maximum(torch.maximum(k, k_meter) * 2**PLAN_ROUNDS, torch.full_like(k, PLAN_MIN_BLOCKS))
        s = p.shape[-1]
        planned = (rank < limit.unsqueeze(-1)).repeat_interleave(self.gate.block_size, -1)[:, :s] & pageable
        return limit, planned

    def run(
        self,
        keys: torch.Tensor,
        radii: torch.Tensor,
        p: torch.Tensor,
        pageable: torch.Tensor,
        sub_keys: torch.Tensor | None = None,
        sub_radii: torch.Tensor | None = None,
        limit: torch.Tensor | None = None,
    ) -> _Round:
        """Substitute blocks of the ``pageable[n, S]`` entries into the read of ``keys[n, S, D]`` at ``radii[n, M,
        S]`` (served distribution ``p``), in order of their contributions, doubling the prefix until every cell is
        under the threshold or every block is substituted: by ``sub_keys`` at ``sub_radii`` (upgraded codes), or
        without them by the exact entries at radius 0. With ``limit[n]`` (blocks) a head whose next prefix would be
        longer stops there, not under, flagged in :attr:`_Round.short_host` (its substitutes were planned only for
        the first ``limit`` blocks)."""
        gate = self.gate
        n, _, s = p.shape
        bs = gate.block_size
        nb = (s + bs - 1) // bs
        rank, k, k_meter = self._order(radii, p, pageable)
        short = torch.zeros(n, dtype=torch.bool, device=p.device)
        substituted = keys.clone() if sub_keys is None else keys  # the exact entries are written into the copy
        host_keys = self.paged(0, keys.device) if sub_keys is None else None
        checks = Checks()
        while True:
            if limit is not None:  # a prefix past the planned blocks is not evaluated: that head runs again
                short = short | (k.clamp(max=nb) > limit)
                k = torch.where(short, torch.minimum(k, limit), k)
            tok = (rank < k.unsqueeze(-1)).repeat_interleave(bs, -1)[:, :s] & pageable  # the first k blocks in order
            if sub_keys is None:
                mixed = _mix(substituted, self.hosts[0], host_keys, tok, self.pairs)
                r = torch.where(tok.unsqueeze(1), 0.0, radii)
            else:
                assert sub_radii is not None
                mixed = torch.where(tok.unsqueeze(-1), sub_keys, keys)
                r = torch.where(tok.unsqueeze(1), sub_radii, radii)
            logits = (self.q @ mixed.transpose(-1, -2) * self.scaling).masked_fill(~self.m, float("-inf"))
            with deferred(checks):  # the meter's fail-closed checks come back with the round's decision
                pm, cert, raw = repaired_read(logits, r, self.fused)
                if gate.box:
                    cert = box_refined(pm, r, cert, gate.threshold, numba_box.rows_for(p.device))
            under = ((raw if gate.uses_unclipped else cert) <= gate.threshold).all(-1)
            done = under | (k >= nb) | short
            back = checks.read_back([done.all(), tok.sum(), under, short])  # one synchronisation per doubling round
            assert back is not None  # no guard: None is never returned
            all_done, n_tok, *flags = back
            if all_done:
                n_exact = n_tok if sub_keys is None else 0
                under_list, short_list = [bool(x) for x in flags[:n]], [bool(x) for x in flags[n:]]
                cut = k.clamp(max=nb)
                return _Round(tok, under, under_list, pm, cert, raw, logits, r, cut, n_exact, short_list)
            k = torch.where(done, k, torch.where(k < k_meter, k_meter, 2 * k))


#: an upgrade repair first plans the light entries of the blocks up to this many doublings past the meter's
#: predicted prefix (:meth:`_Rounds.first_plan`), and at least :data:`PLAN_MIN_BLOCKS` blocks
PLAN_ROUNDS = 2
PLAN_MIN_BLOCKS = 16


@dataclass(frozen=True)
class _Upgrades:
    """Every light entry of the repaired heads as an upgrade repair would store it (:meth:`LayerStore.plan_upgrade`):
    the served keys and values with the light entries replaced by their new codes' decode (``k``, ``v`` ``[n, S, D]``),
    the value residual norms with theirs (``v_res`` ``[n, S]``), the Tier-A radii of the new keys in every cell
    (``radii`` ``[n, M, S]``, from their witnesses) and the plans themselves, one per head."""

    k: torch.Tensor
    v: torch.Tensor
    v_res: torch.Tensor
    radii: torch.Tensor
    plans: list[UpgradePlan]

    @classmethod
    def of(
        cls,
        store: LayerStore,
        pairs: list[tuple[int, int]],
        light: torch.Tensor,
        khat: torch.Tensor,
        vhat: torch.Tensor,
        vres: torch.Tensor,
        key_radii: KeyRadii | None,
        heads: tuple[torch.Tensor, torch.Tensor],
    ) -> _Upgrades:
        """Plan every light entry of ``pairs`` (``light[n, S]``) over the served ``khat``, ``vhat`` and ``vres``."""
        assert key_radii is not None, "upgrade repair needs the key radii of the new codes"
        k, v, v_res = khat.clone(), vhat.clone(), vres.clone()
        band = store.k_band.view()[heads].clone()
        hat_norm, wit = store.k_hat_norm.view()[heads].clone(), store.k_wit.view()[heads].clone()
        plans = [store.plan_upgrade(b, h, light[j].cpu()) for j, (b, h) in enumerate(pairs)]
        for j, plan in enumerate(plans):
            for part in plan.parts:
                on = part.slots.to(k.device)
                if part.is_key:
                    k[j, on] = part.xhat
                    band[j, on] = part.witnesses["k_band"]
                    hat_norm[j, on] = part.witnesses["k_hat_norm"]
                    wit[j, on] = part.witnesses["k_wit"]
                else:
                    v[j, on] = part.xhat
                    v_res[j, on] = part.witnesses["v_res"]
        return cls(k, v, v_res, key_radii(heads, band, hat_norm, wit), plans)

    def replaced(self, rows: list[int], other: _Upgrades) -> _Upgrades:
        """These upgrades with the heads ``rows`` replaced by ``other``'s (planned again, every light entry)."""
        j = torch.tensor(rows, device=self.k.device)
        plans = list(self.plans)
        for i, plan in zip(rows, other.plans, strict=True):
            plans[i] = plan
        k, v, v_res, radii = (
            mine.index_copy(0, j, theirs)
            for mine, theirs in zip(
                (self.k, self.v, self.v_res, self.radii), (other.k, other.v, other.v_res, other.radii), strict=True
            )
        )
        return _Upgrades(k, v, v_res, radii, plans)


def _light(store: LayerStore, pairs: list[tuple[int, int]], s: int, dev: torch.device) -> torch.Tensor:
    """``[n, S]`` bool: the keys of each (row, KV head) of ``pairs`` served from light codes (neither exact nor in the
    wide codes: upgraded, or stored heavy by token tiers); all True without upgrade codecs (every entry may be paged
    in)."""
    if store.upgrade is None:
        return torch.ones(len(pairs), s, dtype=torch.bool, device=dev)
    return torch.stack([store.light(b, h, is_key=True) for b, h in pairs]).to(dev)


def _in_place(dev: torch.device, hosts: tuple[torch.Tensor, ...]) -> bool:
    """Whether the read's device and the host tier are both the CPU: then :func:`_mix` copies only the paged
    tokens' entries; elsewhere each gated head's host slice is paged to the device once (:func:`_page`)."""
    return dev.type == "cpu" and all(x.device.type == "cpu" for x in hosts)


def _page(host: torch.Tensor, pairs: list[tuple[int, int]], dev: torch.device) -> torch.Tensor:
    """``[n, S, D]`` float32 on ``dev``: each (row, KV head) of ``pairs``' slice of the (pinned) host tier
    (asynchronous copies)."""
    return torch.stack([host[b, h].to(dev, non_blocking=True) for b, h in pairs]).to(torch.float32)


def _mix(
    served: torch.Tensor,
    host: torch.Tensor,
    paged: torch.Tensor | None,
    tok: torch.Tensor,
    pairs: list[tuple[int, int]],
) -> torch.Tensor:
    """``where(tok[..., None], exact, served)`` for the heads of ``pairs``, ``served[n, S, D]`` a copy the caller
    owns: from the paged host slices ``paged`` when given, else (CPU) by writing the host tier's float32 entries
    of the tokens of ``tok`` into ``served`` itself (the same elements; ``tok`` only grows between the doubling
    rounds, so a later round overwrites what an earlier one wrote with the same values)."""
    if paged is not None:
        return torch.where(tok.unsqueeze(-1), paged, served)
    for i, (b, h) in enumerate(pairs):
        served[i, tok[i]] = host[b, h, tok[i]].to(torch.float32)
    return served
