"""Shared scorer interface for eviction policies (``docs/eviction.md#eviction-interface``): per-item scores + protected
set -> top-C.

Every policy is a *scorer*: it keeps a float64 score per cached item (per layer, batch row, KV head)
and a rule for which items are protected (sinks, recent window / commit lag). Selection is shared:

    keep = the ``C`` items with the highest key, where key = +inf for protected items, else the score;
    ties are broken deterministically by physical index (the lower index, i.e. the older item, wins,
    because physical order equals logical order: kept indices are always returned sorted).

Two modes, one interface:

- **decode budget**: ``observe`` each attention read, ``set_kappa`` when the step's correctness weight
  arrives (after the logits), ``select(layer, budget, chunk)`` -> sorted physical indices ``[B, Hkv, C]`` to
  keep (``None`` while the layer holds at most ``budget`` items), then ``on_evict(layer, keep)`` after the
  cache gathered the same indices. Every KV head of a layer keeps the same count (storage stays
  rectangular); each head chooses its own items. Once the layer holds more than ``budget`` items, ``select``
  keeps ``C = budget − chunk + 1``: ``chunk = 1`` brings it back to exactly ``budget`` at every step; a larger
  ``chunk`` evicts ``chunk`` items at once, so selection (and the cache's gather) runs once every ``chunk``
  decode steps, as kvpress's ``DecodingPress`` compresses every ``compression_interval`` steps. The budget
  holds after each ``select`` either way; the next read sees ``<= budget + q`` items.
- **prefill compression** (kvpress convention): ``prefill_keep(layer, keys, values, ratio, ...)`` keeps
  ``prefill_kept_count(S, ratio)`` items per KV head.

Attention passed to ``observe`` is already aggregated over the ``G`` query heads of each KV head
(``aggregate_gqa``: ``"mean"`` = sum / G, a distribution, used by traces and the mass readings; ``"sum"``
ranks identically; ``"max"`` is the per-item maximum over the group and is not a distribution).

Per-step cost in decode: a layer's scores and positions live in capacity buffers that grow by doubling, so
``observe`` writes only the appended slots and adds the new rows into the scores in place; ``select`` costs
nothing until the budget is exceeded and then picks the ``k`` lowest keys by ``argmin`` (``k <= 8``) or by a
``kthvalue`` threshold, never a sort. When the protected set is exactly the first ``sinks`` and the last
``recent`` slots (checked on the positions; always the case inside the cache) only the slots in between are
scored, without building a protected mask.

Devices: the state lives in torch tensors on the device of the attention the policy observes (the cache's
device tier). On a CPU tensor the per-step bookkeeping runs in numpy / numba over zero-copy views of those
tensors (their per-call cost is a fraction of torch's); on any other device the same steps run as torch
operations on that device (``_host`` picks; ``HOST_KERNELS = False`` forces the torch operations on CPU too,
which the tests use to show both give identical kept sets and bit-identical scores). The device path
synchronises with the host once per ``observe`` (the fail-closed input checks, fused into one reduction),
once per ``select`` past the budget (whether the protected set is the edge slots) plus the budget check of
the generic path, and once per ``set_kappa`` (its range check, and RMM's query-position match over all
layers in one reduction); selection itself (``argmin`` picks, the complement, the ``kthvalue`` mask) makes no
data-dependent host decision there.
"""

from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

import numba
import numpy as np
import torch
from torch import Tensor

from kvcert.evict.prefill_attention import EVERY_ROW, PrefillAttention, PrefillReads

GqaAggregation = Literal["sum", "mean", "max"]
F64 = torch.float64

#: run the per-step bookkeeping of CPU states in numpy / numba (False: torch operations on every device)
HOST_KERNELS = True


def _host(x: Tensor) -> bool:
    """Whether ``x``'s state is served by the numpy / numba kernels (a CPU tensor while ``HOST_KERNELS``)."""
    return HOST_KERNELS and x.is_cpu


