"""Typed composition of local contracts (``docs/contracts.md#chains``).

``Chain`` is immutable; every method returns a new chain.

- ``then(c)`` (series, rule C1): ``e <- a_c·e + b_c``. Defined only when the chain's current output
  metric equals ``c.m_in`` in object, norm *and* site; otherwise :class:`MetricMismatch`.
- ``also(term, e_in=0.0)`` (parallel additive term): ``e <- e + term(e_in)``. The term is an
  *independent* error source that lands in the chain's current output metric, so ``term.m_out``
  must equal the chain's current output metric (else :class:`MetricMismatch`). Its own input
  ``term.m_in`` is unconstrained because the term does not see the chain's error: it is driven by its
  own input error ``e_in`` (measured in ``term.m_in``, fixed when attached; the default 0 means the
  term's whole contribution is its offset ``b``, e.g. Lemma S2's ``½(m_out + m_in)``). The term's
  premise is checked when it is attached. A term may itself be a Chain (e.g. selection then the
  selector→attention ratio), which is attached as one stage.
- ``compose()`` gives the affine summary: ``a = Π a`` over series stages, ``b`` by
  ``(a2, b2)∘(a1, b1) = (a2·a1, a2·b1 + b2)`` plus every parallel term's affine value, ``delta = Σ δ``
  (union bound, rule C2), tier = weakest.
- ``evaluate(e_in)`` walks the stages with each stage's exact transfer where it has one (else
  ``a·e + b``) and attributes the result to its sources (see :meth:`Chain.evaluate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcert.contracts.contract import Contract, nonneg_product
from kvcert.contracts.metric import Metric
from kvcert.contracts.tiers import Tier, weakest

INPUT = "input"
"""Name under which :meth:`Chain.evaluate` reports the share of the result due to the chain input."""


class MetricMismatch(TypeError):
    """Composition across different metrics (object, norm or site) was attempted."""


@dataclass(frozen=True)
class _Stage:
    contract: Contract
    parallel: bool
    term_e_in: float


@dataclass(frozen=True)
class StageResult:
    """One stage of an evaluation.

    ``e_in``: the stage's input error (the running chain error for a series stage, the term's own
    input for a parallel one); ``e_out``: the running chain error after the stage;
    ``contribution``: the part of the final value attributed to this stage's own additive term.
    """

    name: str
    e_in: float
    e_out: float
    contribution: float
    tier: Tier
    parallel: bool


@dataclass(frozen=True)
class Evaluation:
    """Result of :meth:`Chain.evaluate`: ``value`` in ``m_out`` holds except with probability ``delta``."""

    value: float
    tier: Tier
    delta: float
    m_in: Metric
    m_out: Metric
    input_contribution: float
    stages: tuple[StageResult, ...]
    dominant_stage: str


@dataclass(frozen=True)
class Composed:
    """Affine summary ``e_out <= a·e_in + b`` of a chain, failure probability ``delta``, weakest tier."""

    a: float
    b: float
    delta: float
    tier: Tier
    m_in: Metric
    m_out: Metric
    stages: tuple[str, ...]

    def bound(self, e_in: float) -> float:
        """``a·e_in + b`` (with ``0·inf = 0``)."""
        return nonneg_product(self.a, float(e_in)) + self.b

    def __str__(self) -> str:
        return (
            f"{self.m_in} -> {self.m_out}: e_out <= {self.a:.6g}·e_in + {self.b:.6g} "
            f"(delta={self.delta:.3g}, {self.tier.value}) via {' -> '.join(self.stages)}"
        )


class Chain:
    """An immutable, metric-typed sequence of contracts (see the module docstring for the rules)."""

    def __init__(self, stages: tuple[_Stage, ...] = ()) -> None:
        self._stages = stages

    @property
    def names(self) -> tuple[str, ...]:
        """Stage names in order."""
        return tuple(s.contract.name for s in self._stages)

    def __len__(self) -> int:
        return len(self._stages)

    @property
    def m_in(self) -> Metric:
        """Input metric (of the first stage); ``ValueError`` on an empty chain."""
        return self._require_nonempty("m_in")._stages[0].contract.m_in

    @property
    def m_out(self) -> Metric:
        """Current output metric (of the last series stage); ``ValueError`` on an empty chain."""
        return [s for s in self._require_nonempty("m_out")._stages if not s.parallel][-1].contract.m_out

    def _require_nonempty(self, what: str) -> Chain:
        if not self._stages:
            raise ValueError(f"{what} is undefined for an empty chain: add a stage with then() first")
        return self

    def then(self, c: Contract) -> Chain:
        """Append ``c`` in series; :class:`MetricMismatch` unless ``self.m_out == c.m_in``."""
        if not isinstance(c, Contract):
            raise ValueError(f"c must be a Contract, got {type(c).__name__}")
        if self._stages and self.m_out != c.m_in:
            raise MetricMismatch(f"cannot chain {c.name!r}: it takes {c.m_in} but the chain produces {self.m_out}")
        return Chain((*self._stages, _Stage(c, parallel=False, term_e_in=0.0)))

    def also(self, term: Contract | Chain, e_in: float = 0.0) -> Chain:
        """Add ``term`` (driven by its own input error ``e_in``) in parallel, in the chain's output metric.

        :class:`MetricMismatch` unless ``term.m_out == self.m_out``; :class:`PremiseViolation` if the
        term's premise fails at ``e_in``; ``ValueError`` on an empty chain or a bad ``e_in``.
        """
        contract = term.as_contract() if isinstance(term, Chain) else term
        if not isinstance(contract, Contract):
            raise ValueError(f"term must be a Contract or a Chain, got {type(term).__name__}")
        if contract.m_out != self._require_nonempty("also()").m_out:
            raise MetricMismatch(
                f"cannot add {contract.name!r} in parallel: it produces {contract.m_out} "
                f"but the chain produces {self.m_out}"
            )
        contract.apply(e_in)  # validates e_in and checks the premise now, at attach time
        return Chain((*self._stages, _Stage(contract, parallel=True, term_e_in=float(e_in))))

    def compose(self) -> Composed:
        """Affine summary (Πa, affine-composed b, Σδ, weakest tier); ``ValueError`` on an empty chain."""
        self._require_nonempty("compose()")
        a, b = 1.0, 0.0
        for s in self._stages:
            c = s.contract
            if s.parallel:
                b += c.affine(s.term_e_in)
            else:
                a, b = nonneg_product(c.a, a), nonneg_product(c.a, b) + c.b
        return Composed(
            a=a,
            b=b,
            delta=math.fsum(s.contract.delta for s in self._stages),
            tier=weakest(*(s.contract.tier for s in self._stages)),
            m_in=self.m_in,
            m_out=self.m_out,
            stages=self.names,
        )

    def evaluate(self, e_in: float) -> Evaluation:
        """Walk the chain from input error ``e_in`` using each stage's exact transfer where present.

        Attribution (``contribution`` of each stage, ``input_contribution``): the running error is kept
        as a sum of parts, one per source (the input and every stage). A series stage maps the running
        error ``e`` to ``e_out``; the part ``f(0)`` (its offset: ``b``, or ``transfer(0)``) is its own,
        the rest ``e_out - f(0)`` is shared among the existing parts in proportion to their size.
        For affine stages this is exact (stage k's share is ``(Π_{j>k} a_j)·b_k``); through a
        nonlinear transfer it is a proportional convention. A parallel term's value is its own part.
        ``dominant_stage`` is the source with the largest share (:data:`INPUT` for the input).
        """
        self._require_nonempty("evaluate()")
        e = float(e_in)
        if not math.isfinite(e) or e < 0.0:
            raise ValueError(f"e_in must be finite and >= 0, got {e_in!r}")
        parts = [e]
        records: list[tuple[str, float, float, Tier, bool]] = []
        for s in self._stages:
            c = s.contract
            if s.parallel:
                value = c.apply(s.term_e_in)
                parts.append(value)
                stage_in, e = s.term_e_in, e + value
            else:
                e_out = c.apply(e)
                own = min(e_out, c.b if c.transfer is None else max(0.0, float(c.transfer(0.0))))
                rest = e_out - own
                if e > 0.0:
                    parts = [nonneg_product(p, rest / e) for p in parts]
                else:
                    own = e_out
                parts.append(own)
                stage_in, e = e, e_out
            records.append((c.name, stage_in, e, c.tier, s.parallel))
        results = tuple(
            StageResult(name, s_in, s_out, part, tier, parallel)
            for (name, s_in, s_out, tier, parallel), part in zip(records, parts[1:], strict=True)
        )
        sources = [(parts[0], INPUT)] + [(r.contribution, r.name) for r in results]
        dominant = max(sources, key=lambda pair: pair[0])[1]
        return Evaluation(
            value=e,
            tier=weakest(*(s.contract.tier for s in self._stages)),
            delta=math.fsum(s.contract.delta for s in self._stages),
            m_in=self.m_in,
            m_out=self.m_out,
            input_contribution=parts[0],
            stages=results,
            dominant_stage=dominant,
        )

    def as_contract(self, name: str | None = None) -> Contract:
        """This chain as one contract: the composed ``(a, b, delta, tier)`` with exact transfer
        ``e -> evaluate(e).value`` (inner premises are checked inside)."""
        composed = self.compose()
        return Contract(
            name=name or "(" + " -> ".join(self.names) + ")",
            a=composed.a,
            b=composed.b,
            delta=composed.delta,
            tier=composed.tier,
            m_in=composed.m_in,
            m_out=composed.m_out,
            reason="; ".join(f"{s.contract.name}: {s.contract.reason}" for s in self._stages),
            transfer=lambda e: self.evaluate(e).value,
        )
