"""The value gate of a certified read (``Gate.certified(tau, value_rel=ν)``, ``docs/read-path.md#value-upgrades``).

A key gate bounds the TV of the served distribution; the output bound's *value term* ``Σ_t p̃_t‖Δv_t‖`` (the error
the stored values may add to the output, whatever the keys) is bounded by nothing unless a gate acts on it. The value
gate serves every cell of a read with

    Σ_t p̃_t‖Δv_t‖ <= ν · spread,     spread = max_t (‖v̂_t − c‖ + ‖Δv_t‖)

(the same spread as the key term ``2·TV·spread``, so ``ν`` is on the scale of the key gate's ``2τ``), for the KV heads
the key gate did not already serve exact. A head above it:

1. ranks the entries that carry value error by ``max_cells p̃_t‖Δv_t‖``, descending (what it served: a head the
   key gate block-repaired starts from the values that repair served);
2. first guess: the shortest prefix whose residuals set to 0 bring every cell under the tolerance (no repair of
   fewer entries passes);
3. serves the prefix repaired: its light values (:meth:`LayerStore.light`, not substituted by this read's key repair)
   from their upgraded codes (:meth:`LayerStore.plan_upgrade` with ``keys=False``: the upgrade value codec's codes
   from the exact originals, their decode and residual witnesses), the others (heavy, upgraded before, or every
   entry of a store without upgrade codecs) exact from the host tier; recomputes every cell's value term with the
   new residuals and doubles the prefix until every cell is under or every ranked entry is repaired;
4. if a cell is still above (the upgraded values' own error), the shortest prefix of the upgraded entries by
   ``max_cells p̃_t‖Δv'_t‖`` that passes is served exact instead (every one of them exact passes);
5. a persistent gate keeps the upgraded codes (:meth:`LayerStore.commit_upgrade`, within the device budget); exact
   values are served for the read only.

Soundness does not depend on the choice: the bound reported is the output bound of what is served, with the value
term over the served residuals (the new codes' witnesses bound their residuals) and ``vmax`` raised to the upgraded
values' norms where they exceed it. The traffic is the new codes' and witnesses' measured bytes plus the exact values'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.cache.store import LayerStore, UpgradePlan

__all__ = ["ServedValues", "ValueRepairs", "gate_values"]


@dataclass(frozen=True)
class ServedValues:
    """What a read serves for ``n`` (row, KV head) pairs before the value gate: the distribution ``p [n, M, S]``
    (float64), the values ``values [n, S, Dv]`` (float32), their residual witnesses ``v_res [n, S]`` and the entries a
    key repair substituted (``subst [n, S]`` bool: exact or upgraded at this read)."""

    p: torch.Tensor
    values: torch.Tensor
    v_res: torch.Tensor
    subst: torch.Tensor


@dataclass(frozen=True)
class ValueRepairs:
    """The value gate's outcome per head of its pairs: the served output ``out [n, M, Dv]`` float32, the value term
    ``value_term [n, M]`` (float64, over the served residuals), ``vmax [n]`` (a bound on the norms of every exact
    and served value of the head), ``exact [n]`` (some values served exact), ``upgraded_heads [n]`` (some values
    upgraded), ``upgraded`` (values upgraded, all heads) and ``nbytes`` (the traffic: new codes and witnesses, exact
    values)."""

    out: torch.Tensor
    value_term: torch.Tensor
    vmax: torch.Tensor
    exact: list[bool]
    upgraded_heads: list[bool]
    upgraded: int
    nbytes: int


def _prefix(p: torch.Tensor, r: torch.Tensor, order: torch.Tensor, tol: float) -> int:
    """The shortest prefix of ``order`` whose residuals set to 0 bring ``Σ_t p_t r_t`` under ``tol`` in every cell
    (``len(order)`` if none): no repair of fewer entries can pass, and serving that prefix exact passes."""
    contrib = p[:, order] * r[order]  # [M, K]
    left = (p @ r).unsqueeze(-1) - contrib.cumsum(-1)
    fits = (left <= tol).all(0).nonzero()
    return int(fits[0]) + 1 if len(fits) else len(order)


def _ranked(p: torch.Tensor, r: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """The entries of ``cand`` that carry value error (``max_cells p_t r_t > 0``), largest first (stable)."""
    score = torch.where(cand, (p * r).amax(0), 0.0)
    return torch.argsort(score, descending=True, stable=True)[: int((score > 0).sum())]


@dataclass
class _Head:
    """One head's value repair as the rounds leave it: the served values and residuals, the upgrade plan of its light
    entries (``None``: none) and the entries served exact from the host tier."""

    values: torch.Tensor  # [S, Dv] float32
    res: torch.Tensor  # [S] float64
    plan: UpgradePlan | None
    exact: torch.Tensor  # [S] bool


def _repair_head(store: LayerStore, b: int, h: int, sv: ServedValues, i: int, tol: float) -> _Head:
    """Steps 1–4 of the module docstring for pair ``i`` = (row ``b``, KV head ``h``)."""
    assert store.v is not None
    p, r, host = sv.p[i], sv.v_res[i].to(torch.float64), store.v.host.view()[b, h]
    light = (store.light(b, h, is_key=False).to(p.device) & ~sv.subst[i]) if store.upgrade is not None else None
    order = _ranked(p, r, torch.ones_like(sv.subst[i]))
    k = _prefix(p, r, order, tol)
    while True:  # the prefix's light entries upgraded, the others exact; doubled until every cell passes
        head = _serve(store, b, h, sv, i, order[:k], light, host)
        if bool((p @ head.res <= tol).all()) or k >= len(order):
            break
        k = min(2 * k, len(order))
    if not bool((p @ head.res <= tol).all()):  # every entry with error repaired: the upgraded ones' left, exact next
        rest = _ranked(p, head.res, ~head.exact)
        n = _prefix(p, head.res, rest, tol)
        while True:  # one more at a time only if the recomputed sum rounds above where the prefix's did
            more = rest[:n]
            head.exact[more] = True
            head.values[more] = host[more.to(host.device)].to(head.values.device, torch.float32)
            head.res[more] = 0.0
            if bool((p @ head.res <= tol).all()) or n >= len(rest):
                break
            n += 1
        if head.plan is not None:
            keep = ~head.exact.cpu()
            kept = head.plan.subset(keep)
            head.plan = kept if kept.parts else None
    return head


def _serve(
    store: LayerStore,
    b: int,
    h: int,
    sv: ServedValues,
    i: int,
    chosen: torch.Tensor,
    light: torch.Tensor | None,
    host: torch.Tensor,
) -> _Head:
    """The head served with the ``chosen`` entries repaired: light ones (``light``; none without upgrade codecs)
    from their upgraded codes (:meth:`LayerStore.plan_upgrade`, values only), the others exact."""
    values, res = sv.values[i].clone(), sv.v_res[i].to(torch.float64).clone()
    pick = torch.zeros(res.shape[-1], dtype=torch.bool, device=res.device)
    pick[chosen] = True
    up = pick & light if light is not None else torch.zeros_like(pick)
    plan = None
    if bool(up.any()):
        plan = store.plan_upgrade(b, h, up.cpu(), keys=False)
        for part in plan.parts:
            on = part.slots.to(values.device)
            values[on] = part.xhat.to(values.dtype)
            res[on] = part.witnesses["v_res"].to(res.device, torch.float64)
    exact = pick & ~up
    values[exact] = host[exact.to(host.device)].to(values.device, torch.float32)
    res[exact] = 0.0
    return _Head(values, res, plan, exact)


def gate_values(
    store: LayerStore,
    pairs: list[tuple[int, int]],
    sv: ServedValues,
    tol: torch.Tensor,
    vmax: torch.Tensor,
    persistent: bool,
) -> ValueRepairs:
    """Serve the heads of ``pairs`` (each with a cell above its tolerance ``tol[n]``, ``ν·spread``) with every cell's
    value term under ``tol`` (module docstring). ``vmax[n]``: the read's bound on the heads' value norms (raised where
    an upgraded value exceeds it)."""
    assert store.v is not None
    itemsize = store.v.host.dtype.itemsize
    outs, terms, vmaxes, exact, up_heads = [], [], [], [], []
    upgraded = nbytes = 0
    for i, (b, h) in enumerate(pairs):
        head = _repair_head(store, b, h, sv, i, float(tol[i]))
        top = float(vmax[i])
        if head.plan is not None:
            nbytes += head.plan.nbytes
            for part in head.plan.parts:
                upgraded += len(part.slots)
                top = max(top, float(part.witnesses["v_hat_norm"].max()))
            if persistent:
                store.commit_upgrade(head.plan)
        n_exact = int(head.exact.sum())
        nbytes += n_exact * head.values.shape[-1] * itemsize
        outs.append(sv.p[i].to(torch.float32) @ head.values)
        terms.append(sv.p[i] @ head.res)
        vmaxes.append(top)
        exact.append(n_exact > 0)
        up_heads.append(head.plan is not None)
    dev = sv.p.device
    vm = torch.tensor(vmaxes, dtype=torch.float64, device=dev)
    return ValueRepairs(torch.stack(outs), torch.stack(terms), vm, exact, up_heads, upgraded, nbytes)
