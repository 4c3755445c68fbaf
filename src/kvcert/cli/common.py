"""Shared CLI plumbing: model loading (zoo name, local path, ``tiny:<family>``), scheme and gate parsing."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import typer  # noqa: E402
from transformers import AutoTokenizer, PreTrainedModel  # noqa: E402
from transformers.tokenization_utils_base import PreTrainedTokenizerBase  # noqa: E402

from kvcert.attention.evict_driver import RESIDENT_ALLOCS, default_select  # noqa: E402
from kvcert.attention.resident import RECALLS, SUMMARIES  # noqa: E402
from kvcert.attention.tier_choice import check_heavy_share  # noqa: E402
from kvcert.cache.gate import Gate  # noqa: E402
from kvcert.cache.store import (  # noqa: E402
    DEFAULT_WITNESS,
    WITNESS_FORMATS,
    Witness,
    check_exact_sinks,
    check_heavy_values,
    check_upgrade,
)
from kvcert.evict import H2O, RMM, EvictionPolicy, StreamingLLM, prefill_kept_count  # noqa: E402
from kvcert.integrations.vllm.settings import gate_from_spec  # noqa: E402
from kvcert.models.tiny import SUPPORTED_FAMILIES, tiny_random  # noqa: E402
from kvcert.models.zoo import ZOO, converted_dir  # noqa: E402
from kvcert.models.zoo import load as zoo_load  # noqa: E402
from kvcert.quant import BUILTINS, Allocation, get, resolve  # noqa: E402
from kvcert.quant.registry import BYPASS_SUFFIX, split_bypass  # noqa: E402

TINY_PREFIX = "tiny:"
TINY_TOKENIZER_MODEL = "smollm2-135m"
TINY_HEAD_DIM = 64  # as SmolLM2; the grouped codecs need group sizes (32) that divide it
DEFAULT_SCHEMES = "fp8-e4m3,int4,kivi-2,int2,dither-int8/int4"
INFORMATIVE_MIN = 0.5
CERTIFIED_TAU = 0.2
RISK_TAU_GATE = 5.0
REPAIR_BLOCK = 64

# Options shared by the RULER / perplexity / audit commands.
ModelOption = Annotated[str, typer.Option(help="smollm2-135m, a local transformers folder, or tiny:<family>")]
SchemesOption = Annotated[str, typer.Option(help="comma-separated codecs or keycodec/valuecodec")]
GateOption = Annotated[
    str,
    typer.Option(
        help="auto | off | certified:TAU | risk:TAU_GATE, either with :block or :block-transient; certified gates "
        "may end in :box (the box supremum before repair), :box:tier-b, and last :values=NU (the value gate)"
    ),
]
WitnessOption = Annotated[
    str, typer.Option(help="witness storage: log8 (8-bit codes decoding upwards, bands + 1 B/token/KV head) | f32")
]
DeviceBudgetOption = Annotated[
    str,
    typer.Option(help="cap on each layer's device bytes after persistent repair, a fraction of fp16 K/V (or 'none')"),
]
ExactSinksOption = Annotated[
    int,
    typer.Option(help="keep the tokens at the first N positions of every request exact (attention sinks)"),
]
UpgradeOption = Annotated[
    str | None,
    typer.Option(
        help="KEYCODEC/VALUECODEC: persistent block repairs keep the repaired entries re-encoded in these codecs "
        "instead of exact (docs/read-path.md#upgrade-repair)"
    ),
]
HeavyShareOption = Annotated[
    float | None,
    typer.Option(
        help="token tiers (needs --upgrade): this share of each KV head's prompt tokens, those its prefill attention "
        "singles out, stored in the --upgrade codecs instead of the light ones (docs/read-path.md#token-tiers)"
    ),
]
HeavyValuesOption = Annotated[
    str | None,
    typer.Option(
        metavar="CODEC:SHARE",
        help="token tiers (needs --heavy-share): the heavy values in CODEC (a per-token codec), the top SHARE of the "
        "same ranking, instead of the --upgrade value codec on the --heavy-share (docs/read-path.md#heavy-values)",
    ),
]
BandsOption = Annotated[
    int,
    typer.Option(
        help="key-witness bands of whole RoPE pairs per KV head (StorageConfig(bands=)): fewer store fewer witness "
        "bytes and loosen the Tier-A radius, not the Tier-B one (docs/math.md#compact-witnesses)"
    ),
]
# Options shared by the RULER commands (``kvcert eval``, ``kvcert frontier``).
TasksOption = Annotated[str, typer.Option(help="comma-separated RULER tasks")]
ContextOption = Annotated[int, typer.Option(help="RULER sequence length in tokens")]
SamplesOption = Annotated[int, typer.Option(help="samples per task")]
SeedOption = Annotated[int, typer.Option(help="seed for data, codecs and bootstrap")]
MaxNewTokensOption = Annotated[int | None, typer.Option(help="cap on RULER's generation budget")]
ResamplesOption = Annotated[int, typer.Option(help="paired bootstrap resamples")]

# Resident-set selection policies by CLI name (``docs/cli.md#resident-variants``): each call builds a fresh
# policy (policies keep per-request state). snapkv is the library's default_select (SnapKV(window=32,
# kernel=5)); the others use their constructors' defaults, RMM with the same 32-token protected tail as SnapKV.
SELECT_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "snapkv": default_select,
    "streaming": StreamingLLM,
    "h2o": H2O,
    "rmm": lambda: RMM(lag=32, kappa="uniform"),
}
DEFAULT_SELECT = "snapkv"
RUN_RESIDENT_FRACTION = 0.25
RUN_RESIDENT_CODEC = "int8"


@dataclass
class LoadedModel:
    """A model in eval mode, its tokenizer and the plain tokenizer folder (for RULER's generators)."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    tokenizer_dir: Path

    @property
    def eos_ids(self) -> list[int]:
        """Token ids that end a greedy continuation (tokenizer EOS and the generation config's EOS)."""
        ids = {self.tokenizer.eos_token_id}
        gen = getattr(self.model, "generation_config", None)
        extra = getattr(gen, "eos_token_id", None) if gen is not None else None
        ids.update(extra if isinstance(extra, list) else [extra])
        return sorted(i for i in ids if i is not None)


def load_model(spec: str, seed: int = 0) -> LoadedModel:
    """Load ``spec``: a zoo name (``smollm2-135m``), a local transformers folder, or ``tiny:<family>``.

    ``tiny:<family>`` is a random-weight model from :func:`kvcert.models.tiny.tiny_random` (weights seeded
    by ``seed``) with its vocabulary matched to the SmolLM2 tokenizer. Raises ``ValueError`` naming
    ``model`` for an unknown spec.
    """
    if spec.startswith(TINY_PREFIX):
        family = spec[len(TINY_PREFIX) :]
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(f"model: unknown tiny family {family!r}; supported are {list(SUPPORTED_FAMILIES)}")
        tok_dir = converted_dir(TINY_TOKENIZER_MODEL)
        tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        model = tiny_random(family, seed=seed, vocab_size=len(tok), head_dim=TINY_HEAD_DIM)
        return LoadedModel(spec, model, tok, tok_dir)
    if spec in ZOO:
        model, tok = zoo_load(spec)
        return LoadedModel(spec, model, tok, converted_dir(spec))
    if Path(spec).is_dir():
        model, tok = zoo_load(spec)
        return LoadedModel(spec, model, tok, Path(spec))
    raise ValueError(f"model: {spec!r} is not a known name {sorted(ZOO)}, a local folder, or tiny:<family>")


@dataclass(frozen=True)
class SchemeSpec:
    """A compressed KV configuration: key codec and value codec (registry names), witness storage, device budget
    and exact sink positions (``StorageConfig(witness=, device_budget=, exact_sinks=)``); or, with ``allocation``,
    the per-(layer, KV head) key widths and value codecs of a ``kvcert allocate`` file (``keys`` / ``values`` then
    only describe it)."""

    keys: str
    values: str
    witness: Witness = DEFAULT_WITNESS
    device_budget: float | None = 1.0
    allocation: Allocation | None = None
    exact_sinks: int = 0
    upgrade: tuple[str, str] | None = None  # ``StorageConfig(upgrade_keys=, upgrade_values=)``
    heavy_share: float | None = None  # ``StorageConfig(heavy_share=)`` (token tiers)
    bands: int = 8  # ``StorageConfig(bands=)``: key-witness bands
    heavy_values: tuple[str, float] | None = None  # ``StorageConfig(heavy_values=, heavy_value_share=)``

    @property
    def label(self) -> str:
        """``allocated`` for an allocation; else ``keys`` when both codecs agree, else ``keys/values``."""
        if self.allocation is not None:
            return ALLOCATED
        return self.keys if self.keys == self.values else f"{self.keys}/{self.values}"


#: the label of the scheme an ``--allocation`` file adds
ALLOCATED = "allocated"
AllocationOption = Annotated[
    Path | None,
    typer.Option(help="also run the per-(layer, KV head) codecs of this kvcert-allocate file, as 'allocated'"),
]


def allocation_spec(path: Path | None) -> list[SchemeSpec]:
    """The scheme of ``--allocation`` (none without one; :func:`parse_storage` sets its witness and budget):
    ``ValueError`` naming the option for a file that is not an allocation."""
    if path is None:
        return []
    try:
        alloc = Allocation.load(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"--allocation: {err}") from None
    return [SchemeSpec("dither-mixed", "per-head", allocation=alloc)]


def check_tier_b_gate(text: str, gate: Gate | None, specs: Sequence[SchemeSpec]) -> None:
    """``ValueError`` naming ``--gate`` when a Tier-B gate (``text``, parsed as ``gate``) would run over a scheme whose
    keys are not dithered (it reads the dither's Tier-B radii)."""
    plain_keys = [s.keys for s in specs if not get(s.keys).tier_b]
    if gate is not None and gate.tier_b and plain_keys:
        raise ValueError(
            f"--gate {text}: ':tier-b' reads the dither's Tier-B radii, so every scheme needs dithered keys "
            f"(dither-int*); not {', '.join(plain_keys)}"
        )


def schemes_fit(specs: Sequence[SchemeSpec], model: Any) -> None:
    """``ValueError`` naming the option for a scheme the loaded ``model`` cannot hold, checked once it is loaded and
    before any sample: an ``--allocation`` calibrated for another number of layers or KV heads, or a ``+bypass<m>``
    codec of ``--schemes`` keeping more RoPE pairs than a head has (both used to fail at the first sample)."""
    cfg = model.config.get_text_config()
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads or cfg.num_attention_heads
    pairs = (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) // 2
    for spec in specs:
        alloc = spec.allocation
        if alloc is not None and (len(alloc.key_bits) != layers or any(len(r) != heads for r in alloc.key_bits)):
            shape = f"{len(alloc.key_bits)} layers × {len(alloc.key_bits[0]) if alloc.key_bits else 0} KV heads"
            raise ValueError(
                f"--allocation was calibrated for {shape} (on {alloc.provenance.get('model', 'an unnamed model')}); "
                f"the model has {layers} layers × {heads} KV heads"
            )
        if alloc is None:
            for name in (spec.keys, spec.values):
                kept = split_bypass(name)[1]
                if kept > pairs:
                    raise ValueError(f"--schemes {name}: keeps {kept} RoPE pairs exact; a head here has {pairs}")


def task_names(text: str) -> tuple[str, ...]:
    """The tasks of a ``--tasks`` value: comma-separated names, blanks dropped (each checked by
    :func:`kvcert.cli.validate.ruler_tasks`)."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def parse_schemes(text: str) -> list[SchemeSpec]:
    """Parse ``"int4,kivi-2,dither-int8/int4"``: comma-separated ``codec`` or ``keycodec/valuecodec``.

    The dense (uncompressed) baseline is always run and must not be listed. Raises ``ValueError`` naming
    ``schemes`` for unknown codecs, duplicates or an empty list.
    """
    out: list[SchemeSpec] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = item.split("/")
        if len(parts) > 2:
            raise ValueError(f"schemes: {item!r} has more than one '/' (use keycodec/valuecodec)")
        for codec in parts:
            try:
                base, _ = split_bypass(codec)
            except ValueError as err:
                raise ValueError(f"schemes: {err}") from None
            if base not in BUILTINS:
                raise ValueError(
                    f"schemes: unknown codec {codec!r}; known are {sorted(BUILTINS)} (each may end in "
                    f"{BYPASS_SUFFIX}<pairs>)"
                )
        spec = SchemeSpec(parts[0], parts[-1])
        if spec in out:
            raise ValueError(f"schemes: {item!r} is listed twice")
        out.append(spec)
    if not out:
        raise ValueError("schemes: no scheme given")
    return out


def parse_storage(
    specs: list[SchemeSpec],
    witness: str,
    device_budget: str,
    exact_sinks: int = 0,
    upgrade: str | None = None,
    heavy_share: float | None = None,
    bands: int = 8,
    heavy_values: str | None = None,
) -> list[SchemeSpec]:
    """``specs`` with ``--witness`` (one of ``WITNESS_FORMATS``), ``--device-budget`` (a fraction > 0 of the fp16
    K/V bytes, or ``none``), ``--exact-sinks`` (``>= 0``), ``--upgrade`` (:func:`parse_upgrade`),
    ``--heavy-share`` (a fraction in (0, 1), with ``--upgrade``), ``--bands`` (``>= 1``) and ``--heavy-values``
    (:func:`parse_heavy_values`, with ``--heavy-share``) applied to each; ``ValueError`` naming the option
    otherwise."""
    check_exact_sinks(exact_sinks, "--exact-sinks")
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise ValueError(f"--bands: expected an integer >= 1 (witness bands of whole RoPE pairs), got {bands!r}")
    codecs = parse_upgrade(upgrade, specs)
    if heavy_share is not None:
        if codecs is None:
            raise ValueError("--heavy-share stores the heavy tokens in the --upgrade codecs: give --upgrade too")
        try:
            check_heavy_share(heavy_share)
        except ValueError as err:
            raise ValueError(f"--heavy-share: {err}") from None
    elif heavy_values is not None:
        raise ValueError("--heavy-values is a setting of token tiers: give --heavy-share too")
    tiers = parse_heavy_values(heavy_values)
    if witness not in WITNESS_FORMATS:
        raise ValueError(f"--witness: expected one of {', '.join(WITNESS_FORMATS)}, got {witness!r}")
    budget: float | None = None
    if device_budget != "none":
        try:
            budget = float(device_budget)
        except ValueError:
            raise ValueError(f"--device-budget: expected a fraction > 0 or 'none', got {device_budget!r}") from None
        if not 0.0 < budget < float("inf"):
            raise ValueError(f"--device-budget: expected a finite fraction > 0 or 'none', got {device_budget!r}")
    form: Witness = "log8" if witness == "log8" else "f32"
    return [
        SchemeSpec(s.keys, s.values, form, budget, s.allocation, exact_sinks, codecs, heavy_share, bands, tiers)
        for s in specs
    ]


def parse_upgrade(text: str | None, specs: list[SchemeSpec]) -> tuple[str, str] | None:
    """``--upgrade KEYCODEC/VALUECODEC`` as the pair of codec names (``None`` when not given), checked against every
    scheme of ``specs`` as a store would check it (:func:`kvcert.cache.store.check_upgrade`: per-token codecs; Tier-B
    keys need Tier-B upgrade keys of the same group size and bypass); ``ValueError`` naming ``--upgrade`` otherwise."""
    if text is None:
        return None
    parts = text.split("/")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"--upgrade: expected KEYCODEC/VALUECODEC, got {text!r}")
    try:
        up = (resolve(parts[0], "key"), resolve(parts[1], "value"))
        for spec in specs:
            if spec.allocation is None:
                check_upgrade(resolve(spec.keys, "key"), up)
    except ValueError as err:
        raise ValueError(f"--upgrade: {err}") from None
    return parts[0], parts[1]


def parse_heavy_values(text: str | None) -> tuple[str, float] | None:
    """``--heavy-values CODEC:SHARE`` (``StorageConfig(heavy_values=, heavy_value_share=)``: the heavy values of
    token tiers in ``CODEC``, the top ``SHARE`` of the prompt's ranking) as ``(codec name, share)``, ``None`` when not
    given; ``ValueError`` naming ``--heavy-values`` unless ``CODEC`` is a per-token codec and ``SHARE`` a fraction in
    (0, 1)."""
    if text is None:
        return None
    name, sep, share = text.rpartition(":")
    try:
        if not sep or not name:
            raise ValueError(f"expected CODEC:SHARE (e.g. int8:0.1), got {text!r}")
        try:
            fraction = float(share)
        except ValueError:
            raise ValueError(f"the share must be a number, got {share!r}") from None
        check_heavy_share(fraction)
        check_heavy_values(resolve(name, "value"), token_tiers=True)
    except ValueError as err:
        raise ValueError(f"--heavy-values: {err}") from None
    return name, fraction


def parse_gate(text: str) -> Gate | None:
    """Parse ``auto`` (``None``: each scheme by its meter), ``off``, ``certified:TAU``, ``risk:TAU`` (each with an
    optional repair unit, certified ones with an optional trailing ``:box`` or ``:box:tier-b`` and a last
    ``:values=NU``, the value gate;
    :func:`gate_from_spec`).

    ``TAU`` must be a finite number ``>= 0`` (``inf``, ``1e400``, ``nan`` and negatives are refused by
    :class:`~kvcert.cache.gate.Gate`: an infinite threshold never repairs). ``ValueError`` naming ``--gate``.
    """
    if text == "auto":
        return None
    return gate_from_spec(
        text,
        "--gate",
        "auto, off, certified:TAU[:UNIT][:box[:tier-b]][:values=NU] or risk:TAU[:UNIT] (UNIT: block | block-transient)",
    )


@dataclass(frozen=True)
class ResidentPlan:
    """Resident variants of a RULER job: each listed scheme also runs with a resident set of ``fraction`` of
    its tokens chosen by ``select`` (a :data:`SELECT_POLICIES` name), gated by ``gate`` (``certified(τ)`` at
    head granularity, or ``off``: certificates without recall), re-selected every ``reselect`` decode steps
    (``None``: never), the omitted tokens' keys summarised as ``summary`` (a :data:`SUMMARIES` name), the resident
    tokens split across layers by ``alloc`` (``EvictionConfig.resident_set(resident_alloc=)``: ``uniform`` or
    ``mass``), recalled pages kept, paged in per read or swapped into the resident set as ``recall``
    (``EvictionConfig.resident_set(recall=)``, a :data:`~kvcert.attention.resident.RECALLS` name)."""

    fraction: float
    select: str
    gate: Gate
    specs: tuple[SchemeSpec, ...]
    reselect: int | None = None
    summary: str = "int8"
    alloc: str = "uniform"
    recall: str = "persistent"

    def policy(self) -> EvictionPolicy:
        """A fresh selection policy for one request."""
        return SELECT_POLICIES[self.select]()


def check_resident_options(
    resident: float | None,
    select: str | None,
    reselect: int | None = None,
    specs: tuple[SchemeSpec, ...] = (),
    summary: str | None = None,
    alloc: str | None = None,
    recall: str | None = None,
) -> None:
    """``--resident`` in (0, 1], ``--select`` a known policy, ``--reselect`` a positive step count, ``--summary`` a
    known summary, ``--resident-alloc`` a known split and ``--recall`` a known recall form (all only together with
    ``--resident``; ``--reselect`` and ``--recall swap`` not with a dithered codec in ``specs``: both re-encode
    promoted tokens; ``--resident-alloc mass`` not with ``--select streaming``, whose scores are no attention);
    ``ValueError`` naming the option otherwise."""
    if resident is not None and not 0.0 < resident <= 1.0:
        raise ValueError(f"--resident must be a fraction in (0, 1], got {resident}")
    if summary is not None:
        if resident is None:
            raise ValueError("--summary summarises a resident set's omitted keys: pass --resident with it")
        if summary not in SUMMARIES:
            raise ValueError(f"--summary: unknown summary {summary!r}; known are {', '.join(SUMMARIES)}")
    if reselect is not None:
        if resident is None:
            raise ValueError("--reselect re-selects the resident set: pass --resident <fraction in (0, 1]> with it")
        if reselect < 1:
            raise ValueError(f"--reselect must be a positive number of decode steps, got {reselect}")
        _check_promotes("--reselect", specs)
    if recall is not None:
        _check_recall(resident, recall, specs)
    if select is not None:
        if resident is None:
            raise ValueError("--select picks the resident set: pass --resident <fraction in (0, 1]> with it")
        if select not in SELECT_POLICIES:
            raise ValueError(f"--select: unknown policy {select!r}; known are {', '.join(SELECT_POLICIES)}")
    if alloc is not None:
        _check_alloc(resident, select, alloc)


def _check_recall(resident: float | None, recall: str, specs: tuple[SchemeSpec, ...]) -> None:
    """``--recall``: with ``--resident``, a known recall form, ``swap`` only with codecs it can re-encode."""
    if resident is None:
        raise ValueError("--recall chooses how a resident set recalls: pass --resident with it")
    if recall not in RECALLS:
        raise ValueError(f"--recall: unknown recall form {recall!r}; known are {', '.join(RECALLS)}")
    if recall == "swap":
        _check_promotes("--recall swap", specs)


def _check_promotes(option: str, specs: tuple[SchemeSpec, ...]) -> None:
    """``option`` promotes omitted tokens into the resident set by re-encoding them: ``ValueError`` naming it when
    a codec of ``specs`` is dithered (its dither key holds one position per row for every KV head)."""
    dithered = sorted({c for s in specs for c in (s.keys, s.values) if get(c).needs_key})
    if dithered:
        raise ValueError(f"{option} cannot re-encode promoted tokens with dithered codecs {dithered}")


def _check_alloc(resident: float | None, select: str | None, alloc: str) -> None:
    """``--resident-alloc``: with ``--resident``, a known split, ``mass`` only with a policy scoring attention."""
    if resident is None:
        raise ValueError("--resident-alloc splits the resident set: pass --resident <fraction in (0, 1]> with it")
    if alloc not in RESIDENT_ALLOCS:
        raise ValueError(f"--resident-alloc: unknown split {alloc!r}; known are {', '.join(RESIDENT_ALLOCS)}")
    if alloc == "mass" and not SELECT_POLICIES[select or DEFAULT_SELECT]().needs_attention:
        raise ValueError(f"--resident-alloc mass splits by attention scores; --select {select} has none")


# Resident-variant options shared by ``kvcert eval`` and ``kvcert frontier`` (checked by :func:`resident_plan`).
ResidentOption = Annotated[
    float | None,
    typer.Option(
        help="also run each scheme with a resident set of this fraction of its tokens, in (0, 1] "
        "(variant <scheme>+resident, gated certified at --gate's tau, 0.2 for auto)"
    ),
]
SelectOption = Annotated[
    str | None,
    typer.Option(
        help=f"resident-set policy: {' | '.join(SELECT_POLICIES)} (default {DEFAULT_SELECT}; needs --resident)",
    ),
]
ReselectOption = Annotated[
    int | None,
    typer.Option(
        help="re-select each resident set every N decode steps over all its tokens (needs --resident; "
        "not with dithered codecs)",
    ),
]
SummaryOption = Annotated[
    str | None,
    typer.Option(
        help=f"summary of the omitted tokens' keys: {' | '.join(SUMMARIES)} (default int8; needs --resident; "
        "docs/eviction.md)",
    ),
]
ResidentAllocOption = Annotated[
    str | None,
    typer.Option(
        help=f"split of the resident tokens across layers: {' | '.join(RESIDENT_ALLOCS)} (default uniform: every "
        "layer keeps --resident; mass: the same total split by the policy's prefill scores; needs --resident)",
    ),
]
RecallOption = Annotated[
    str | None,
    typer.Option(
        help=f"what a resident set does with the pages it recalls: {' | '.join(RECALLS)} (default persistent: "
        "kept while the device budget has room; transient: paged in per read; swap: swapped into the resident set "
        "in place of its least-attended tokens, not with dithered codecs; needs --resident; docs/eviction.md)",
    ),
]
ValidateOption = Annotated[
    bool,
    typer.Option(
        help="also compute exact attention per read: true TV and violations per variant, and for resident "
        "variants the exact omitted mass and recall violations (slower)"
    ),
]


def resident_plan(
    resident: float | None,
    select: str | None,
    reselect: int | None,
    specs: tuple[SchemeSpec, ...],
    summary: str | None,
    alloc: str | None,
    gate: Gate | None,
    recall: str | None = None,
) -> ResidentPlan | None:
    """The resident variants of a run from its options (``None`` without ``--resident``): the options checked by
    :func:`check_resident_options`, the gate by :func:`resident_gate`, defaults ``--select snapkv``,
    ``--summary int8``, ``--resident-alloc uniform``, ``--recall persistent``; ``ValueError`` naming the option
    otherwise."""
    check_resident_options(resident, select, reselect, specs, summary, alloc, recall)
    if resident is None:
        return None
    return ResidentPlan(
        resident,
        select or DEFAULT_SELECT,
        resident_gate(gate),
        specs,
        reselect,
        summary or "int8",
        alloc or "uniform",
        recall or "persistent",
    )


@dataclass(frozen=True)
class ResidentSettings:
    """The ``--resident``, ``--select``, ``--reselect``, ``--summary``, ``--resident-alloc`` and ``--recall`` options
    as given (``None``: not given)."""

    resident: float | None
    select: str | None
    reselect: int | None
    summary: str | None
    alloc: str | None
    recall: str | None


@dataclass(frozen=True)
class RulerVariants:
    """The variants of a RULER command from its options: the schemes (with ``--allocation``'s), the gate (``None``:
    ``auto``) and the resident plan (``None`` without ``--resident``)."""

    specs: tuple[SchemeSpec, ...]
    gate: Gate | None
    plan: ResidentPlan | None


class StorageOptions(NamedTuple):
    """The storage options of a RULER command, as :func:`parse_storage` takes them after the schemes."""

    witness: str
    device_budget: str
    exact_sinks: int = 0
    upgrade: str | None = None
    heavy_share: float | None = None
    bands: int = 8
    heavy_values: str | None = None


def ruler_variants(
    schemes: str, storage: StorageOptions, allocation: Path | None, gate: str, resident: ResidentSettings
) -> RulerVariants:
    """:func:`parse_schemes` with :func:`parse_storage` of ``storage``, ``--allocation``'s scheme
    (:func:`allocation_spec`, under the same storage options), :func:`parse_gate` and :func:`resident_plan` (the
    resident variants of the listed schemes, not the allocation's); ``ValueError`` naming the option at fault (also
    for a Tier-B gate over a scheme whose keys are not dithered)."""
    plain = parse_storage(parse_schemes(schemes), *storage)
    specs = plain + parse_storage(allocation_spec(allocation), *storage)
    chosen = parse_gate(gate)
    check_tier_b_gate(gate, chosen, plain)
    plan = resident_plan(
        resident.resident,
        resident.select,
        resident.reselect,
        tuple(plain),
        resident.summary,
        resident.alloc,
        chosen,
        resident.recall,
    )
    return RulerVariants(tuple(specs), chosen, plan)


def resident_fits(plan: ResidentPlan | None, context: int) -> None:
    """Refuse a resident set smaller than its policy's protected tokens (``sinks + recent``: SnapKV's window,
    RMM's lag) at a prompt of ``context`` tokens, before any work: the policy would raise mid-run. ``ValueError``
    naming ``--resident`` and ``--select``. (A RULER prompt holds at most ``context`` tokens, so this catches
    every certain failure; a prompt shorter than ``context`` near the limit can still be refused by the policy.)"""
    if plan is None:
        return
    policy = plan.policy()
    protected = policy.sinks + policy.recent
    if prefill_kept_count(context, 1.0 - plan.fraction) < protected:
        raise ValueError(
            f"--resident {plan.fraction} keeps {prefill_kept_count(context, 1.0 - plan.fraction)} of "
            f"{context} tokens, fewer than the {protected} that --select {plan.select} protects; raise "
            "--resident or --context, or choose another --select"
        )


def resident_gate(gate: Gate | None) -> Gate:
    """The gate of a resident variant from the job's ``--gate``: ``auto`` -> ``certified(0.2)``, ``certified:TAU``
    -> ``certified(TAU)`` (both at head granularity, the granularity a resident read recalls at), ``off`` -> off.
    ``risk:TAU`` has no resident form (recall needs a certificate to stop at): ``ValueError`` naming ``--gate``."""
    if gate is None:
        return Gate.certified(CERTIFIED_TAU)
    if gate.mode == "off":
        return gate
    if gate.mode != "certified":
        raise ValueError(
            f"--resident needs --gate auto, off or certified:TAU (recall stops at a certified tau), "
            f"got {gate.describe()}"
        )
    return Gate.certified(gate.threshold)


def auto_gate(informative_fraction: float) -> Gate:
    """Gate for a scheme from its ungated meter: certified(τ=0.2) if at least half of its cells are
    informative (raw meter < 1), else risk-ranked(τ_gate=5) — a saturated meter cannot certify τ=0.2
    without paging nearly everything, but it still ranks risk. Repair pages 64-token blocks greedily and
    writes them back exact (persistent), so a block's traffic is paid once: on SmolLM2 (one niah_single_2
    sample at 2k) this cut host page-in 29x for fp8-e4m3 and 62x for dither-int8 keys versus head repair."""
    if informative_fraction >= INFORMATIVE_MIN:
        return Gate.certified(CERTIFIED_TAU, granularity="block", block_size=REPAIR_BLOCK, persistent=True)
    return Gate.risk_ranked(RISK_TAU_GATE, granularity="block", block_size=REPAIR_BLOCK, persistent=True)


def default_out(command: str) -> Path:
    """``runs/<command>-<UTC timestamp>``."""
    return Path("runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def command_line() -> str:
    """The command line as typed (``kvcert`` + arguments), less ``--overwrite``: that flag only lets a run
    replace an existing report, so a rerun with it records the same command as the first run."""
    return " ".join(["kvcert", *(a for a in sys.argv[1:] if a != "--overwrite")])


def set_seed(seed: int) -> None:
    """Seed torch's global generator (greedy decoding is deterministic; codecs take the seed directly)."""
    torch.manual_seed(seed)