def aggregate_gqa(attn: Tensor, n_kv_heads: int, how: GqaAggregation = "mean") -> Tensor:
    """Aggregate ``attn[B, Hq, q, S]`` over the ``G = Hq / Hkv`` query heads of each KV head.

    Returns ``[B, Hkv, q, S]``.

    Query head ``h`` belongs to KV head ``h // G`` (transformers' ``repeat_kv`` layout).
    """
    if attn.dim() != 4:
        raise ValueError(f"attn must be [B, Hq, q, S], got shape {tuple(attn.shape)}")
    if n_kv_heads <= 0 or attn.shape[1] % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide the {attn.shape[1]} query heads")
    b, hq, q, s = attn.shape
    grouped = attn.reshape(b, n_kv_heads, hq // n_kv_heads, q, s)
    if how == "sum":
        return grouped.sum(2)
    if how == "mean":
        return grouped.mean(2)
    if how == "max":
        return grouped.amax(2)
    raise ValueError(f"how must be 'sum', 'mean' or 'max', got {how!r}")


def prefill_kept_count(seq_len: int, ratio: float) -> int:
    """Items kept when compressing ``seq_len`` items by ``ratio`` (fraction removed, kvpress convention).

    Rule: ``removed = floor(ratio · S + 1e-9)`` (the tolerance absorbs float noise such as ``0.3 · 10``),
    ``kept = S − removed``, i.e. ``ceil((1 − ratio) · S)`` up to that tolerance. ``ratio ∈ [0, 1)``.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if not (0.0 <= ratio < 1.0) or math.isnan(ratio):
        raise ValueError(f"ratio (compression_ratio) must be in [0, 1), got {ratio}")
    return seq_len - math.floor(ratio * seq_len + 1e-9)


def causal_attention(queries: Tensor, keys: Tensor) -> Tensor:
    """Causal softmax attention ``[B, Hq, S, S]`` (float64) of ``queries[B, Hq, S, D]`` over
    ``keys[B, Hkv, S, D]``.

    Scale ``1/sqrt(D)``; query head ``h`` reads KV head ``h // G``. Used when a prefill caller has no
    eager attention weights.
    """
    if queries.dim() != 4 or keys.dim() != 4 or queries.shape[-1] != keys.shape[-1]:
        raise ValueError(
            f"queries [B,Hq,S,D] and keys [B,Hkv,S,D] disagree: {tuple(queries.shape)}, {tuple(keys.shape)}"
        )
    if queries.shape[1] % keys.shape[1] or queries.shape[2] != keys.shape[2]:
        raise ValueError("queries must have a multiple of the KV heads and the same length S as keys")
    g = queries.shape[1] // keys.shape[1]
    k = keys.to(F64).repeat_interleave(g, dim=1)
    logits = queries.to(F64) @ k.transpose(-1, -2) / math.sqrt(queries.shape[-1])
    s = queries.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool, device=queries.device).triu(1)
    return torch.softmax(logits.masked_fill(mask, -math.inf), dim=-1)


def _check_prefill_kv(keys: Tensor, values: Tensor) -> None:
    """``ValueError`` unless ``keys`` and ``values`` are ``[B, Hkv, S, D]`` alike (a prefill's K/V)."""
    if keys.dim() != 4 or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"keys/values must be [B, Hkv, S, D] alike, got {tuple(keys.shape)}, {tuple(values.shape)}")


def _too_small(budget: int, n_protected: int) -> ValueError:
    return ValueError(
        f"budget={budget} (items kept after an eviction) is smaller than the {n_protected} protected items "
        "(sinks + recent/lag)"
    )


def _lowest(key: Tensor, k: int) -> Tensor:
    """Sorted indices ``[..., k]`` (int64, on ``key``'s device) of the ``k`` lowest keys; among equal keys the
    higher index goes first.

    ``argmin`` picks, ``O(k·S)``, for small ``k``, on a reversed view (``argmin`` returns the first minimum, i.e.
    the highest original index). CPU keys are picked in numpy (no copy; one call costs a fraction of torch's),
    others by the same picks in torch on their device.
    """
    if _host(key):
        return torch.from_numpy(_lowest_np(key.numpy(), k))
    last = key.shape[-1] - 1
    flipped = key.flip(-1)
    if k == 1:
        return last - flipped.argmin(-1, keepdim=True)
    work, picks = flipped.clone(), []
    for _ in range(k):
        idx = work.argmin(-1, keepdim=True)
        picks.append(last - idx)
        work.scatter_(-1, idx, math.inf)
    return torch.cat(picks, -1).sort(-1).values


def _lowest_np(key: np.ndarray, k: int) -> np.ndarray:
    """:func:`_lowest` in numpy."""
    last = key.shape[-1] - 1
    if k == 1:
        return last - key[..., ::-1].argmin(-1)[..., None]
    work, picks = key.copy(), []
    for _ in range(k):
        idx = last - work[..., ::-1].argmin(-1)[..., None]
        picks.append(idx)
        np.put_along_axis(work, idx, np.inf, -1)
    return np.sort(np.concatenate(picks, -1), -1)


@numba.njit(cache=True, nogil=True)
def _complement_rows(dropped: np.ndarray, n: int, out: np.ndarray) -> None:  # pragma: no cover - compiled
    k = dropped.shape[1]
    for r in range(dropped.shape[0]):
        j = w = 0
        for t in range(n):
            if j < k and dropped[r, j] == t:
                j += 1
            else:
                out[r, w] = t
                w += 1


def _complement(dropped: Tensor, n: int) -> Tensor:
    """Sorted indices ``[..., n − k]`` of ``0..n−1`` without the sorted ``dropped[..., k]`` (on its device).

    CPU: one O(n) numba walk; elsewhere a mask of the kept slots and :func:`_mask_indices`."""
    k = dropped.shape[-1]
    if _host(dropped):
        out = np.empty((math.prod(dropped.shape[:-1]), n - k), dtype=np.int64)
        rows = np.ascontiguousarray(dropped.numpy().reshape(-1, k), dtype=np.int64)
        _complement_rows(rows, n, out)
        return torch.from_numpy(out.reshape(*dropped.shape[:-1], n - k))
    mask = torch.ones(*dropped.shape[:-1], n, dtype=torch.bool, device=dropped.device)
    return _mask_indices(mask.scatter_(-1, dropped, False), n - k)


@numba.njit(cache=True, nogil=True)
def _drop_in_place(
    scores: np.ndarray, positions: np.ndarray, dropped: np.ndarray, n: int
) -> None:  # pragma: no cover - compiled
    """Remove the sorted slots ``dropped[r]`` from ``scores[r, :n]`` and ``positions[r, :n]``, moving later
    slots left (in place, one pass over both buffers)."""
    k = dropped.shape[1]
    for r in range(scores.shape[0]):
        if k == 0:
            continue
        w = dropped[r, 0]
        j = 0
        for t in range(w, n):
            if j < k and dropped[r, j] == t:
                j += 1
            else:
                scores[r, w] = scores[r, t]
                positions[r, w] = positions[r, t]
                w += 1


_READ_OK, _BAD_ATTN, _POSITIONS_DISAGREE, _NOT_INCREASING = 0, 1, 2, 3


@numba.njit(cache=True, nogil=True)
def _read_fault(
    attn: np.ndarray, pos: np.ndarray, held: np.ndarray, old: int, full: bool
) -> int:  # pragma: no cover - compiled
    """First fault of one observed read, else ``_READ_OK``: ``attn[B, Hkv, q, S]`` not finite and
    non-negative (NaN fails ``x >= 0``, +inf fails ``x < inf``); the caller's positions ``pos[B, Hkv, S]``
    differ from the ``held[B, Hkv, >= old]`` ones on slots ``[0, old)`` (``full``) or on the join slot
    ``old − 1``; the appended slots ``[old, S)`` not strictly increasing from the join slot on. The loops
    fold without early exits so that they vectorise."""
    bad = False
    for b in range(attn.shape[0]):
        for h in range(attn.shape[1]):
            for r in range(attn.shape[2]):
                row = attn[b, h, r]
                for t in range(row.shape[0]):
                    bad |= not (row[t] >= 0.0) or not (row[t] < np.inf)
    if bad:
        return _BAD_ATTN
    for b in range(pos.shape[0]):
        for h in range(pos.shape[1]):
            p, q = pos[b, h], held[b, h]
            for t in range(0 if full else max(old - 1, 0), old):
                bad |= p[t] != q[t]
    if bad:
        return _POSITIONS_DISAGREE
    for b in range(pos.shape[0]):
        for h in range(pos.shape[1]):
            p = pos[b, h]
            for t in range(max(old, 1), p.shape[0]):
                bad |= p[t] <= p[t - 1]
    return _NOT_INCREASING if bad else _READ_OK


def _read_fault_torch(attn: Tensor, pos: Tensor, held: Tensor, old: int, full: bool) -> int:
    """:func:`_read_fault` as torch reductions on the inputs' device, one host synchronisation for all three."""
    bad_attn = ~((attn >= 0) & (attn < math.inf)).all()
    lo = 0 if full else max(old - 1, 0)
    disagree = (pos[..., lo:old] != held[..., lo:old]).any()
    tail = pos[..., max(old, 1) - 1 :]
    not_increasing = (tail[..., 1:] <= tail[..., :-1]).any()
    faults = torch.stack([bad_attn, disagree, not_increasing]).tolist()  # the one sync
    codes = (_BAD_ATTN, _POSITIONS_DISAGREE, _NOT_INCREASING)
    return next((code for code, bad in zip(codes, faults, strict=True) if bad), _READ_OK)


def _top_mask(key: Tensor, c: int) -> Tensor:
    """Boolean mask with exactly ``c`` True per row: the ``c`` highest keys, ties to the lower index.

    Selection by threshold (``kthvalue``, ``O(S)``) instead of a sort: every key above the ``c``-th highest
    value ``v`` is kept, then the lowest-indexed keys equal to ``v`` fill the remaining places.
    """
    v = key.kthvalue(key.shape[-1] - c + 1, dim=-1, keepdim=True).values
    above = key > v
    tied = key == v
    return above | (tied & (tied.cumsum(-1) <= c - above.sum(-1, keepdim=True)))


def _mask_indices(mask: Tensor, c: int) -> Tensor:
    """Sorted indices ``[..., c]`` of the True entries of ``mask`` (exactly ``c`` per row).

    CPU: ``nonzero``; elsewhere a stable sort of ``~mask`` (``nonzero`` would wait for the device to learn its
    output size; the sort puts the True entries first, in index order)."""
    if _host(mask):
        return mask.nonzero()[:, -1].view(*mask.shape[:-1], c)
    return (~mask).to(torch.uint8).sort(dim=-1, stable=True).indices[..., :c]


def _keep_highest(key: Tensor, c: int) -> Tensor:
    """Sorted indices ``[..., c]`` of the ``c`` highest keys, ties to the lower index."""
    n = key.shape[-1]
    if n == c:
        return torch.arange(n, device=key.device).expand(*key.shape)
    if n - c <= _ARGMIN_MAX_EVICT:
        return _complement(_lowest(key, n - c), n)
    return _mask_indices(_top_mask(key, c), c)


_ARGMIN_MAX_EVICT = 8


def keep_top(scores: Tensor, protected: Tensor, budget: int) -> Tensor:
    """Sorted physical indices ``[B, Hkv, C]`` of the ``C = min(budget, S)`` items with the highest key.

    key = ``+inf`` for protected items, else ``scores``; ties go to the lower physical index (the set a
    stable descending sort keeps). ``ValueError`` if some head has more protected items than ``budget``
    (the budget cannot be honoured).
    """
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    n_protected = int(protected.sum(-1).max()) if protected.numel() else 0
    if n_protected > budget:
        raise _too_small(budget, n_protected)
    key = scores.to(F64).masked_fill(protected, math.inf)
    return _keep_highest(key, min(budget, scores.shape[-1]))


def fit_slots(x: Tensor, length: int) -> Tensor:
    """Zero-pad the last dim of ``x`` to ``length`` (items appended after ``x`` was recorded)."""
    return torch.nn.functional.pad(x, (0, length - x.shape[-1])) if x.shape[-1] < length else x


@dataclass
class LayerState:
    """Per-layer item state in the cache's physical slot order, on the device of the observed attention.

    Scores (float64) and logical positions (int64) of the ``n`` held slots live in torch capacity buffers
    ``[B, Hkv, cap]`` that grow by doubling: appending writes only the new slots, policies accumulate into
    the scores in place, and an eviction moves the kept runs left in place (few evictions, CPU) or gathers
    into a spare buffer pair and swaps. ``scores`` and ``positions`` are views of the first ``n`` slots. On
    CPU the per-step bookkeeping runs in numpy / numba over zero-copy views of the buffers, because its
    per-call cost on a ``[B, Hkv, S]`` row is a fraction of torch's (module doc, "Devices").

    Recorded query groups (``rows``, policy-specific) are mapped through evictions lazily: an eviction only
    records its ``keep``, and ``row(i)`` applies the evictions since group ``i`` was recorded when the group
    is read (a group that leaves a policy's window before that is never gathered).
    """

    buffers: tuple[Tensor, Tensor]  # (scores [B, Hkv, cap] float64, positions [B, Hkv, cap] int64)
    spare: tuple[Tensor, Tensor]
    now: Tensor  # [B] int64, position of the latest query observed
    n: int = 0
    verified: bool = False  # the held positions were compared in full with the caller's since the last compaction
    rows: list[Tensor] = field(default_factory=list)  # recorded query groups [B, Hkv, q, S_then] (policy-specific)
    row_epochs: list[int] = field(default_factory=list)  # evictions before each group was recorded
    row_positions: list[Tensor] = field(default_factory=list)  # [B, q] query positions of each group
    keeps: list[tuple[Tensor, int]] = field(default_factory=list)  # (keep, n before) not yet applied to all rows
    epoch: int = 0  # evictions so far
    issued: Tensor | None = None  # the keep tensor the last select returned (validated by construction)
    dropped: Tensor | None = None  # [B, Hkv, k] sorted slots ``issued`` leaves out (argmin path), else None
    _views: tuple[np.ndarray, np.ndarray] | None = None  # numpy views of ``buffers`` (CPU states), see ``views``
    _views_of: Tensor | None = None  # the score buffer ``_views`` were taken of

    @classmethod
    def empty(cls, batch: int, heads: int, device: torch.device | str = "cpu") -> LayerState:
        """No items yet; the buffers will live on ``device``."""
        bufs = (
            torch.zeros(batch, heads, 0, dtype=F64, device=device),
            torch.zeros(batch, heads, 0, dtype=torch.int64, device=device),
        )
        return cls(bufs, bufs, torch.zeros(batch, dtype=torch.int64, device=device))

    @property
    def device(self) -> torch.device:
        """The device of the state's buffers."""
        return self.buffers[0].device

    @property
    def scores(self) -> Tensor:
        """``[B, Hkv, n]`` float64 view of the score buffer (writes go to the state)."""
        return self.buffers[0][..., : self.n]

    @property
    def positions(self) -> Tensor:
        """``[B, Hkv, n]`` int64 view of the position buffer."""
        return self.buffers[1][..., : self.n]

    def views(self) -> tuple[np.ndarray, np.ndarray]:
        """Numpy views (no copy) of the whole score and position buffers of a CPU state, cached per buffer pair."""
        if self._views is None or self._views_of is not self.buffers[0]:
            self._views, self._views_of = (self.buffers[0].numpy(), self.buffers[1].numpy()), self.buffers[0]
        return self._views

    def extend(self, positions: Tensor, host: np.ndarray | None = None) -> None:
        """Append the slots ``positions[..., n:]`` (integer ``[B, Hkv, S]``, ``S >= n``) with score 0; ``host``: the
        same positions as a numpy array when the state is on CPU (the slots are written through numpy views)."""
        s = positions.shape[-1]
        if s > self.buffers[0].shape[-1]:
            cap = max(2 * self.buffers[0].shape[-1], s, 64)
            shape = (*self.buffers[0].shape[:2], cap)
            grown = (
                torch.zeros(shape, dtype=F64, device=self.device),
                torch.zeros(shape, dtype=torch.int64, device=self.device),
            )
            for new, old in zip(grown, self.buffers, strict=True):
                new[..., : self.n] = old[..., : self.n]
            self.buffers, self.spare = grown, (torch.empty_like(grown[0]), torch.empty_like(grown[1]))
        if host is not None:
            scores, held = self.views()
            scores[..., self.n : s] = 0.0
            held[..., self.n : s] = host[..., self.n :]
        else:
            self.buffers[0][..., self.n : s] = 0.0
            self.buffers[1][..., self.n : s] = positions[..., self.n :]
        self.n = s

    def evict(self, keep: Tensor, dropped: Tensor | None = None) -> None:
        """Keep the slots ``keep[B, Hkv, C]`` (sorted physical indices); ``dropped[B, Hkv, k]``, when given, are
        the sorted slots ``keep`` leaves out (then, on CPU, the kept runs move left in place instead of a
        gather; the result is the same)."""
        if self.rows:
            self.keeps.append((keep, self.n))
        self.epoch += 1
        if dropped is None or not _host(self.buffers[0]):
            c = keep.shape[-1]
            for src, dst in zip(self.buffers, self.spare, strict=True):
                torch.gather(src[..., : self.n], -1, keep, out=dst[..., :c])
            self.spare, self.buffers, self.n = self.buffers, self.spare, c
        else:
            rows = np.ascontiguousarray(dropped.numpy().reshape(-1, dropped.shape[-1]), dtype=np.int64)
            scores, positions = (buf.reshape(-1, buf.shape[-1]) for buf in self.views())
            _drop_in_place(scores, positions, rows, self.n)
            self.n -= dropped.shape[-1]
        self.verified = False

    def add_rows(self, attn: Tensor) -> None:
        """Record a query group ``attn[B, Hkv, q, n]``."""
        self.rows.append(attn)
        self.row_epochs.append(self.epoch)

    def row(self, i: int) -> Tensor:
        """Group ``i`` over the current slots ``[B, Hkv, q, S']``, ``S' <= n`` (slots appended after it was
        recorded are missing: the group put no weight on them)."""
        r = self.rows[i]
        first = self.epoch - len(self.keeps)
        for keep, n_before in self.keeps[self.row_epochs[i] - first :]:
            r = fit_slots(r, n_before).gather(-1, keep[:, :, None, :].expand(-1, -1, r.shape[2], -1))
        self.rows[i], self.row_epochs[i] = r, self.epoch
        return r

    def drop_rows(self, count: int) -> None:
        """Forget the ``count`` oldest groups (and evictions no held group needs any more)."""
        del self.rows[:count], self.row_epochs[:count]
        del self.keeps[: min(self.row_epochs, default=self.epoch) - (self.epoch - len(self.keeps))]


class EvictionPolicy(ABC):
    """Base scorer policy. Subclasses set ``sinks``/``recent`` and override the scoring hooks.

    Protected items (never evicted): logical position ``< sinks``, or ``> now − recent`` (the ``recent``
    newest positions, where ``now`` is the latest query position). Subclasses override
    ``_accumulate`` (decode-mode state update), ``_scores`` (decode scores) and ``_prefill_scores``.
    """

    needs_attention: bool = True  # False for policies whose prefill scores ignore attention

    @property
    def prefill_reads(self) -> PrefillReads:
        """What :meth:`prefill_scores` reads of the causal prefill attention (:class:`PrefillReads`): every row
        unless a subclass declares less; nothing when :attr:`needs_attention` is False."""
        return EVERY_ROW if self.needs_attention else PrefillReads()

    def __init__(self, sinks: int = 0, recent: int = 0) -> None:
        for name, n in (("sinks", sinks), ("recent", recent)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        self.sinks = sinks
        self.recent = recent
        self._layers: dict[int, LayerState] = {}
        # the cache (its eviction driver) whose request this state belongs to, when a decode budget binds it
        self.owner: weakref.ref[object] | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget all per-item state (new request)."""
        self._layers = {}

    def observe(self, layer: int, attn: Tensor, positions: Tensor) -> None:
        """Record one attention read of ``layer``.

        ``attn[B, Hkv, q, S]``: probabilities aggregated over each KV head's query heads (see module doc);
        ``positions[B, S]`` or ``[B, Hkv, S]``: strictly increasing logical positions of the physical slots.
        The ``q`` queries are the newest ``q`` slots (decode appends before reading). ``S`` may only grow
        between evictions.
        """
        if attn.dim() != 4:
            raise ValueError(f"attn must be [B, Hkv, q, S], got shape {tuple(attn.shape)}")
        b, h, q, s = attn.shape
        if positions.dim() == 2:
            positions = positions[:, None, :].expand(b, h, s)
        if positions.shape != (b, h, s) or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions must be integer [B, S] or [B, Hkv, S] matching attn {tuple(attn.shape)}")
        if q > s:
            raise ValueError(f"attn has q={q} queries but only S={s} slots")
        state = self._layers.get(layer)
        if state is None:
            state = self._layers[layer] = LayerState.empty(b, h, attn.device)
        old = state.n
        if s < old or state.buffers[0].shape[:2] != (b, h):
            raise ValueError(f"attn slots shrank or batch/heads changed without on_evict (layer {layer})")
        attn = attn.detach().to(F64)
        # held slots must be unchanged (catches a cache/policy gather mismatch): in full at the first read after
        # an eviction; in between slots are only appended, and a slot removed without on_evict would shift the
        # join slot old − 1, so that slot and the strictly increasing appended tail are checked
        pos = positions.to(state.device)
        pos_np = None
        if _host(attn):
            pos_np = pos.numpy()
            fault = _read_fault(attn.numpy(), pos_np, state.views()[1], old, not state.verified)
        else:
            fault = _read_fault_torch(attn, pos, state.buffers[1], old, not state.verified)
        if fault == _BAD_ATTN:
            raise ValueError("attn must be finite and non-negative")
        if fault == _POSITIONS_DISAGREE:
            raise ValueError(f"positions disagree with the slots the policy holds for layer {layer}")
        if fault == _NOT_INCREASING:
            raise ValueError("positions must be strictly increasing along the slot axis")
        state.issued, state.dropped, state.verified = None, None, True
        state.extend(pos, pos_np)
        if pos_np is not None:
            state.now = torch.from_numpy(pos_np[:, 0, -1].astype(np.int64))
        else:
            state.now = pos[:, 0, -1].to(torch.int64, copy=True)
        self._accumulate(layer, state, attn, state.buffers[1][:, 0, s - q : s])

    def set_kappa(self, step_positions: Tensor, kappa: Tensor) -> None:
        """Correctness weights ``kappa[B, q] ∈ [0, 1]`` of the queries at ``step_positions[B, q]``.

        Arrives after the step's logits, i.e. after ``observe``. Policies that do not weight by
        correctness validate and ignore it.
        """
        if step_positions.shape != kappa.shape or kappa.dim() != 2:
            raise ValueError(
                f"step_positions and kappa must both be [B, q], got {tuple(step_positions.shape)}, {tuple(kappa.shape)}"
            )
        if not bool(((kappa >= 0) & (kappa <= 1)).all()):  # one check (NaN fails both comparisons)
            raise ValueError("kappa must be finite and in [0, 1]")

    def select(self, layer: int, budget: int, chunk: int = 1) -> Tensor | None:
        """Sorted physical indices ``[B, Hkv, budget − chunk + 1]`` to keep once the layer holds more than
        ``budget`` items; ``None`` while it holds at most ``budget`` (module doc). ``1 <= chunk <= budget``."""
        if not 1 <= chunk <= budget:
            raise ValueError(f"chunk must be in [1, budget={budget}], got {chunk}")
        state = self._state(layer)
        if state.n <= budget:
            return None
        kept = budget - chunk + 1
        n, lo, hi = state.n, self.sinks, state.n - self.recent
        if lo < hi and self._edges_protected(state, lo, hi):
            k = n - kept
            if k > hi - lo:
                raise _too_small(kept, n - (hi - lo))
            if k <= _ARGMIN_MAX_EVICT:
                dropped = self._drop_middle(layer, state, lo, hi, k)
                keep = _complement(dropped, n)
            else:
                dropped = None
                mask = torch.ones(*state.scores.shape, dtype=torch.bool, device=state.scores.device)
                mask[..., lo:hi] = _top_mask(self._scores(layer, state)[..., lo:hi], hi - lo - k)
                keep = _mask_indices(mask, kept)
        else:
            protected = self._protected(state.positions, state.now)
            keep, dropped = keep_top(self._scores(layer, state), protected, kept), None
        state.issued, state.dropped = keep, dropped
        return keep

    def _edges_protected(self, state: LayerState, lo: int, hi: int) -> bool:
        """Whether the protected slots are exactly ``[0, lo) ∪ [hi, n)`` (``lo = sinks``, ``hi = n − recent``).

        Positions are strictly increasing integers, so slot ``lo − 1`` holding position ``sinks − 1`` puts
        exactly the first ``sinks`` slots below ``sinks``, and slot ``hi`` holding ``now − recent + 1`` puts
        exactly the last ``recent`` slots above ``now − recent`` (with ``recent = 0``: no slot above ``now``).
        Off the CPU both conditions are one reduction (one host synchronisation).
        """
        if _host(state.buffers[1]):
            pos_np, now_np = state.views()[1][..., : state.n], state.now.numpy()
            if lo > 0 and not (pos_np[..., lo - 1] == lo - 1).all():
                return False
            if hi == state.n:
                return bool((pos_np[..., -1] <= now_np[:, None]).all())
            return bool((pos_np[..., hi] == (now_np - (self.recent - 1))[:, None]).all())
        pos, now = state.positions, state.now
        edge = (pos[..., -1] <= now[:, None]) if hi == state.n else (pos[..., hi] == (now - (self.recent - 1))[:, None])
        if lo > 0:
            edge = edge & (pos[..., lo - 1] == lo - 1)
        return bool(edge.all())

    def _drop_middle(self, layer: int, state: LayerState, lo: int, hi: int, k: int) -> Tensor:
        """Sorted physical indices ``[B, Hkv, k]`` of the ``k`` lowest-scoring slots in ``[lo, hi)``."""
        return _lowest(self._scores(layer, state)[..., lo:hi], k) + lo

    def on_evict(self, layer: int, keep: Tensor) -> None:
        """Compact the layer's per-item state with the same gather the cache applied (``keep[B, Hkv, C]``)."""
        state = self._state(layer)
        s = state.n
        if keep is not state.issued:  # select's own output for the current state is valid by construction
            if keep.dim() != 3 or keep.shape[:2] != state.scores.shape[:2] or keep.dtype != torch.long:
                raise ValueError(f"keep must be long [B, Hkv, C] matching the layer state, got {tuple(keep.shape)}")
            if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= s or not (keep.diff(dim=-1) > 0).all()):
                raise ValueError(f"keep must be strictly increasing physical indices in [0, {s})")
        state.evict(keep, state.dropped if keep is state.issued else None)
        state.issued = state.dropped = None

    # ---- prefill ---------------------------------------------------------------------------
    def prefill_keep(
        self,
        layer: int,
        keys: Tensor,
        values: Tensor,
        ratio: float,
        attn: Tensor | PrefillAttention | None = None,
        queries: Tensor | None = None,
        kappa: Tensor | None = None,
    ) -> Tensor:
        """Sorted indices ``[B, Hkv, C]`` to keep after prefill, ``C = prefill_kept_count(S, ratio)``.

        ``keys``/``values``: ``[B, Hkv, S, D]``; attention from ``attn[B, Hq, S, S]`` (eager weights), from a
        :class:`~kvcert.evict.prefill_attention.PrefillAttention` ``[B, Hkv, S]`` holding at least
        :attr:`prefill_reads` (``ValueError`` otherwise), or recomputed causally from ``queries[B, Hq, S, D]``;
        ``kappa[B, S]`` correctness weights of the prefill queries (used only by correctness-weighted policies).
        Positions are ``0..S-1``.
        """
        _check_prefill_kv(keys, values)
        s = keys.shape[2]
        kept = prefill_kept_count(s, ratio)
        if kept == s:
            return torch.arange(s, device=keys.device).expand(*keys.shape[:3]).clone()
        scores, protected = self.prefill_scores(layer, keys, values, attn, queries, kappa)
        return keep_top(scores, protected, kept)

    def prefill_scores(
        self,
        layer: int,
        keys: Tensor,
        values: Tensor,
        attn: Tensor | PrefillAttention | None = None,
        queries: Tensor | None = None,
        kappa: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(scores, protected)``, both ``[B, Hkv, S]`` on ``keys``' device: the float64 per-item scores and the
        protected mask (sinks, recent window) :meth:`prefill_keep` keeps the top of (arguments as there)."""
        _check_prefill_kv(keys, values)
        b, h, s, _ = keys.shape
        positions = torch.arange(s, device=keys.device).expand(b, h, s)
        now = torch.full((b,), s - 1, dtype=torch.long, device=keys.device)
        attn_kv = self._prefill_attention(keys, attn, queries) if self.needs_attention else None
        return self._prefill_scores(layer, attn_kv, positions, kappa), self._protected(positions, now)

    def keep_ranked(self, scores: Tensor, ratio: float) -> Tensor:
        """Sorted indices ``[B, Hkv, C]`` of the items to keep among ``S`` items at positions ``0..S-1`` ranked by
        ``scores[B, Hkv, S]`` (any device; the result is on it), ``C = prefill_kept_count(S, ratio)``: the items
        this policy protects after a prefill of ``S`` (sinks, recent window) first, then the highest scores, ties to
        the lower position — :meth:`prefill_keep`'s rule with scores from elsewhere. Torch only (no host copy)."""
        b, h, s = scores.shape
        kept = prefill_kept_count(s, ratio)
        positions = torch.arange(s, device=scores.device).expand(b, h, s)
        if kept == s:
            return positions.clone()
        now = torch.full((b,), s - 1, dtype=torch.long, device=scores.device)
        protected = self._protected(positions, now)
        n_protected = int(protected.sum(-1).max())
        if n_protected > kept:
            raise _too_small(kept, n_protected)
        return _mask_indices(_top_mask(scores.to(F64).masked_fill(protected, math.inf), kept), kept)

    @staticmethod
    def _prefill_attention(
        keys: Tensor, attn: Tensor | PrefillAttention | None, queries: Tensor | None
    ) -> PrefillAttention:
        """The prefill attention per KV head (sum over each group) of ``keys[B, Hkv, S, D]``'s prefill."""
        if attn is None:
            if queries is None:
                raise ValueError("prefill_keep needs attn [B, Hq, S, S] or queries [B, Hq, S, D]")
            attn = causal_attention(queries, keys)
        b, h, s = keys.shape[:3]
        if isinstance(attn, PrefillAttention):
            if attn.shape != (b, h, s) or attn.queries != s:
                raise ValueError(
                    f"attn must be a prefill's attention [B, Hkv, S] = {(b, h, s)} over {s} queries, got "
                    f"{attn.shape} over {attn.queries}"
                )
            return attn
        if attn.dim() != 4 or attn.shape[-2:] != (s, s) or attn.shape[0] != b:
            raise ValueError(f"attn must be [B, Hq, S, S] with S={s}, got {tuple(attn.shape)}")
        return PrefillAttention(aggregate_gqa(attn.to(F64), h, "sum"), s, group=attn.shape[1] // h)

    # ---- hooks -----------------------------------------------------------------------------
    def _protected(self, positions: Tensor, now: Tensor) -> Tensor:
        return (positions < self.sinks) | (positions > (now[:, None, None] - self.recent))

    def _accumulate(self, layer: int, state: LayerState, attn: Tensor, qpos: Tensor) -> None:
        """Update decode-mode state from ``attn[B, Hkv, q, S]`` (float64, on the state's device) read by the
        queries at positions ``qpos[B, q]`` (a view of the state: copy to keep); default: no state to update."""
        return None

    def _scores(self, layer: int, state: LayerState) -> Tensor:
        return state.scores

    @abstractmethod
    def _prefill_scores(
        self, layer: int, attn: PrefillAttention | None, positions: Tensor, kappa: Tensor | None
    ) -> Tensor:
        """Prefill scores ``[B, Hkv, S]`` from the prefill attention ``attn`` (per KV head, GQA-summed; ``None``
        when ``needs_attention`` is False; it raises on a read of what was not recorded) and ``kappa[B, S]`` (or
        ``None``)."""

    def _state(self, layer: int) -> LayerState:
        state = self._layers.get(layer)
        if state is None:
            raise ValueError(f"layer {layer} has not been observed")
        return state


def accumulate_rows(scores: Tensor, attn: Tensor, weights: Tensor | None = None) -> None:
    """In place: ``scores[..., :S] += Σ_r w_r · attn[:, :, r, :]``, added row by row in query order (float64).

    ``scores`` is a state's score view ``[B, Hkv, n]``; ``attn[B, Hkv, q, S]`` with ``S <= n`` (older rows
    cover fewer slots), on the same device; ``weights``: ``[B, q]`` or ``None`` (unweighted). The fixed order
    makes the κ ≡ 1 sum bit-identical to the unweighted one (``1.0 · x == x``), which the RMM -> H2O reduction
    relies on. IEEE-754 float64 addition and multiplication are correctly rounded, so the numpy loop that
    serves CPU states computes exactly what the torch loop computes on other devices.
    """
    if attn.shape[-1] > scores.shape[-1]:
        raise ValueError(f"attn covers {attn.shape[-1]} slots, the scores only {scores.shape[-1]}")
    if _host(scores):
        target_np = scores.numpy()[..., : attn.shape[-1]]
        a = attn.numpy()
        w_np = None if weights is None else weights.to(F64).numpy()
        for r in range(a.shape[2]):
            row_np = a[:, :, r, :]
            target_np += row_np if w_np is None else w_np[:, r, None, None] * row_np
        return
    target = scores[..., : attn.shape[-1]]
    w = None if weights is None else weights.to(device=scores.device, dtype=F64)
    for r in range(attn.shape[2]):
        row = attn[:, :, r, :]
        target += row if w is None else w[:, r, None, None] * row
