"""Tier registry: every number kvcert emits is registered with its tier and the reason
(``docs/contracts.md#tier-rules``).

Rules enforced here:
1. Emitting (or checking) an unregistered name is a hard error (:class:`UnregisteredMetric`), never a
   silent demotion.
2. Quantities that need an uncompressed reference (e.g. the *true* residual or the true TV measured
   against the exact cache) cannot be computed at serving time: :meth:`TierRegistry.check_bound_input`
   rejects them as bound inputs (:class:`ReferenceRequired`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvcert.contracts.tiers import Tier


class UnregisteredMetric(LookupError):
    """A metric name that is not in the tier registry was emitted or looked up."""


class ReferenceRequired(ValueError):
    """A quantity that needs the uncompressed reference was offered as a bound input."""


@dataclass(frozen=True)
class Registration:
    """A registered metric: its tier, the reason it earns that tier, and whether it needs a reference."""

    name: str
    tier: Tier
    reason: str
    requires_reference: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("name must be a non-empty str")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"reason must be a non-empty str for metric {self.name!r}")
        object.__setattr__(self, "tier", Tier.parse(self.tier))


@dataclass(frozen=True)
class Emission:
    """A value as emitted: it always travels with its registered tier and reason."""

    name: str
    value: float
    tier: Tier
    reason: str


class TierRegistry:
    """Mapping metric name -> :class:`Registration`."""

    def __init__(self, registrations: Iterable[Registration] = ()) -> None:
        self._entries: dict[str, Registration] = {}
        for r in registrations:
            self.register(r.name, r.tier, r.reason, r.requires_reference)

    def register(self, name: str, tier: Tier | str, reason: str, requires_reference: bool = False) -> Registration:
        """Register ``name``; re-registering identically is a no-op, differently a ``ValueError``."""
        entry = Registration(name, Tier.parse(tier), reason, bool(requires_reference))
        existing = self._entries.get(name)
        if existing is not None and existing != entry:
            raise ValueError(f"name {name!r} is already registered as {existing}; refusing to change it")
        self._entries[name] = entry
        return entry

    def check_emittable(self, name: str) -> Registration:
        """The registration of ``name``; :class:`UnregisteredMetric` if there is none."""
        entry = self._entries.get(name)
        if entry is None:
            raise UnregisteredMetric(
                f"metric {name!r} is not registered with a tier; register it (tier + reason) before emitting"
            )
        return entry

    def emit(self, name: str, value: float) -> Emission:
        """``value`` labelled with the registered tier of ``name`` (hard error if unregistered)."""
        entry = self.check_emittable(name)
        return Emission(name=name, value=float(value), tier=entry.tier, reason=entry.reason)

    def check_bound_input(self, name: str) -> Registration:
        """The registration of ``name`` if it may feed a bound; :class:`ReferenceRequired` if it needs the
        uncompressed reference, :class:`UnregisteredMetric` if unknown."""
        entry = self.check_emittable(name)
        if entry.requires_reference:
            raise ReferenceRequired(
                f"metric {name!r} needs the uncompressed reference ({entry.reason}); "
                "it is not computable at serving time and cannot be a bound input"
            )
        return entry

    def names(self) -> tuple[str, ...]:
        """All registered names, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries


_C, _P, _E = Tier.CERTIFIED, Tier.PARTIAL, Tier.EMPIRICAL

