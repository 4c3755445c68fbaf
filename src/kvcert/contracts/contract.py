"""Local contracts ``e_out <= a·e_in + b`` except with probability ``delta`` (``docs/contracts.md#local-contracts``).

A :class:`Contract` is the proof obligation a stage of a memory path discharges: given an input error
``e_in`` measured in ``m_in``, the output error measured in ``m_out`` satisfies
``e_out <= a·e_in + b`` with failure probability at most ``delta``. Two optional refinements:

- ``transfer``: an exact scalar bound ``e_out <= transfer(e_in)`` that is at least as tight as the
  affine form wherever the premise holds (``transfer(e) <= a·e + b``); evaluation uses it, composition
  uses the affine form. ``a = inf`` declares that no finite affine relaxation exists (the uniform
  softmax bridge): such a stage can be evaluated exactly but composes to an unbounded slope.
- ``premise``: a runtime-checked condition on ``e_in``; evaluating the stage where it fails raises
  :class:`PremiseViolation` (this is what makes a stage *partial*).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvcert.contracts.metric import Metric
from kvcert.contracts.tiers import Tier


class PremiseViolation(Exception):
    """A stage was evaluated at an input error outside its runtime premise."""


@dataclass(frozen=True)
class Premise:
    """A runtime condition ``predicate(e_in)`` the stage's contract needs, with its description."""

    description: str
    predicate: Callable[[float], bool]

    def __post_init__(self) -> None:
        if not isinstance(self.description, str) or not self.description.strip():
            raise ValueError("premise description must be a non-empty str")
        if not callable(self.predicate):
            raise ValueError("premise predicate must be callable e_in -> bool")


def nonneg_product(x: float, y: float) -> float:
    """``x·y`` for non-negative extended reals with the convention ``0·inf = 0``.

    A zero slope means the output does not depend on the input, and a zero offset adds nothing,
    whatever the other factor is.
    """
    if x == 0.0 or y == 0.0:
        return 0.0
    return x * y


@dataclass(frozen=True)
class Contract:
    """Local contract ``e_out <= a·e_in + b`` (failure probability ``delta``) from ``m_in`` to ``m_out``.

    Arguments: ``a`` >= 0 and ``b`` >= 0 (``inf`` allowed: no finite affine relaxation, e.g. a chain
    through the uniform softmax bridge as one contract),
    ``delta`` in [0, 1], ``tier`` (Tier or its name), metrics as :class:`Metric` or ``"obj:norm@site"``,
    a non-empty ``reason`` (the proof name or why the tier is what it is), an optional ``premise``
    (a :class:`Premise` or a ``(description, predicate)`` pair) and an optional exact ``transfer``.
    """

    name: str
    a: float
    b: float
    delta: float
    tier: Tier
    m_in: Metric
    m_out: Metric
    reason: str
    premise: Premise | None = None
    transfer: Callable[[float], float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("name must be a non-empty str")
        a, b, delta = float(self.a), float(self.b), float(self.delta)
        if math.isnan(a) or a < 0.0:
            raise ValueError(f"a must be >= 0 (inf allowed), got {self.a!r} in contract {self.name!r}")
        if math.isnan(b) or b < 0.0:
            raise ValueError(f"b must be >= 0 (inf allowed), got {self.b!r} in contract {self.name!r}")
        if not 0.0 <= delta <= 1.0:
            raise ValueError(f"delta must be in [0, 1], got {self.delta!r} in contract {self.name!r}")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"reason must be a non-empty str in contract {self.name!r}")
        premise = self.premise
        if premise is not None and not isinstance(premise, Premise):
            if not (isinstance(premise, tuple) and len(premise) == 2):
                raise ValueError(f"premise must be a Premise or (description, predicate), got {premise!r}")
            premise = Premise(*premise)
        if self.transfer is not None and not callable(self.transfer):
            raise ValueError(f"transfer must be callable e_in -> e_out bound in contract {self.name!r}")
        object.__setattr__(self, "a", a)
        object.__setattr__(self, "b", b)
        object.__setattr__(self, "delta", delta)
        object.__setattr__(self, "tier", Tier.parse(self.tier))
        object.__setattr__(self, "m_in", Metric.coerce(self.m_in))
        object.__setattr__(self, "m_out", Metric.coerce(self.m_out))
        object.__setattr__(self, "premise", premise)

    def check_premise(self, e_in: float) -> None:
        """Raise :class:`PremiseViolation` if the premise does not hold at ``e_in``."""
        if self.premise is not None and not self.premise.predicate(e_in):
            raise PremiseViolation(
                f"contract {self.name!r}: premise {self.premise.description!r} fails at e_in={e_in!r}"
            )

    def affine(self, e_in: float) -> float:
        """The affine bound ``a·e_in + b`` (with ``0·inf = 0``)."""
        return nonneg_product(self.a, e_in) + self.b

    def apply(self, e_in: float) -> float:
        """Bound on ``e_out`` at ``e_in``: ``transfer(e_in)`` if given, else ``a·e_in + b``.

        ``e_in`` must be finite and >= 0; the premise is checked first (:class:`PremiseViolation`).
        A transfer value outside ``[0, a·e_in + b]`` means the contract is mis-declared: ``ValueError``.
        """
        e_in = float(e_in)
        if not math.isfinite(e_in) or e_in < 0.0:
            raise ValueError(f"e_in must be finite and >= 0, got {e_in!r} for contract {self.name!r}")
        self.check_premise(e_in)
        if self.transfer is None:
            return self.affine(e_in)
        e_out = float(self.transfer(e_in))
        if math.isnan(e_out) or e_out < 0.0 or e_out > self.affine(e_in) * (1.0 + 1e-12) + 1e-300:
            raise ValueError(
                f"contract {self.name!r}: transfer({e_in!r}) = {e_out!r} is not in [0, a·e_in + b]; "
                "the declared affine form must dominate the exact transfer"
            )
        return e_out
