"""What a prefill score reads of a layer's causal prefill attention, and what a recording kept of it.

A policy's prefill score (:meth:`~kvcert.evict.EvictionPolicy.prefill_scores`) reads part of the causal attention
``[B, H, S, S]`` of the prefill's ``S`` queries over its ``S`` keys: SnapKV the sum of its ``window`` newest rows,
H2O and RMM (κ ≡ 1) each key's attention summed over every row, StreamingLLM nothing. :class:`PrefillReads` names
that part, so a shared prefill can record it (``kvcert.eval.attention_record``) in ``O(rows · S)`` per layer instead
of the ``O(S²)`` matrix; :class:`PrefillAttention` holds what was recorded (or a whole matrix) and answers only what
it holds exactly: a read it cannot serve raises ``ValueError``, never an approximation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

F64 = torch.float64


@dataclass(frozen=True)
class PrefillReads:
    """What is read of a layer's causal prefill attention ``[B, H, S, S]``: its ``rows`` newest query rows (``None``:
    every row) and, with ``column_sums``, each key's attention summed over every query row, unweighted (a κ-weighted
    sum needs every row: κ is known only after the prefill's logits). The default reads nothing."""

    rows: int | None = 0
    column_sums: bool = False

    def __post_init__(self) -> None:
        if self.rows is not None and (isinstance(self.rows, bool) or self.rows < 0):
            raise ValueError(f"rows must be a non-negative int or None (every row), got {self.rows!r}")

    def __or__(self, other: PrefillReads) -> PrefillReads:
        """What either of the two reads."""
        rows = None if self.rows is None or other.rows is None else max(self.rows, other.rows)
        return PrefillReads(rows, self.column_sums or other.column_sums)

    @property
    def anything(self) -> bool:
        """Whether any part of the attention is read."""
        return self.rows != 0 or self.column_sums


#: every row of the attention (what a policy that does not declare its reads gets)
EVERY_ROW = PrefillReads(rows=None)


def observed_attention(attn: Tensor, kappa: Tensor | None = None) -> Tensor:
    """Prefill score ``[B, H, S]``: the mean (κ-weighted) attention a key receives from the queries that see it,

        score_i = Σ_{s >= i} κ_s · a_{s,i} / (S − i)        (causal: the S − i queries at positions i..S−1)

    ``attn[B, H, S, S]`` causal attention (summed or averaged over each group: the ranking is the same);
    ``kappa[B, S]`` correctness weights, or ``None`` for κ ≡ 1 (then nothing is multiplied, so the value is
    bit-identical to ``kappa = ones``). Without the division the column sum favours early keys, which more
    queries see: a key every query attends to with weight ``1/(s+1)`` outranks a late key that every later
    query attends to with weight 1/2. kvpress's ``ObservedAttentionPress`` divides by the same count.
    """
    if attn.dim() != 4 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attn must be [B, H, S, S], got {tuple(attn.shape)}")
    s = attn.shape[-1]
    if kappa is not None:
        if kappa.shape != (attn.shape[0], s):
            raise ValueError(f"kappa must be [B, S] = {(attn.shape[0], s)}, got {tuple(kappa.shape)}")
        attn = attn * kappa[:, None, :, None].to(attn.dtype)
    return _per_query(attn.sum(-2))


def _per_query(sums: Tensor) -> Tensor:
    """Column sums ``[B, H, S]`` of a causal prefill divided by the number of queries that see each key (``S − i``)."""
    s = sums.shape[-1]
    return sums / torch.arange(s, 0, -1, dtype=sums.dtype, device=sums.device)