BUILTIN: tuple[Registration, ...] = (
    # dense KV read path (cache telemetry)
    Registration("certificates", _C, "softmax TV meter min(1, e-form, two-sided, ptm) on Tier-A radii"),
    Registration("raw", _C, "unclipped softmax TV meter; sound, values >= 1 are saturated"),
    Registration("served", _C, "TV certificate of the served (post-gate) read"),
    Registration("tanh", _C, "tanh ε bridge [softmax_tv_bridge_tanh]"),
    Registration("out_bound", _C, "attention output error ‖ΔO‖₂ <= E_key + E_val"),
    Registration("tier_b", _P, "dither radius: sound only for queries independent of the dither"),
    Registration("band_witness", _C, "Σ_b ‖Δ_b‖ >= ‖Δ‖ computed from stored codes at write time"),
    Registration("qnorm", _C, "scale·‖q‖₂ computed exactly per read (score-bridge coefficient)"),
    Registration("score_bridge_eps", _C, "ε = scale·‖q‖·W by Cauchy-Schwarz [score_bridge]"),
    Registration("tv_uniform", _C, "½(e^{2ε}-1) [softmax_tv_bridge]"),
    Registration("tv_affine", _P, "e^{2ε₀}·ε on the runtime premise ε <= ε₀ [softmax_tv_affine]"),
    Registration("logit_slack", _C, "float32 rounding of both logit dot products, sc·γ_{D+1}·‖q‖·(2‖k̂‖ + W)"),
    Registration(
        "chain_tv",
        _C,
        "per-layer chain store_witness -> score_bridge [-> fp32 logit rounding] -> "
        "softmax_uniform, evaluated with max-over-request coefficients",
    ),
    # latent KV (MLA)
    Registration("latent_witness", _C, "band witness of the latent residual through u = W_UKᵀq (Tier A)"),
    Registration("latent_tier_b", _P, "sub-Gaussian dither radius with failure probability δ (Tier B)"),
    # sparse selector
    Registration("topk_margin_cert_rate", _P, "rank-prefix stable rows: margin > 2ε (decidable subset)"),
    Registration("lost_mass", _P, "Lemma S2 selector mass lost on perturbed selections"),
    Registration("gain_mass", _P, "Lemma S2 selector mass gained on perturbed selections"),
    Registration("sel_bS", _P, "Lemma S2 b_S = ½(m_out + m_in) in selector_dist:tv"),
    Registration("sel_bridge_rho", _E, "omitted attention / selector mass ratio: a sample statistic"),
    Registration("sel_chain_tv", _E, "dense chain plus selection_s2 -> measured mass ratio rho (empirical)"),
    # recurrent state
    Registration("gate_a_t", _E, "forget-gate factors observed per channel; no certificate claimed"),
    Registration("gate_near_one_frac", _E, "observed fraction of forget factors >= 0.999"),
    Registration("gate_sum_log_a", _E, "observed Σ_t log a_t per channel (contraction criterion < 0)"),
    Registration("gate_half_life", _E, "half-life derived from observed gate factors"),
    Registration("gate_non_contracting_frac", _E, "observed fraction of channels with Σ_t log a_t >= 0"),
    Registration("gate_chain_product", _E, "max over channels of Π_t a_t: observed state-error decay"),
    # pooling
    Registration("pool_coef_l2", _C, "‖w‖₂ <= 1 for w >= 0, Σw = 1 [pool contract, ℓ2 form]"),
    Registration("pool_coef_linf", _C, "coefficient 1 with no assumption [pool_linf]"),
    Registration("pool_top1_norm", _E, "pooling concentration profile (observation)"),
    Registration("pool_entropy_n", _E, "normalised pooling-weight entropy (observation)"),
    Registration("pool_eff_frac", _E, "effective fraction of pooled entries (observation)"),
    Registration(
        "pool_chain_tv",
        _C,
        "per-layer chain pool_l2 -> store_witness -> score_bridge -> "
        "softmax_uniform on pooled entries, evaluated with max-over-request coefficients",
    ),
    # self-check counters and coverage (observations: counts carry no bound)
    Registration("triggers", _E, "probe call count (coverage)"),
    Registration("witness_violations", _E, "self-check count: W < ‖Δ‖ (must be 0)"),
    Registration("certified_flips", _E, "self-check count: top-r flip inside certified rows (must be 0)"),
    Registration("pooling_floor_violations", _E, "self-check count: ‖w‖₂ below its floor 1/√B (must be 0)"),
    # offline validation only: need the uncompressed reference
    Registration("true_tv", _E, "TV against the exact host-tier read (validate mode)", True),
    Registration("true_out_err", _E, "‖ΔO‖ against the exact read (validate mode)", True),
    Registration("true_residual", _E, "residual against the uncompressed entry", True),
    Registration("true_int8", _E, "int8 residual measured against the original entry", True),
)

REGISTRY = TierRegistry(BUILTIN)
"""The registry of every metric kvcert emits. Add new meters with ``REGISTRY.register(...)``."""


def register(name: str, tier: Tier | str, reason: str, requires_reference: bool = False) -> Registration:
    """Register ``name`` in :data:`REGISTRY` (see :meth:`TierRegistry.register`)."""
    return REGISTRY.register(name, tier, reason, requires_reference)


def check_emittable(name: str) -> Registration:
    """Registration of ``name`` in :data:`REGISTRY`; :class:`UnregisteredMetric` if absent."""
    return REGISTRY.check_emittable(name)


def emit(name: str, value: float) -> Emission:
    """``value`` labelled with the tier of ``name`` in :data:`REGISTRY` (hard error if unregistered)."""
    return REGISTRY.emit(name, value)


def check_bound_input(name: str) -> Registration:
    """See :meth:`TierRegistry.check_bound_input` (on :data:`REGISTRY`)."""
    return REGISTRY.check_bound_input(name)
