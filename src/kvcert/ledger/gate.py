"""The zero-criteria gate over a ledger snapshot (``heterogeneous-memory.md`` §5.9).

Machine-decidable, no soft thresholds, and **missing data fails**: a criterion whose inputs are absent
from the snapshot is reported as failed with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Criterion:
    """One named criterion, its verdict and the observed value (or the reason it could not be decided)."""

    name: str
    passed: bool
    observed: str


@dataclass(frozen=True)
class GateResult:
    """All criteria; ``passed`` only if every one passed."""

    criteria: tuple[Criterion, ...]

    @property
    def passed(self) -> bool:
        """True iff every criterion passed (and there is at least one)."""
        return bool(self.criteria) and all(c.passed for c in self.criteria)

    @property
    def exit_code(self) -> int:
        """0 when the gate passes, 1 otherwise."""
        return 0 if self.passed else 1


def _sum(accounts: dict[str, Any], key: str) -> int:
    return sum(int(a[key]) for a in accounts.values())


def evaluate(snapshot: dict[str, Any], n_user_requests: int | None = None) -> GateResult:
    """Evaluate the criteria on ``snapshot`` (from :meth:`Ledger.snapshot`).

    Criteria: user requests present (exactly ``n_user_requests`` if given), every account's
    ``delta_spent ≤ delta_req``, 0 foreign reads outside declared sharing, 0 unwritten and 0 stale reads,
    0 authorisation violations, 0 identity fail-closed entries and reads, 0 attribution fallbacks,
    e-process has factors, its ``log M`` maximum is present, and it never crossed.
    """
    out: list[Criterion] = []

    def need(*keys: str) -> dict[str, Any] | None:
        cur: Any = snapshot
        for k in keys:
            if not isinstance(cur, dict) or k not in cur:
                out.append(Criterion(".".join(keys), False, "missing data"))
                return None
            cur = cur[k]
        return cur

    accounts = need("accounts")
    glob = need("global")
    eproc = need("eprocess")
    if accounts is not None:
        users = sum(1 for a in accounts.values() if a.get("n_reads", 0) > 0)
        ok = users > 0 if n_user_requests is None else users == n_user_requests
        want = ">0" if n_user_requests is None else f"=={n_user_requests}"
        out.append(Criterion("n_user_requests", ok, f"{users} (want {want})"))
        over = [u for u, a in accounts.items() if not a["delta_spent"] <= a["delta_req"]]
        worst = max((a["delta_spent"] for a in accounts.values()), default=0.0)
        out.append(Criterion("all_budgets<=delta_req", not over, f"max delta_spent={worst:.7g}; over: {over}"))
        for name, key in (
            ("foreign_reads==0", "n_read_foreign_owner"),
            ("read_unwritten==0", "n_read_unwritten"),
            ("read_stale==0", "n_read_stale"),
            ("auth_violations==0", "n_auth_violations"),
        ):
            v = _sum(accounts, key)
            out.append(Criterion(name, v == 0, str(v)))
    if glob is not None:
        for name, key in (
            ("identity_fail_closed==0", "identity_fail_closed"),
            ("identity_fail_closed_reads==0", "identity_fail_closed_reads"),
            ("uid_group_fallbacks==0", "uid_group_fallbacks"),
        ):
            if key not in glob:
                out.append(Criterion(name, False, "missing data"))
                continue
            v = int(glob[key])
            out.append(Criterion(name, v == 0, str(v)))
    if eproc is not None:
        n = eproc.get("n_factors")
        out.append(Criterion("eprocess_has_factors", isinstance(n, int) and n > 0, str(n)))
        lm = eproc.get("log_m_max")
        out.append(Criterion("eprocess_logM_present", isinstance(lm, float), str(lm)))
        crossed = eproc.get("crossed")
        out.append(Criterion("eprocess_not_crossed", crossed is False, str(crossed)))
    return GateResult(tuple(out))
