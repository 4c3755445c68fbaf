"""The zero-criteria gate over ledger snapshots (``docs/ledger.md#ledger-gate``).

Machine-decidable, no soft thresholds, and **missing data fails**: a criterion whose inputs are absent
from the snapshot is reported as failed with the reason.

Replicas (tensor-parallel ranks, :mod:`kvcert.serving.replicas`): every rank keeps its own ledger of the
same logical events. The logical criteria are evaluated once, on rank 0; the two replica criteria require
every declared rank to be present and every rank's accounts to be field-identical to rank 0's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

COUPLED_FIELDS: tuple[str, ...] = (
    "n_compressed",
    "n_kept_exact",
    "n_restored_exact",
    "delta_spent",
    "n_prob_events",
    "n_authorized",
    "n_auth_violations",
)
"""Write-side account fields every rank must agree on (``docs/ledger.md#ledger-gate``; the entries served exact
are counted as ``n_kept_exact`` and ``n_restored_exact``, both compared)."""

COUPLED_EPROCESS_FIELDS: tuple[str, ...] = ("log_m", "n_factors")
"""E-process fields every rank must agree on: the realised draws enter the ledger only through the
e-process factors, so ranks that drew differently (a rank-dependent seed) differ here even when the
counters above agree (audit violations are rare by construction)."""


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


class GateInputError(ValueError):
    """A snapshot handed to the gate has a field of the wrong type or range (named in the message)."""


ACCOUNT_COUNTERS: tuple[str, ...] = (
    "k", "n_written", "n_compressed", "n_kept_exact", "n_restored_exact", "n_authorized", "n_auth_violations",
    "n_prob_events", "n_empirical", "n_reads", "n_read_compressed", "n_read_exact", "n_read_unwritten",
    "n_read_stale", "n_read_foreign_owner", "n_read_shared", "n_read_by_others",
)  # fmt: skip


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_fields(obj: dict[str, Any], where: str, checks: dict[str, tuple[Any, str]]) -> None:
    for key, (ok, want) in checks.items():
        if key in obj and not ok(obj[key]):
            raise GateInputError(f"{where}.{key}: expected {want}, got {obj[key]!r}")


def _check_eprocess(e: object, where: str) -> None:
    if not isinstance(e, dict):
        raise GateInputError(f"{where}: expected an object, got {type(e).__name__}")
    _check_fields(e, where, {
        "log_m": (_real, "a finite number"),
        "log_m_max": (lambda v: v is None or _real(v), "a finite number or null"),
        "n_factors": (_count, "an int >= 0"),
        "crossed": (lambda v: isinstance(v, bool), "true or false"),
        "delta_e": (lambda v: _real(v) and 0 < v < 1, "a number in (0, 1)"),
    })  # fmt: skip


def check_snapshot(data: object, where: str = "snapshot") -> dict[str, Any]:
    """``data`` if every field the gate reads has its type and range (:class:`GateInputError` naming the
    first that does not). Absent fields are allowed: the gate then fails the criterion as missing data.
    Checked: ``rank``/``n_ranks`` (ints, ``0 <= rank < n_ranks``), ``accounts`` (UID keys; counters ints
    >= 0, so negative counters cannot cancel; ``delta_req`` in (0, 1], ``delta_spent`` >= 0; e-process),
    ``global`` counters (ints >= 0) and the global ``eprocess``."""
    if not isinstance(data, dict):
        raise GateInputError(f"{where}: expected a ledger snapshot object, got {type(data).__name__}")
    _check_fields(data, where, {
        "rank": (_count, "an int >= 0"),
        "n_ranks": (lambda v: _count(v) and v >= 1, "an int >= 1"),
    })  # fmt: skip
    if _count(data.get("rank")) and _count(data.get("n_ranks")) and not data["rank"] < data["n_ranks"]:
        raise GateInputError(f"{where}: rank {data['rank']} outside [0, n_ranks={data['n_ranks']})")
    accounts = data.get("accounts", {})
    if not isinstance(accounts, dict):
        raise GateInputError(f"{where}.accounts: expected an object, got {type(accounts).__name__}")
    for uid, a in accounts.items():
        at = f"{where}.accounts.{uid}"
        if not (uid.isdigit() and uid.isascii()):
            raise GateInputError(f"{at}: account keys are request UIDs (ints >= 0)")
        if not isinstance(a, dict):
            raise GateInputError(f"{at}: expected an object, got {type(a).__name__}")
        _check_fields(a, at, {k: (_count, "an int >= 0") for k in ACCOUNT_COUNTERS})
        _check_fields(a, at, {
            "uid": (lambda v, u=uid: _count(v) and str(v) == u, f"the account key {uid}"),
            "delta_req": (lambda v: _real(v) and 0 < v <= 1, "a number in (0, 1]"),
            "delta_spent": (lambda v: _real(v) and v >= 0, "a finite number >= 0"),
        })  # fmt: skip
        if "eprocess" in a:
            _check_eprocess(a["eprocess"], f"{at}.eprocess")
    glob = data.get("global", {})
    if not isinstance(glob, dict):
        raise GateInputError(f"{where}.global: expected an object, got {type(glob).__name__}")
    _check_fields(glob, f"{where}.global", {k: (_count, "an int >= 0") for k in glob})
    if "eprocess" in data:
        _check_eprocess(data["eprocess"], f"{where}.eprocess")
    return data


def _sum(accounts: dict[str, Any], key: str) -> int | None:
    """Total of ``key`` over the accounts; None if any account lacks it (missing data)."""
    values = [a.get(key) for a in accounts.values()]
    return None if None in values else sum(values)


def evaluate(snapshot: dict[str, Any] | Sequence[dict[str, Any]], n_user_requests: int | None = None) -> GateResult:
    """Evaluate the criteria on one snapshot (from :meth:`Ledger.snapshot`) or on the snapshots of all the
    replica ranks of one run.

    Criteria (on rank 0, or on the lowest rank present): user requests present (exactly
    ``n_user_requests`` if given), every account's ``delta_spent ≤ delta_req``, 0 foreign reads outside
    declared sharing, 0 unwritten and 0 stale reads, 0 authorisation violations, 0 identity fail-closed
    entries and reads, 0 attribution fallbacks, e-process has factors, its ``log M`` maximum is present,
    and it never crossed; then ``n_ranks_seen == n_ranks`` and replica coupling (see
    :func:`replica_criteria`).
    """
    snaps = [snapshot] if isinstance(snapshot, dict) else list(snapshot)
    if not snaps:
        raise ValueError("no snapshot to evaluate")
    for i, snap in enumerate(snaps):
        check_snapshot(snap, f"snapshot[{i}]" if len(snaps) > 1 else "snapshot")
    ranked = [s for s in snaps if isinstance(s.get("rank"), int)]
    primary = min(ranked, key=lambda s: s["rank"]) if ranked else snaps[0]
    return GateResult(_logical_criteria(primary, n_user_requests) + replica_criteria(snaps))


def replica_criteria(snapshots: Sequence[dict[str, Any]]) -> tuple[Criterion, ...]:
    """``n_ranks_seen==n_ranks``: every snapshot declares the same ``n_ranks`` and the ranks seen are exactly
    ``0 … n_ranks−1`` (a missing rank fails; rank 0 alone with ``n_ranks > 1`` fails).
    ``replica_coupling_identical``: every rank has the same accounts as rank 0, field-identical on
    :data:`COUPLED_FIELDS` and :data:`COUPLED_EPROCESS_FIELDS`; a difference is reported with its rank,
    account and field. With one rank the coupling holds trivially (and says so)."""
    raw_ranks = [s.get("rank") for s in snapshots]
    raw_declared = {s.get("n_ranks") for s in snapshots}
    ranks = [r for r in raw_ranks if isinstance(r, int)]
    declared = {n for n in raw_declared if isinstance(n, int)}
    if len(ranks) != len(raw_ranks) or len(declared) != len(raw_declared):
        missing = "missing data (a snapshot lacks rank or n_ranks)"
        return Criterion("n_ranks_seen==n_ranks", False, missing), Criterion(
            "replica_coupling_identical", False, missing
        )
    seen = sorted(ranks)
    if len(declared) != 1:
        seen_ok, observed = False, f"ranks declare different n_ranks: {sorted(declared)}"
    else:
        n = declared.pop()
        absent = sorted(set(range(n)) - set(seen))
        extra = sorted({r for r in seen if not 0 <= r < n} | {r for r in seen if seen.count(r) > 1})
        seen_ok = seen == list(range(n))
        observed = f"{len(set(seen))} of {n} ranks seen {seen}" + (f"; missing {absent}" if absent else "")
        observed += f"; duplicate or out-of-range {extra}" if extra else ""
    by_rank = {s["rank"]: s for s in snapshots}
    base_rank = min(by_rank)
    base = by_rank[base_rank]
    diffs: list[str] = []
    for r in sorted(by_rank):
        if r != base_rank:
            diffs += _coupling_diffs(base, by_rank[r], r)
    if diffs:
        coupled = f"{len(diffs)} difference(s): " + "; ".join(diffs[:5]) + (" …" if len(diffs) > 5 else "")
    elif len(by_rank) == 1:
        coupled = f"trivially identical (rank {base_rank} only)"
    else:
        coupled = f"{len(by_rank)} ranks identical on {len(base.get('accounts', {}))} accounts"
    return (
        Criterion("n_ranks_seen==n_ranks", seen_ok, observed),
        Criterion("replica_coupling_identical", not diffs, coupled),
    )


def _coupling_diffs(base: dict[str, Any], other: dict[str, Any], rank: int) -> list[str]:
    """Every coupled field where rank ``rank`` differs from the base rank (missing data is a difference)."""
    a, b = base.get("accounts"), other.get("accounts")
    if not isinstance(a, dict) or not isinstance(b, dict):
        return [f"rank {rank}: accounts missing"]
    out = [f"rank {rank}: account {u} missing" for u in sorted(set(a) - set(b), key=int)]
    out += [f"rank {rank}: account {u} not on rank {base['rank']}" for u in sorted(set(b) - set(a), key=int)]
    for uid in sorted(set(a) & set(b), key=int):
        for field in COUPLED_FIELDS:
            x, y = a[uid].get(field), b[uid].get(field)
            if x is None or x != y:
                out.append(f"rank {rank}: account {uid} {field} {y!r} != {x!r}")
        ea, eb = a[uid].get("eprocess") or {}, b[uid].get("eprocess") or {}
        for field in COUPLED_EPROCESS_FIELDS:
            x, y = ea.get(field), eb.get(field)
            if x is None or x != y:
                out.append(f"rank {rank}: account {uid} eprocess.{field} {y!r} != {x!r}")
    return out


def _logical_criteria(snapshot: dict[str, Any], n_user_requests: int | None) -> tuple[Criterion, ...]:
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
        over = [u for u, a in accounts.items() if not a.get("delta_spent", math.inf) <= a.get("delta_req", -1.0)]
        worst = max((a.get("delta_spent", math.nan) for a in accounts.values()), default=0.0)
        out.append(Criterion("all_budgets<=delta_req", not over, f"max delta_spent={worst:.7g}; over: {over}"))
        for name, key in (
            ("foreign_reads==0", "n_read_foreign_owner"),
            ("read_unwritten==0", "n_read_unwritten"),
            ("read_stale==0", "n_read_stale"),
            ("auth_violations==0", "n_auth_violations"),
        ):
            v = _sum(accounts, key)
            out.append(Criterion(name, v == 0, "missing data" if v is None else str(v)))
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
    return tuple(out)
