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

With upgrade codecs (``LayerStore.upgrade``, ``docs/read-path.md#upgrade-repair``) only entries still at their
first codes are paged in, and the rounds give the paged entries the radius ``scale·c`` (``scale`` from
:func:`_upgrade_scale`, an estimate of the upgraded radius) instead of 0, so the prefix is sized for the reads after
this one; a head no prefix passes that way pages in every entry (radius 0) and keeps nothing. With ``partial`` radii
(a Tier-B gate's ``min(c, u)``) the rounds' certificate is the partial bound, and the meter over ``c`` is returned
beside it.

The meter of the recomputed read is the certificate of what is served (paged tokens have radius 0, the others
keep their radii, which bound their logit errors whatever the other tokens are). On the numba backend its softmax
and meter are the decode read's fused row kernel (:func:`kvcert.kernels.numba_read.softmax_meter`, with that
kernel's rounding allowance, ``docs/math.md#kernel-rounding``), elsewhere the eager forms (:func:`repaired_read`).
The host tier's K/V of the gated heads are paged to the device once, head by head from the host tier's slices
(pinned memory beside a GPU: asynchronous copies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.bounds.softmax_tv import probs64, served_meter
from kvcert.bounds.tv_box import box_refined
from kvcert.cache.gate import Gate
from kvcert.cache.store import LayerStore
from kvcert.checks import Checks, deferred
from kvcert.kernels import active, numba_box
from kvcert.kernels.numba_read import softmax_meter

__all__ = ["BlockRepairs", "block_contributions", "repair_blocks", "repaired_read"]


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
    n_tokens: int
    upgraded: torch.Tensor  # [n] bool, sized for upgrade codecs (False: paged everything it needed exact)
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
) -> BlockRepairs:
    """Page in token blocks of every (row, KV head) with ``need[B, Hkv]`` until each of its cells is under
    ``gate.threshold`` (see the module docstring). ``pairs``: the same heads on the host, ``need.nonzero()`` as
    ``(row, KV head)`` pairs in row-major order (the caller's read-back of its decision; no sync here).
    ``qg[B, Hkv, M, D]`` float32 grouped queries, ``mask[B, Hkv, M, S]`` visibility, ``c`` / ``p`` ``[B, Hkv, M, S]``
    the read's radii and served distribution. Persistent gates keep the paged entries exact within the store's
    device budget (:meth:`LayerStore.persist`). ``partial`` (``[B, Hkv, M, S]``, ``<= c``; a Tier-B gate's
    ``min(c, u)``): the radii the rounds take instead of ``c``, so their certificate is the partial bound; the meter of
    the last round over ``c`` (paged entries 0) is then returned as :attr:`BlockRepairs.certified`.
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
    hosts = store.k.host.view(), store.v.host.view()
    hk, hv = (None, None) if _in_place(dev, hosts) else (_page(hosts[0], pairs, dev), _page(hosts[1], pairs, dev))
    vres = store.v_res.view()[bi, hi]
    q, m, cc, pp = qg[bi, hi], mask[bi, hi], (c if partial is None else partial)[bi, hi], p[bi, hi]
    n, rows, s = pp.shape
    bs = gate.block_size
    nb = (s + bs - 1) // bs
    # upgrade repair: only entries still at their first codes are paged in; the rounds size the prefix as if they were
    # served at the upgrade codec's radii (scale·c), so that the reads after this one pass on the upgraded codes
    scale = torch.full((n,), _upgrade_scale(store), dtype=cc.dtype, device=dev)
    light = _light(store, pairs, s, dev)  # [n, S] (all True without upgrade codecs)
    contrib = block_contributions(pp, torch.where(light.unsqueeze(1), cc, 0.0), bs)  # [n, M, nb]
    order = torch.argsort(contrib.amax(1), dim=-1, descending=True, stable=True)  # [n, nb]
    ordered = torch.gather(contrib, 2, order.unsqueeze(1).expand(n, rows, nb))
    remaining = contrib.sum(-1, keepdim=True) - ordered.cumsum(-1)  # [n, M, nb]
    predicted = 0.5 * ((1.0 + remaining.clamp(min=0)) ** 2 - 1.0)  # [n, M, nb]

    def first_under(level: float) -> torch.Tensor:  # per head, the shortest prefix predicted under ``level``
        ok = (predicted <= level).all(1)
        return torch.where(ok.any(-1), ok.to(torch.int64).argmax(-1) + 1, nb)

    k_meter = first_under(gate.threshold)
    # a box gate tries first the prefix predicted under twice the threshold (to first order in the radii the e-form
    # is Σ p̃ c and the box supremum half of it where the radii are even, tanh(c/2) against c), then the meter's
    # prefix, then doubles as the meter's gate does: any prefix where the meter certifies the box certifies too, so it
    # never pages more blocks than the meter's gate (one round more at most)
    k = first_under(2.0 * gate.threshold) if gate.box else k_meter
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(nb, device=dev).expand(n, nb))
    fused = active(dev) == "numba"
    checks = Checks()
    while True:
        tok = (rank < k.unsqueeze(-1)).repeat_interleave(bs, -1)[:, :s]  # [n, S] the first k blocks in order
        tok &= light | (scale == 0).unsqueeze(-1)
        kmix = _mix(khat, hosts[0], hk, tok, pairs)
        logits = (q @ kmix.transpose(-1, -2) * scaling).masked_fill(~m, float("-inf"))
        paged = torch.where(scale.view(n, 1, 1) > 0, scale.view(n, 1, 1) * cc, 0.0)  # >= 0 (their true radius)
        radii = torch.where(tok.unsqueeze(1), paged, cc)
        with deferred(checks):  # the meter's fail-closed checks come back with the round's decision
            pm, cert, raw = repaired_read(logits, radii, fused)
            if gate.box:
                cert = box_refined(pm, radii, cert, gate.threshold, numba_box.rows_for(dev))
        under = ((raw if gate.uses_unclipped else cert) <= gate.threshold).all(-1)
        done = under | ((k >= nb) & (scale == 0))
        back = checks.read_back([done.all(), tok.sum()])  # one synchronisation per doubling round
        assert back is not None  # no guard: None is never returned
        all_done, n_tokens = back
        if all_done:
            break
        last = ~done & (k >= nb)  # every block at the upgrade radii and still over: page in everything, radius 0
        scale = torch.where(last, 0.0, scale)
        k = torch.where(done | last, k, torch.where(k < k_meter, k_meter, 2 * k))
    if gate.persistent:  # kept within the store's device budget, else a transient page-in
        kept = (scale > 0).tolist() if store.upgrade is not None else [True] * n  # never upgrade a whole failing head
        store.persist_heads(
            [pr for pr, y in zip(pairs, kept, strict=True) if y],
            [t for t, y in zip(tok.unbind(0), kept, strict=True) if y],
        )
    certified = None
    if partial is not None:  # the same served read under the Tier-A radii (a certified bound)
        certified = repaired_read(logits, torch.where(tok.unsqueeze(1), 0.0, c[bi, hi]), fused)[1]
    out = pm.to(torch.float32) @ _mix(vhat, hosts[1], hv, tok, pairs)
    v_res = torch.where(tok, 0.0, vres)
    return BlockRepairs(heads, out, cert, raw, pm, v_res, tok, k.clamp(max=nb), n_tokens, scale > 0, certified)


def _upgrade_scale(store: LayerStore) -> float:
    """The factor the doubling rounds apply to the radii of the paged entries: 0 without upgrade codecs (paged entries
    are kept exact); with them, ``(2^b − 1)/(2^b' − 1)`` for key codecs of ``b`` and ``b'`` bits, the ratio of their
    rounding steps over the same range: an estimate of the radius an upgraded entry will have, used to size the
    prefix only. The read itself serves the paged entries exact (radius 0 <= the scaled one), so its certificate
    holds whatever the estimate."""
    if store.upgrade is None:
        return 0.0
    return (2.0**store.key_codec.bits - 1.0) / (2.0 ** store.upgrade[0].bits - 1.0)


def _light(store: LayerStore, pairs: list[tuple[int, int]], s: int, dev: torch.device) -> torch.Tensor:
    """``[n, S]`` bool: the keys of each (row, KV head) of ``pairs`` still served from their first codes (neither
    exact nor upgraded); all True without upgrade codecs (every entry may be paged in)."""
    if store.upgrade is None:
        return torch.ones(len(pairs), s, dtype=torch.bool, device=dev)
    assert store.k is not None
    exact = store.k.exact.view()
    return torch.stack([~exact[b, h].cpu() & ~store.k.upgraded(b, h, s, store.base) for b, h in pairs]).to(dev)


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