class PrefillAttention:
    """Part of one layer's attention probabilities from a forward of ``queries`` query rows over ``S`` keys (a
    prefill: ``queries == S``, causal), per KV head the sum over its ``group`` query heads, float64.

    ``rows[B, H, r, S]``: the ``r`` newest query rows (``r == queries``: the whole matrix, :attr:`complete`);
    ``column_sums[B, H, S]``: each key's attention summed over every query row (``None``: not recorded). A matrix of
    ``H`` heads that are already means over their groups is ``group=1``. ``query_gram[B, H, D, D]``: the second
    moment ``Σ q qᵀ`` of the recorded rows' queries over each KV head's group
    (:func:`~kvcert.attention.query_gram.query_gram`; ``None``: not recorded), what a query-aware resident summary is
    built from. ``ValueError`` unless the shapes agree and every entry is finite.
    """

    def __init__(
        self,
        rows: Tensor,
        queries: int,
        group: int = 1,
        column_sums: Tensor | None = None,
        query_gram: Tensor | None = None,
    ) -> None:
        if rows.dim() != 4 or not 0 <= rows.shape[2] <= queries or group < 1:
            raise ValueError(
                f"rows must be [B, H, r, S] with r <= queries={queries} and group >= 1, got {tuple(rows.shape)}, "
                f"group={group}"
            )
        if column_sums is not None and column_sums.shape != (*rows.shape[:2], rows.shape[3]):
            raise ValueError(f"column_sums must be [B, H, S] matching rows {tuple(rows.shape)}")
        gram = None if query_gram is None else tuple(query_gram.shape)
        if gram is not None and (len(gram) != 4 or gram[:2] != tuple(rows.shape[:2]) or gram[2] != gram[3]):
            raise ValueError(f"query_gram must be [B, H, D, D] matching rows {tuple(rows.shape)}, got {gram}")
        finite = torch.isfinite(rows).all()
        for extra in (column_sums, query_gram):
            if extra is not None:
                finite = finite & torch.isfinite(extra).all()
        if not bool(finite):
            raise ValueError("attn must be finite")
        self.rows, self.queries, self.group, self.column_sums = rows, queries, group, column_sums
        self.query_gram = query_gram

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(B, H, S)``: batch rows, heads and keys."""
        b, h, _, s = self.rows.shape
        return b, h, s

    @property
    def complete(self) -> bool:
        """Whether every query row was kept."""
        return self.rows.shape[2] == self.queries

    def newest(self, n: int | None) -> Tensor:
        """The ``min(n, queries)`` newest rows ``[B, H, ·, S]`` (``None``: every row); ``ValueError`` if fewer were
        kept."""
        want = self.queries if n is None else min(n, self.queries)
        have = self.rows.shape[2]
        if want > have:
            raise ValueError(
                f"the {want} newest attention rows of a {self.queries}-query forward are read, only the {have} "
                "newest were recorded"
            )
        return self.rows[:, :, have - want :]

    def mean_newest(self, n: int | None) -> Tensor:
        """:meth:`newest` as the mean over each group (a distribution per row)."""
        rows = self.newest(n)
        return rows if self.group == 1 else rows / self.group

    def observed(self, kappa: Tensor | None = None) -> Tensor:
        """:func:`observed_attention` of the causal prefill (``queries == S``): from the whole matrix when it was
        kept, else from the recorded column sums, which serve only ``κ ≡ 1`` (``kappa`` ``None`` or all ones);
        ``ValueError`` otherwise."""
        b, _, s = self.shape
        if self.queries != s:
            raise ValueError(f"observed attention is a prefill's ({s} queries over {s} keys), got {self.queries}")
        if self.complete:
            return observed_attention(self.rows, kappa)
        if kappa is not None:
            if kappa.shape != (b, s):
                raise ValueError(f"kappa must be [B, S] = {(b, s)}, got {tuple(kappa.shape)}")
            if not bool((kappa == 1).all()):
                raise ValueError(
                    "κ-weighted column sums need every prefill row (κ is known after the prefill); the recording "
                    f"kept the {self.rows.shape[2]} newest rows and the unweighted column sums"
                )
        if self.column_sums is None:
            raise ValueError(
                "the prefill score reads each key's attention summed over every query row; the recording kept "
                f"only the {self.rows.shape[2]} newest rows"
            )
        return _per_query(self.column_sums)
