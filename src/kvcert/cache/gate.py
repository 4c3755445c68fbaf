"""Gate policies: which (KV head, step) reads are repaired from the exact host tier.

* ``Gate.off()`` — never repair; certificates are still computed and reported.
* ``Gate.certified(tau)`` — repair every KV head whose certificate exceeds ``tau`` for **any** of its
  G query heads (KV-head any-of-G); unrepaired reads then carry a true certificate ``<= tau``.
  ``tau = 0`` repairs every read whose radius is not identically zero (with ``box=True``, below, not a read whose
  served distribution puts all its mass on one token: its TV is 0 whatever the keys' error, and the box says so,
  while the values it serves stay the codec's). ``tau`` must lie in ``[0, 1]`` (``ValueError`` otherwise): the
  clipped certificate is at most 1, so a larger threshold would never repair and label every read "certified".
  ``tau = 1`` never repairs a key read; with ``value_tol`` it gates the values alone.
* ``Gate.risk_ranked(tau_gate)`` — for saturated schemes: rank by the *unclipped* meter and repair the
  KV heads whose unclipped value exceeds ``tau_gate`` (values above 1 carry no certificate semantics
  but still rank risk). Reads left unrepaired carry only their (possibly vacuous) clipped certificate.

``granularity`` is ``"head"`` (page in the whole KV head) or ``"block"`` (page in the blocks with the
largest contributions ``Σ_{t∈b} p̃_t(e^{c_t} − 1)`` until the cell is back under the threshold).
``persistent=True`` writes repaired blocks back exact, so their radius is 0 from then on.
``value_tol`` promotes values to exact for a KV head whose output-error value term dominates its key
term and exceeds ``value_tol``.
``value_rel=ν`` (certified gates) bounds the value side relative to the head's value spread: every cell of a read is
served with its value term ``Σ_t p̃_t‖Δv_t‖ <= ν·max_t(‖v̂_t − c‖ + ‖Δv_t‖)``. A KV head above it has the entries
with the largest ``max_cells p̃_t‖Δv_t‖`` repaired, doubling their count until every cell is under: light values from
their upgraded codes (kept by a persistent gate within the device budget), other entries (and every entry of a store
without upgrade codecs) exact for the read; if the upgraded values' own error still leaves a cell above, the fewest
of them that pass are served exact instead (``docs/read-path.md#value-upgrades``).
``box=True`` (certified gates): before a KV head is repaired, its cells are certified again with ``min(meter,
tv_box)`` (the box supremum, ``docs/math.md#box-supremum``) on the same served distribution and radii; a head whose
cells are then all ``<= tau`` is served as is and reports the refined certificates. A block repair stops at the first
doubling round whose refined certificates are all ``<= tau``. The box costs far more than the meter, so it is only
computed for the heads the meter would repair.
``tier_b=True`` (with ``box=True``; dithered key codecs only): a KV head the certified box would still repair is
certified a third time, with the box over ``min(c, u)``, ``u`` the Tier-B radii at the read's ``δ_loc``
(``docs/math.md#tier-b-in-the-box``), and is served unrepaired when that bound is ``<= tau`` on every cell. Such a
read is **partially certified**: the bound holds with probability at least ``1 − δ_loc`` per cell that relies on
it, for queries independent of the dither. Each such cell is charged ``δ_loc`` against the request's Tier-B budget;
a row whose budget cannot pay for a head's cells has that head repaired instead (fail closed). Block repair rounds
use the certified bounds only, except an upgrade repair's (``StorageConfig(upgrade_keys=)``,
``docs/read-path.md#upgrade-repair``), which may serve the head on the partial bound after paging in some entries.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal

Mode = Literal["off", "certified", "risk_ranked"]
Granularity = Literal["head", "block"]


@dataclass(frozen=True)
class Gate:
    """A repair policy; construct with :meth:`off`, :meth:`certified` or :meth:`risk_ranked`."""

    mode: Mode = "off"
    threshold: float = float("inf")
    granularity: Granularity = "head"
    block_size: int = 64
    persistent: bool = False
    value_tol: float | None = None
    box: bool = False
    tier_b: bool = False
    value_rel: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("off", "certified", "risk_ranked"):
            raise ValueError(f"gate mode must be off, certified or risk_ranked, got {self.mode!r}")
        self._check_types()
        if self.mode == "off" and (
            self.threshold != float("inf")
            or self.value_tol is not None
            or self.value_rel is not None
            or self.persistent
            or self.box
        ):
            raise ValueError(
                "an off gate never repairs: it takes no threshold, value_tol, value_rel, persistent or box "
                "(use Gate.certified or Gate.risk_ranked to repair)"
            )
        if not self.threshold >= 0:
            raise ValueError(f"gate threshold must be >= 0, got {self.threshold}")
        if self.mode != "off" and not math.isfinite(self.threshold):
            raise ValueError(
                f"a {self.mode} gate needs a finite threshold (tau >= 0); got {self.threshold} "
                "(an infinite threshold never repairs: use Gate.off() to observe only)"
            )
        if self.mode == "certified" and self.threshold > 1:
            raise ValueError(
                f"a certified gate's tau bounds a total variation, so it is at most 1; got {self.threshold} (tau = 1 "
                "never repairs a key read; thresholds above 1 rank the unclipped meter: Gate.risk_ranked, risk:TAU)"
            )
        if self.granularity not in ("head", "block"):
            raise ValueError(f"granularity must be 'head' or 'block', got {self.granularity!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.value_tol is not None and not self.value_tol >= 0:
            raise ValueError(f"value_tol must be >= 0, got {self.value_tol}")
        if self.value_rel is not None and not 0 <= self.value_rel < float("inf"):
            raise ValueError(f"value_rel must be finite and >= 0, got {self.value_rel}")
        if self.value_rel is not None and self.mode != "certified":
            raise ValueError(f"value_rel bounds the value term of a certified gate's reads, got a {self.mode} gate")
        if self.box and self.mode != "certified":
            raise ValueError(f"box=True refines a certified gate (a bound on the TV), got a {self.mode} gate")
        if self.tier_b and not self.box:
            raise ValueError("tier_b=True reads the Tier-B radii through the box supremum: it needs box=True")

    def _check_types(self) -> None:
        """``TypeError`` naming the field for a value of the wrong type (a string threshold, a float block size, a
        flag that is not a bool: ``persistent="no"`` would otherwise read as true)."""
        for name in ("threshold", "value_tol", "value_rel"):
            value = getattr(self, name)
            if value is None and name != "threshold":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"gate {name} must be a real number, got {value!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(f"block_size must be an int, got {self.block_size!r}")
        for name in ("persistent", "box", "tier_b"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"gate {name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def off(cls) -> Gate:
        """Never repair (observe only)."""
        return cls("off")

    @classmethod
    def certified(
        cls,
        tau: float = 0.2,
        *,
        granularity: Granularity = "head",
        block_size: int = 64,
        persistent: bool = False,
        value_tol: float | None = None,
        box: bool = False,
        tier_b: bool = False,
        value_rel: float | None = None,
    ) -> Gate:
        """Repair every KV head whose clipped certificate exceeds ``tau`` for any of its query heads (with ``box``:
        whose ``min(meter, tv_box)`` does; with ``tier_b`` as well: whose partially certified box over the Tier-B
        radii does; with ``value_rel``: upgrade or page in values until each cell's value term is under ``value_rel``
        times the head's value spread, module doc)."""
        return cls("certified", tau, granularity, block_size, persistent, value_tol, box, tier_b, value_rel)

    @classmethod
    def risk_ranked(
        cls,
        tau_gate: float = 5.0,
        *,
        granularity: Granularity = "head",
        block_size: int = 64,
        persistent: bool = False,
        value_tol: float | None = None,
    ) -> Gate:
        """Repair every KV head whose *unclipped* meter exceeds ``tau_gate`` (saturated schemes)."""
        return cls("risk_ranked", tau_gate, granularity, block_size, persistent, value_tol)

    @property
    def uses_unclipped(self) -> bool:
        """Risk-ranked gating compares the unclipped meter; certified gating the clipped certificate."""
        return self.mode == "risk_ranked"

    def describe(self) -> str:
        """A short human-readable label, e.g. ``certified(tau=0.2, head)``, ``certified(tau=0.2, block, persistent)``,
        ``certified(tau=0.2, block, transient)`` or ``certified(tau=0.2, head, box)``."""
        if self.mode == "off":
            return "off"
        name = "tau" if self.mode == "certified" else "tau_gate"
        extra = ", persistent" if self.persistent else ", transient" if self.granularity == "block" else ""
        extra += ", box" if self.box else ""
        extra += ", tier-b" if self.tier_b else ""
        extra += f", value_tol={self.value_tol:g}" if self.value_tol is not None else ""
        extra += f", value_rel={self.value_rel:g}" if self.value_rel is not None else ""
        return f"{self.mode}({name}={self.threshold:g}, {self.granularity}{extra})"
