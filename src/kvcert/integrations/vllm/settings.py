"""Plugin settings, read from environment variables so every vLLM process (API server, engine core, workers)
sees the same configuration. Pure Python: importing this module never imports vLLM.

==================================  =================================================================
variable                            meaning (default)
==================================  =================================================================
``KVCERT_VLLM``                     ``1`` turns the plugin on; anything else leaves vLLM untouched
``KVCERT_VLLM_KEYS``                key codec name (``dither-int8``); a per-token codec (its codes fill
                                    vLLM's blocks one cell per token and KV head)
``KVCERT_VLLM_VALUES``              value codec name (``int4``); a per-token codec
``KVCERT_VLLM_GATE``                ``off`` | ``certified:TAU`` | ``risk:TAU_GATE`` (``certified:0.2``), either
                                    with ``:block`` for 64-token block repair written back exact
``KVCERT_VLLM_VALIDATE``            ``1``: also compute exact attention per read and count violations
``KVCERT_VLLM_RECORDS``             SQLite file the per-request records are written to (none)
``KVCERT_VLLM_SEED``                dither seed (random per process when unset)
``KVCERT_VLLM_LEDGER``              directory of the request ledger (``ledger.db`` event log, ``ledger.json``
                                    snapshot and ``summary.json`` at shutdown); unset or ``off``: no ledger
``KVCERT_VLLM_ALLOW_UNCERTIFIED``   ``1``: serve a model/layer/platform the plugin cannot certify with vLLM's
                                    own attention instead of refusing to start (responses say so)
``KVCERT_VLLM_EXACT_SINKS``         keep the tokens at the first N positions of every request exact
                                    (attention sinks; ``0``), as ``StorageConfig(exact_sinks=N)``
==================================  =================================================================

:meth:`Settings.from_env` validates everything (codec names, gate, seed) and raises ``ValueError`` naming the
variable, so a bad configuration fails before the engine starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kvcert.cache.gate import Gate, Granularity
from kvcert.cache.paged import check_per_token
from kvcert.cache.store import check_exact_sinks
from kvcert.quant import resolve

ENABLE = "KVCERT_VLLM"
KEYS = "KVCERT_VLLM_KEYS"
VALUES = "KVCERT_VLLM_VALUES"
GATE = "KVCERT_VLLM_GATE"
VALIDATE = "KVCERT_VLLM_VALIDATE"
RECORDS = "KVCERT_VLLM_RECORDS"
SEED = "KVCERT_VLLM_SEED"
LEDGER = "KVCERT_VLLM_LEDGER"
ALLOW_UNCERTIFIED = "KVCERT_VLLM_ALLOW_UNCERTIFIED"
EXACT_SINKS = "KVCERT_VLLM_EXACT_SINKS"
#: the repair units a gate spec may name after its threshold ("" = whole KV heads)
GATE_UNITS = ("", "block", "block-transient")

#: Hugging Face ``model_type`` values whose attention the plugin certifies (RoPE ``rotate_half`` pairing,
#: plain causal softmax attention, no sliding window, no soft-capping)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "mistral")


def gate_from_spec(
    text: str,
    label: str = f"{GATE} / --gate",
    accepted: str = (
        "off, certified:TAU[:UNIT][:box[:tier-b]][:values=NU] or risk:TAU_GATE[:UNIT] (UNIT: block | block-transient)"
    ),
) -> Gate:
    """``off`` | ``certified:TAU`` | ``risk:TAU_GATE``, each optionally ``:block`` or ``:block-transient`` ->
    :class:`~kvcert.cache.gate.Gate`; ``ValueError`` naming ``label`` otherwise (the threshold checks are
    :class:`Gate`'s). Without a unit the gate repairs whole KV heads (transient). ``:block`` repairs the 64-token
    blocks that carry the certificate and writes them back exact (``granularity="block"``, ``persistent=True``:
    their radius is 0 from then on, within the store's device budget); ``:block-transient`` pages the same blocks in
    for the read only (``persistent=False``: nothing kept, the device bytes never grow). A trailing ``:box``
    (certified gates only, e.g. ``certified:0.2:box`` or ``certified:0.2:block:box``) certifies the heads the meter
    would repair again with the box supremum first (``Gate.certified(tau, ..., box=True)``); ``:box:tier-b`` also
    serves a head unrepaired on the partially certified box over the Tier-B radii (``tier_b=True``, dithered keys).
    A last ``:values=NU`` (certified gates) adds the value gate (``value_rel=NU``,
    ``docs/read-path.md#value-upgrades``). Also the CLI's ``--gate`` parser."""
    if text == "off":
        return Gate.off()
    kind, _, rest = text.partition(":")
    value, *tail = rest.split(":")
    value_rel = None
    if tail and tail[-1].startswith("values="):
        value_rel = _number(tail.pop()[len("values=") :], label, accepted)
    tier_b = tail[-1:] == ["tier-b"]
    tail = tail[:-1] if tier_b else tail
    box = tail[-1:] == ["box"]
    tail = tail[:-1] if box else tail
    unit = tail[0] if len(tail) == 1 else "" if not tail else None
    if (
        kind not in ("certified", "risk")
        or unit not in GATE_UNITS
        or (box and kind != "certified")
        or (value_rel is not None and kind != "certified")
    ):
        raise ValueError(f"{label}: expected {accepted}, got {text!r}")
    if tier_b and not box:
        raise ValueError(
            f"{label}: ':tier-b' reads the Tier-B radii through the box: write ':box:tier-b', got {text!r}"
        )
    threshold = _number(value, label, accepted)
    granularity: Granularity = "block" if unit else "head"
    try:
        if kind == "certified":
            persistent = unit == "block"
            return Gate.certified(
                threshold, granularity=granularity, persistent=persistent, box=box, tier_b=tier_b, value_rel=value_rel
            )
        return Gate.risk_ranked(threshold, granularity=granularity, persistent=unit == "block")
    except ValueError as exc:
        raise ValueError(f"{label} {text!r}: {exc}") from None


def _number(value: str, label: str, accepted: str) -> float:
    """``value`` as a float; ``ValueError`` naming ``label`` otherwise (the range checks are :class:`Gate`'s)."""
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{label}: expected {accepted}; {value!r} is not a number") from None


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def _int(env: Mapping[str, str], name: str) -> int | None:
    """``env[name]`` as an int (``None`` when unset); ``ValueError`` naming the variable for anything else."""
    value = env.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


@dataclass(frozen=True)
class Settings:
    """The plugin configuration of one serving run (see the module docstring for the variables)."""

    keys: str = "dither-int8"
    values: str = "int4"
    gate: str = "certified:0.2"
    validate: bool = False
    records: str | None = None
    seed: int | None = None
    allow_uncertified: bool = False
    ledger: str | None = None
    exact_sinks: int = 0

    def __post_init__(self) -> None:
        check_exact_sinks(self.exact_sinks, f"{EXACT_SINKS} / --exact-sinks")
        if self.ledger == "off" or self.ledger == "":
            raise ValueError(f"{LEDGER} / --ledger: pass None for no ledger, not {self.ledger!r}")
        axes: tuple[tuple[str, str, Literal["key", "value"]], ...] = (
            (KEYS, self.keys, "key"),
            (VALUES, self.values, "value"),
        )
        for var, name, axis in axes:
            try:
                check_per_token(resolve(name, axis))  # its codes go into vLLM's blocks, one cell per token
            except ValueError as exc:
                raise ValueError(f"{var} / --{axis}s: {exc}") from None
        gate = gate_from_spec(self.gate)
        if gate.tier_b and not resolve(self.keys, "key").tier_b:
            raise ValueError(
                f"{GATE} / --gate {self.gate!r}: ':tier-b' reads the dither's Tier-B radii; {KEYS} / --keys must be "
                f"a dithered codec (dither-int*), got {self.keys!r}"
            )

    @property
    def gate_policy(self) -> Gate:
        """The parsed gate."""
        return gate_from_spec(self.gate)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read and validate the ``KVCERT_VLLM_*`` variables (``ValueError`` naming the bad one)."""
        env = os.environ if env is None else env
        sinks = _int(env, EXACT_SINKS)
        return cls(
            keys=env.get(KEYS, cls.keys),
            values=env.get(VALUES, cls.values),
            gate=env.get(GATE, cls.gate),
            validate=_flag(env, VALIDATE),
            records=env.get(RECORDS) or None,
            seed=_int(env, SEED),
            allow_uncertified=_flag(env, ALLOW_UNCERTIFIED),
            ledger=ledger_dir(env.get(LEDGER)),
            exact_sinks=0 if sinks is None else sinks,
        )

    def to_env(self) -> dict[str, str]:
        """The environment variables that reproduce these settings (plugin switched on)."""
        env = {
            ENABLE: "1",
            KEYS: self.keys,
            VALUES: self.values,
            GATE: self.gate,
            VALIDATE: "1" if self.validate else "0",
            ALLOW_UNCERTIFIED: "1" if self.allow_uncertified else "0",
            EXACT_SINKS: str(self.exact_sinks),
        }
        if self.records is not None:
            env[RECORDS] = self.records
        if self.seed is not None:
            env[SEED] = str(self.seed)
        env[LEDGER] = "off" if self.ledger is None else self.ledger
        return env


def ledger_dir(value: str | None) -> str | None:
    """``--ledger`` / ``KVCERT_VLLM_LEDGER``: a directory, or ``None`` for ``off`` / empty / unset."""
    return None if value is None or value in ("", "off") else value


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVCERT_VLLM=1`` switches the plugin on in this process."""
    return (os.environ if env is None else env).get(ENABLE) == "1"
