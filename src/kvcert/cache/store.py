"""Tiered storage for one attention layer: compressed device tier, exact host tier, write-time witnesses.

Layout per layer (``B`` batch rows, ``H`` KV heads, ``S`` tokens, ``D`` head dim):

* **device tier** — the codec's packed chunks (real code and scale tensors; bytes are measured from
  them) plus entries kept exact (fp16-equivalent bytes counted): tokens still *pending* (written in the
  current forward, or waiting for a KIVI token block / residual window), non-finite entries,
  unattributable writes, the first ``exact_sinks`` logical positions (attention sinks; default 0) and
  persistently repaired entries;
* **host tier** — the exact originals, pinned when CUDA is present; repair pages in from here. A paged store
  whose pages carry host blocks (:attr:`PagedCodes.host <kvcert.cache.paged.PagedCodes.host>`) keeps them in
  those blocks, addressed by the engine's block table (:class:`~kvcert.cache.host_pages.HostTokens`);
* **witnesses** (small, device side) — per token the key-residual band norms ``ρ_{t,b}`` over whole
  RoPE pairs and their sum ``W_t = Σ_b ρ_{t,b} ≥ ‖Δk_t‖``, the served key norm ``‖k̂_t‖`` (for the
  floating-point slack), the value residual norm ``‖Δv_t‖``, the served value norm ``‖v̂_t‖`` and its
  distance ``‖v̂_t − c‖`` to a fixed per-head centre ``c`` (the output bound's spread), all rounded up to
  float32, and, for the dithered codec, the per-group steps (Tier B). Every read reuses them instead of
  re-reducing the ``[S, D]`` tensors. Storage (``witness=``): ``"log8"`` (default) keeps the residual witnesses
  (the band norms and ``‖Δv_t‖``) as 8-bit logarithmic codes that decode to values never below the true ones
  (:class:`~kvcert.cache.buffer.LogBuffer`, ``docs/math.md#compact-witnesses``), derives ``W_t`` from the
  decoded bands, the steps from the codec's stored scales and the three served norms from the served entries a
  read decodes anyway (float32, not counted: 9 B per token per KV head with 8 bands); ``"f32"`` stores every
  witness as float32 (52 B, plus the steps). A store whose codes live
  in a serving engine's pages (:attr:`LayerStore.pages`) keeps the ``"log8"`` codes in the same cells
  (:class:`~kvcert.cache.paged.CellTokens`; the bases stay with the store);
* **decode scratch** — the dequantized keys/values the read path attends over. A fused kernel would
  dequantize in registers; this CPU reference keeps the decoded copy and reports it separately.

Device bytes (:meth:`LayerStore.bytes_device`, *measured*): the packed codes (codes, scales, zero-points:
every tensor of every :class:`Packed` chunk), the stored witness buffers (every live token; in ``"log8"`` the
uint8 codes and the per-(row, head) base exponents, not the decoded copy) and the value centre,
and every entry held exact on the device tier (pending / in-flight tokens, non-finite and fail-closed
entries, persistently repaired entries) at 16 bits per element. A repaired entry keeps its codes (the
chunks are rectangular), so repair *adds* bytes; an upgrade repair in a token-tier store drops the light
codes it replaces (:meth:`LayerStore.commit_upgrade`). Not counted: the decode scratch, the host tier and the
bookkeeping masks / logical positions (``exact``, ``held``, ``positions``).

Device budget (``device_budget=F``, a fraction of the live tokens' fp16 K/V bytes): a persistent repair
(:meth:`LayerStore.persist`) is kept only if ``bytes_device`` stays ``<= F·bytes_fp16`` right after it;
otherwise it is a *transient* page-in (served exact for that read, nothing kept) and is counted. When new
tokens raise the floor (codes + witnesses + pending entries) above the budget, held repairs are released
(newest chunk first) back to their codes and write-time witnesses, recomputed exactly as at encode time,
so ``bytes_device <= max(F·bytes_fp16, floor)`` holds after every write and every read.

Token tiers (``token_tiers=True``, with upgrade codecs): the codes of each write are a
:class:`~kvcert.quant.token_tiers.TokenTiers` form, the entries :meth:`LayerStore.choose_heavy` named (the prefill's
heavy tokens, ``docs/read-path.md#token-tiers``) in the upgrade codecs and the others in the light ones, each entry's
codes once; their witnesses are those of the codes they were stored in. The heavy values may have a codec and a
share of their own (``heavy_values=``, :meth:`LayerStore.choose_heavy`'s ``value_slots``). An upgrade repair drops
the light codes of the entries it re-encodes, and a budget release encodes them again (the same codes).

Write protocol: new tokens are appended exact and *pending*; at the start of a later write, pending
tokens are encoded in whole blocks of ``write_block`` tokens (so the forward that produced them attends
to them exactly, as in-flight K/V, and a partial block stays exact until it fills). The witness is
computed at encode time from the exact original, which makes it valid for every later read (the
stored codes are immutable: cache-preserving contract, ``docs/codecs.md#codec-contract``). A write
(encoding the pending blocks and appending the new tokens) is one :class:`~kvcert.cache.buffer.WriteBatch`:
computed on the device, read back once (every fail-closed check, the witness bases, the counts), then stored;
a write refused by a check raises its error and changes no tier, witness or count.

Slots vs positions: every physical slot carries its *logical* position (``positions[B, H, S]``, the index
of the token in the request's sequence, padding included). Without eviction slot ``j`` holds position
``base + j``; after an eviction (``gather``) each head keeps its own strictly increasing subset. With
``retain_evicted`` (validate mode) the exact K/V and positions of evicted entries move to an *evicted
archive* in the host tier, so exact attention over everything ever written stays computable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch

from kvcert.bounds.rope import Pairing, band_norms, check_pairing, norm_up_f32, round_up_f32
from kvcert.cache.buffer import GrowBuffer, LogBuffer, TokenIndex, WriteBatch, numpy_copyable
from kvcert.cache.host_pages import HostPages, HostTokens
from kvcert.cache.paged import CellLayout, CellTokens, PagedCodes
from kvcert.checks import deferred
from kvcert.quant import Codec, DitherKey, Packed
from kvcert.quant.kernel_env import fused_log8
from kvcert.quant.token_tiers import TokenTiers, check_wide, share_bypass


@dataclass
class _Chunk:
    """One encoded run of tokens ``[start, stop)`` (absolute slot indices) of one tensor (K or V)."""

    start: int
    stop: int
    packed: Packed
    key: DitherKey | None = None  # the dither key it was encoded with (re-decoding on budget release)
    heavy: torch.Tensor | None = None  # [B, H, stop − start] bool (CPU): the tokens in a token-tier codec's heavy codes


@dataclass
class _Upgrade:
    """The codes one upgrade repair (:meth:`LayerStore.persist` with upgrade codecs) stored: the entries of row ``b``,
    KV head ``h`` at absolute slot indices ``slots`` (ascending), re-encoded by the upgrade codec from their exact
    originals into ``packed`` (``[1, 1, len(slots), ·]``: real code and scale tensors of that head only)."""

    b: int
    h: int
    slots: torch.Tensor
    packed: Packed
    order: int  # the store's count of upgrade records before this one (the budget releases the newest first)

    def after(self, start: int) -> _Upgrade | None:
        """The part of this record at absolute slots ``>= start`` (its codes sliced on the token axis), ``None`` when
        nothing is left."""
        keep = self.slots >= start
        if bool(keep.all()):
            return self
        if not bool(keep.any()):
            return None
        idx = keep.nonzero().view(-1)
        tensors = {name: t.index_select(2, idx.to(t.device)) for name, t in self.packed.tensors.items()}
        shape = (*self.packed.shape[:2], len(idx), *self.packed.shape[3:])
        return _Upgrade(self.b, self.h, self.slots[idx], Packed(self.packed.codec, shape, tensors), self.order)


@dataclass(frozen=True)
class UpgradePart:
    """One tensor's part of an :class:`UpgradePlan`: the physical ``slots`` (ascending) of the entries, their new
    codes ``packed`` (``[1, 1, len(slots), ·]``), the values they decode to ``xhat[len(slots), D]`` and their
    write-time witnesses (``{buffer name: [len(slots)(, ·)]}``)."""

    is_key: bool
    slots: torch.Tensor
    packed: Packed
    xhat: torch.Tensor
    witnesses: dict[str, torch.Tensor]

    def subset(self, keep: torch.Tensor) -> UpgradePart | None:
        """The entries at the physical slots ``keep[S]`` marks (``None`` when none is left)."""
        idx = keep.to(self.slots.device)[self.slots].nonzero().view(-1)
        if len(idx) == 0:
            return None
        tensors = {name: t.index_select(2, idx.to(t.device)) for name, t in self.packed.tensors.items()}
        packed = Packed(self.packed.codec, (*self.packed.shape[:2], len(idx), *self.packed.shape[3:]), tensors)
        on = idx.to(self.xhat.device)
        return UpgradePart(
            self.is_key,
            self.slots[idx],
            packed,
            self.xhat[on],
            {name: val.index_select(0, idx.to(val.device)) for name, val in self.witnesses.items()},
        )


@dataclass(frozen=True)
class UpgradePlan:
    """What :meth:`LayerStore.plan_upgrade` computed for (row ``b``, KV head ``h``): the K and V parts (either may be
    absent: no entry of it was light) and ``witness_bytes``, the stored witness bytes of one entry (K and V)."""

    b: int
    h: int
    parts: tuple[UpgradePart, ...]
    witness_bytes: int

    @property
    def nbytes(self) -> int:
        """The measured bytes of the new codes and of their stored witnesses: what a host-side encoder of these
        entries sends to the device (witnesses counted once per entry, on the key part's entries when there is one)."""
        codes = sum(part.packed.nbytes for part in self.parts)
        return codes + self.witness_bytes * max((len(part.slots) for part in self.parts), default=0)

    def subset(self, keep: torch.Tensor) -> UpgradePlan:
        """The plan of the entries at the physical slots ``keep[S]`` marks."""
        parts = (part.subset(keep) for part in self.parts)
        return UpgradePlan(self.b, self.h, tuple(p for p in parts if p is not None), self.witness_bytes)


def _fused_codes(buf: object) -> GrowBuffer | None:
    """``buf``'s ``log8`` codes when the fused numpy writes can address them: a :class:`LogBuffer` whose codes are
    a numpy-backed buffer of its own. ``None`` otherwise, e.g. for a paged store's codes in the engine's cells
    (:class:`~kvcert.cache.paged.CellTokens`), which take the general writes."""
    if isinstance(buf, LogBuffer) and isinstance(buf.codes, GrowBuffer) and buf.codes.numpy_ok:
        return buf.codes
    return None


def _own_codes(buf: LogBuffer) -> GrowBuffer:
    """The codes :func:`_fused_codes` admitted (the fused writes run only after it did)."""
    codes = _fused_codes(buf)
    assert codes is not None
    return codes


class _Tensorstore:
    """Device + host storage of one of K or V for one layer."""

    def __init__(
        self,
        codec: Codec,
        like: torch.Tensor,
        pin: bool,
        write_block: int,
        device: torch.device,
        host: HostTokens | None = None,
    ) -> None:
        """``like``: an empty ``[B, H, 0, D]`` tensor of the host tier's dtype and device (pinned CPU beside a GPU);
        ``device``: the device tier's device (that of the K/V written), which holds the served scratch; ``host``:
        the host tier in a serving engine's host blocks (default: a buffer of its own)."""
        self.codec = codec
        self.block = math.lcm(codec.block, write_block)
        self.host: GrowBuffer | HostTokens = GrowBuffer(like, pin=pin) if host is None else host
        self.served = GrowBuffer(like.to(device, torch.float32))
        b, h = like.shape[:2]
        self.exact = GrowBuffer(torch.zeros(b, h, 1, dtype=torch.bool, device=device))
        self.n_exact = 0  # entries of ``exact`` set (kept as it changes: every device-budget check reads it)
        self.held = GrowBuffer(torch.zeros(b, h, 1, dtype=torch.bool, device=device))  # persistent repairs
        self.chunks = []  # (the setter also resets the packed byte count)
        self.upgrades: list[_Upgrade] = []  # upgrade repairs, oldest first (through add_upgrade / pop_upgrade)
        self.heavy_chunks: list[_Chunk] = []  # the chunks holding heavy tokens of a token-tier codec, oldest first
        self._upgrade_bytes = 0
        self.n_encoded = 0  # tokens [0, n_encoded) went through the codec (relative to live window)
        self.last_encoded = 0  # tokens encoded by the most recent encode_pending call

    @property
    def chunks(self) -> list[_Chunk]:
        """The encoded runs, oldest first (append through :meth:`encoded`; assigning a new list recounts the bytes)."""
        return self._chunks

    @chunks.setter
    def chunks(self, chunks: list[_Chunk]) -> None:
        self._chunks = chunks
        self._packed_bytes = sum(c.packed.nbytes for c in chunks)

    def encoded(self, n: int, chunks: Sequence[_Chunk]) -> None:
        """Record an encoding of the next ``n`` pending tokens into ``chunks`` (in order; empty when ``n`` is 0)."""
        self.last_encoded = n
        for chunk in chunks:
            self._chunks.append(chunk)
            self._packed_bytes += chunk.packed.nbytes
            if chunk.heavy is not None:
                self.heavy_chunks.append(chunk)
        self.n_encoded += n

    def encodable(self) -> int:
        """How many pending tokens can be encoded now: whole blocks (``lcm(codec.block, write_block)``) outside
        the codec's residual window. Encoding whole blocks amortises the per-write cost, as a serving kernel
        quantises a full page atomically; the trailing partial block stays exact until it fills."""
        avail = self.host.n - self.codec.residual_window - self.n_encoded
        return max(avail // self.block, 0) * self.block

    def repack(self, chunk: _Chunk, packed: Packed) -> None:
        """Replace ``chunk``'s codes by ``packed`` (the same entries, some codes dropped or given back)."""
        self._packed_bytes += packed.nbytes - chunk.packed.nbytes
        chunk.packed = packed

    def covering(self, lo: int, hi: int) -> list[_Chunk]:
        """The chunks holding any absolute slot in ``[lo, hi)``."""
        return [c for c in self._chunks if c.start < hi and c.stop > lo]

    def packed_nbytes(self) -> int:
        """``Σ`` of the chunks' and the upgrade records' :attr:`Packed.nbytes` (kept as they change: the device-budget
        checks of every write read it, and the sum over every chunk grows with the context)."""
        return self._packed_bytes + self._upgrade_bytes

    def add_upgrade(self, upgrade: _Upgrade) -> None:
        """Keep one more upgrade record (newest last)."""
        self.upgrades.append(upgrade)
        self._upgrade_bytes += upgrade.packed.nbytes

    def pop_upgrade(self) -> _Upgrade:
        """Remove and return the newest upgrade record."""
        upgrade = self.upgrades.pop()
        self._upgrade_bytes -= upgrade.packed.nbytes
        return upgrade

    def keep_upgrades_after(self, start: int) -> None:
        """Keep only the upgraded entries at absolute slots ``>= start`` (a sliding-window trim)."""
        kept = [u.after(start) for u in self.upgrades]
        self.upgrades = [u for u in kept if u is not None]
        self._upgrade_bytes = sum(u.packed.nbytes for u in self.upgrades)

    def wide(self, b: int, h: int, n: int, base: int) -> torch.Tensor:
        """``[n]`` bool over the physical slots of (row ``b``, KV head ``h``): the entries in the wide codes, those an
        upgrade record holds and those a token-tier codec stored heavy."""
        mask = torch.zeros(n, dtype=torch.bool)
        for u in self.upgrades:
            if u.b == b and u.h == h:
                mask[u.slots - base] = True
        for c in self.heavy_chunks:
            assert c.heavy is not None
            lo, hi = c.start - base, c.stop - base
            mask[max(lo, 0) : hi] |= c.heavy[b, h, max(-lo, 0) :]
        return mask

    def exact_nbytes(self, head_dim: int) -> int:
        """16-bit bytes of the entries held exact: :attr:`n_exact` (``= exact.view().sum()``, counted as the flags
        change instead of summed over every live token at each budget check) times ``head_dim``."""
        return self.n_exact * head_dim * EXACT_BYTES

    def add_exact(self, n: int) -> None:
        """Count ``n`` more (negative: fewer) entries of ``exact`` set."""
        self.n_exact += n

    def recount_exact(self) -> None:
        """Recount :attr:`n_exact` from the flags (after an eviction or trim: one host sync)."""
        self.n_exact = int(self.exact.view().sum())


#: bytes per element of an entry held exact on the device tier (fp16 / bf16, the serving precision)
EXACT_BYTES = 2

#: storage of the write-time witnesses: ``"f32"`` (float32 each) or ``"log8"`` (8-bit codes that decode upwards)
Witness = Literal["f32", "log8"]
WITNESS_FORMATS: tuple[Witness, ...] = ("f32", "log8")
DEFAULT_WITNESS: Witness = "log8"
#: the witnesses of each entry's *residual* (what only the exact entry gives), stored per token: float32 in ``"f32"``,
#: ``log8`` codes in ``"log8"`` (``k_wit`` and the Tier-B steps are stored too in ``"f32"``; derived in ``"log8"``)
STORED_WITNESSES = ("k_band", "v_res")
#: the norms of each entry *as served* (``‖k̂_t‖``, ``‖v̂_t‖``, ``‖v̂_t − c‖``), float32 rounded up in either format:
#: functions of the served entries alone, which every read decodes, so stored in ``"f32"`` and derived in ``"log8"``
#: (a kernel computes them in the pass that decodes the codes; ``docs/math.md#compact-witnesses``)
SERVED_NORMS = ("k_hat_norm", "v_hat_norm", "v_dist")


def band_sum_up(rho: torch.Tensor, bands: int) -> torch.Tensor:
    """``W ≥ Σ_b ρ_b`` over the last axis of ``rho[..., bands]``, float32 rounded up (float64 summation slack
    ``2(bands+2)·2^-53`` relative included)."""
    return round_up_f32(rho.to(torch.float64).sum(-1) * (1.0 + 2.0 * (bands + 2) * 2.0**-53))


#: the keyword settings of a :class:`LayerStore` (besides its layer and codecs), kept as attributes of the same names
STORE_SETTINGS = (
    "bands",
    "pairing",
    "seed",
    "write_block",
    "device_budget",
    "witness",
    "exact_sinks",
    "upgrade",
    "token_tiers",
    "heavy_values",
)

#: mixed into the store's seed for the dither of upgraded entries: a stream apart from the one their first codes drew
UPGRADE_STREAM = 0x5550_4752


def check_upgrade(key_codec: Codec, upgrade: object) -> tuple[Codec, Codec] | None:
    """``upgrade`` as the ``(key codec, value codec)`` an upgrade repair re-encodes into, or ``None``; ``ValueError``
    naming the problem unless both are per-token codecs (``block == 1``, no residual window, not per-head: a repair
    re-encodes single tokens of one KV head) and, when the key codec has Tier-B steps, the upgrade key codec has them
    too with the same group size and bypassed channels (:func:`~kvcert.quant.token_tiers.check_wide`; the Tier-B
    radius of every token is read with the key codec's groups and channel mask,
    ``docs/read-path.md#upgrade-repair``)."""
    if upgrade is None:
        return None
    if not (isinstance(upgrade, tuple) and len(upgrade) == 2 and all(isinstance(c, Codec) for c in upgrade)):
        raise ValueError(f"upgrade must be a (key codec, value codec) pair of Codec or None, got {upgrade!r}")
    check_wide(key_codec, upgrade[0], "an upgrade key codec")
    check_wide(upgrade[1], upgrade[1], "an upgrade value codec")
    return upgrade[0], upgrade[1]


def check_heavy_values(codec: object, token_tiers: bool) -> Codec | None:
    """``codec`` as the heavy values' codec of a token-tier store, or ``None``; ``ValueError`` naming the problem
    unless it is a per-token codec (:func:`~kvcert.quant.token_tiers.check_wide`) of a store with token tiers."""
    if codec is None:
        return None
    if not isinstance(codec, Codec):
        raise ValueError(f"heavy_values must be a Codec or None, got {codec!r}")
    if not token_tiers:
        raise ValueError("heavy_values is the codec of token tiers' heavy values: give token_tiers=True too")
    check_wide(codec, codec, "a heavy value codec")
    return codec


def check_exact_sinks(n: object, name: str = "exact_sinks") -> int:
    """``n`` as a number of exact sink positions (``StorageConfig(exact_sinks=)``); ``ValueError`` naming ``name``
    (an argument, option or variable) unless it is an int ``>= 0`` (not a bool)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be a number of positions >= 0, got {n!r}")
    return n


class LayerStore:
    """All tiers of one layer; see the module docstring for the layout, the write protocol, the device bytes
    and the device budget."""

    def __init__(
        self,
        layer: int,
        key_codec: Codec,
        value_codec: Codec,
        *,
        bands: int,
        pairing: Pairing,
        seed: int,
        write_block: int = 1,
        device_budget: float | None = None,
        witness: Witness = DEFAULT_WITNESS,
        exact_sinks: int = 0,
        upgrade: tuple[Codec, Codec] | None = None,
        token_tiers: bool = False,
        heavy_values: Codec | None = None,
    ) -> None:
        # persistent repairs re-encode in these codecs instead of holding entries exact (None: hold them exact)
        self.upgrade = check_upgrade(key_codec, upgrade)
        if token_tiers and self.upgrade is None:
            raise ValueError("token tiers store their heavy tokens in the upgrade codecs: give upgrade= too")
        # the codes are token tiers: the tokens choose_heavy names in the upgrade codecs, the others light
        self.token_tiers = bool(token_tiers)
        # the heavy values' codec of token tiers (None: the upgrade value codec)
        self.heavy_values = check_heavy_values(heavy_values, self.token_tiers)
        # per tensor ("k", "v"): [B, H, n] bool over physical slots, the entries choose_heavy named
        self._heavy_hint: dict[str, torch.Tensor] | None = None
        # tokens at logical positions < exact_sinks are never compressed
        self.exact_sinks = check_exact_sinks(exact_sinks)
        if witness not in WITNESS_FORMATS:
            raise ValueError(f"witness must be one of {WITNESS_FORMATS}, got {witness!r}")
        self.witness: Witness = witness
        if isinstance(write_block, bool) or not isinstance(write_block, int) or write_block < 1:
            raise ValueError(f"write_block must be an int >= 1, got {write_block!r}")
        if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
            raise ValueError(f"bands must be an int >= 1 (witness bands of whole RoPE pairs), got {bands!r}")
        check_pairing(pairing)
        if device_budget is not None and not device_budget > 0:
            raise ValueError(
                f"device_budget must be > 0 (a fraction of the fp16 K/V bytes) or None, got {device_budget!r}"
            )
        self.device_budget = device_budget
        self.transient_repairs = 0  # persistent repairs refused by the device budget (served transient)
        self.bytes_transient = 0  # their page-in bytes
        self.released = 0  # held (repaired) entries released back to their codes by the budget
        self.n_held = 0  # entries (K and V counted apart) currently held exact by persistent repair
        self.upgraded = 0  # entries (K and V counted apart) an upgrade repair re-encoded (ever)
        self.heavy_entries = 0  # entries (K and V counted apart) token tiers encoded in the heavy codes (ever)
        self._upgrade_records = 0  # upgrade records ever kept (each record's order)
        self._held_heads: torch.Tensor | None = None  # held_heads() until the held flags change (None: recompute)
        self.compacted = False  # an eviction merged the chunks (dither keys of the codes are lost)
        self.write_block = write_block
        self.layer = layer
        self.key_codec = key_codec
        self.value_codec = value_codec
        self.bands = bands
        self.pairing = pairing
        self.seed = seed
        self.k: _Tensorstore | None = None
        self.v: _Tensorstore | None = None
        self.base = 0  # absolute slot index of live token 0 (after sliding-window trims)
        self.appended = 0  # logical tokens ever appended (the next token's position)
        self.evicted: dict[str, GrowBuffer] = {}  # evicted archive: "k", "v", "positions" (retain_evicted)
        self.nonfinite = 0  # entries kept exact because K or V had NaN/inf
        self.fail_closed = 0  # entries kept exact because their row had no request identity
        self._tier_b_spent: list[int] = []  # per row: cells a Tier-B gate passed at this layer (tier_b_spent)
        # where the packed codes live: None = the store's own tensors; else a serving engine's pages (B = 1)
        self.pages: PagedCodes | None = None

    def emptied(self) -> LayerStore:
        """A new store of the same layer and configuration (codecs, bands, pairing, seed, write block, device budget,
        witness format, exact sinks) that holds nothing: what a cache reset starts from."""
        settings = {name: getattr(self, name) for name in STORE_SETTINGS}
        return LayerStore(self.layer, self.key_codec, self.value_codec, **settings)

    def tier_b_spent(self, rows: int) -> list[int]:
        """Per batch row, the cells of this layer a Tier-B gate has served on its partial bound so far, each charged
        ``δ_loc`` against the request's budget (``kvcert.attention.certified``); the list is the store's own, and the
        read path adds what it charges. Grows to ``rows`` entries."""
        self._tier_b_spent.extend([0] * (rows - len(self._tier_b_spent)))
        return self._tier_b_spent

    # ----------------------------------------------------------------------------------------- write
    def _init(self, k: torch.Tensor, v: torch.Tensor) -> None:
        b, h, _, d = k.shape
        z = k.new_zeros((b, h, 0), dtype=torch.float32)
        pin = torch.cuda.is_available()
        like_k, like_v = (k[:, :, :0].to("cpu"), v[:, :, :0].to("cpu")) if pin else (k[:, :, :0], v[:, :, :0])
        # the host blocks and witness buffers first: pages that cannot hold them are refused before anything is set
        self._host_cells = self.pages is not None and self.pages.host is not None
        host_k, host_v = (
            (HostTokens(self._current_host, "k", like_k), HostTokens(self._current_host, "v", like_v))
            if self._host_cells
            else (None, None)
        )
        self._witness_cells = self.pages is not None
        stored = self._witness_buffer
        self.k_band: GrowBuffer | LogBuffer = stored("k_band", k.new_zeros((b, h, 0, self.bands), dtype=torch.float32))
        self.k_wit = GrowBuffer(z)  # in "log8": derived from the decoded bands (band_sum_up), not stored
        self.v_res: GrowBuffer | LogBuffer = stored("v_res", z)
        # SERVED_NORMS: float32 in both formats (stored in "f32", derived in "log8")
        self.k_hat_norm, self.v_hat_norm, self.v_dist = GrowBuffer(z), GrowBuffer(z), GrowBuffer(z)
        key_codec, value_codec = self.key_codec, self.value_codec
        if self.token_tiers:
            assert self.upgrade is not None
            heavy_values = self.upgrade[1] if self.heavy_values is None else self.heavy_values
            key_codec, value_codec = TokenTiers(key_codec, self.upgrade[0]), TokenTiers(value_codec, heavy_values)
        self.k = _Tensorstore(key_codec, like_k, pin, self.write_block, k.device, host_k)
        self.v = _Tensorstore(value_codec, like_v, pin, self.write_block, v.device, host_v)
        # any fixed centre makes the spread max_t ‖v̂_t − c‖ valid; the first write's mean keeps it small
        self.v_centre = torch.nan_to_num(v.to(torch.float32), 0.0, 0.0, 0.0).mean(2, keepdim=True)
        self.k_steps: GrowBuffer | None = None
        self.positions = GrowBuffer(torch.zeros(b, h, 0, dtype=torch.int64, device=k.device))
        self.rows = torch.full((b,), -1, dtype=torch.int64, device=k.device)

    def _witness_buffer(self, name: str, like: torch.Tensor) -> GrowBuffer | LogBuffer:
        """The stored witness buffer ``name`` (of :data:`STORED_WITNESSES`), shaped as the empty ``like``: float32
        in ``"f32"``; in ``"log8"`` its codes in a tensor of its own, or, with :attr:`pages`, in the cells of the
        pages (:class:`~kvcert.cache.paged.CellTokens`; ``ValueError`` in ``"f32"`` or for a layout without that
        witness field)."""
        if self.witness == "f32":
            if self.pages is not None:
                raise ValueError("a store whose codes live in pages keeps its witnesses there as log8 codes, not f32")
            return GrowBuffer(like)
        if self.pages is None:
            return LogBuffer(like)
        return LogBuffer(like, codes=CellTokens(self._current_pages, name, like.to(torch.uint8)))

    def _current_pages(self) -> PagedCodes:
        """:attr:`pages` (where the witness codes of a store first written with pages live); ``ValueError`` when
        they were removed."""
        if self.pages is None:
            raise ValueError("this store's witness codes live in a serving engine's pages, but its pages were removed")
        return self.pages

    def _current_host(self) -> HostPages:
        """The host blocks of :attr:`pages` (where the host tier of a store first written with them lives);
        ``ValueError`` when they were removed."""
        pages = self._current_pages()
        if pages.host is None:
            raise ValueError("this store's host tier lives in a serving engine's host blocks, but they were removed")
        return pages.host

    def cell_layout(self, head_dim: int, head_dim_v: int, align: int = 1) -> CellLayout:
        """The cell one (token, KV head) of a store of this configuration takes in a serving engine's pages: the
        codecs' packed tensors and the ``"log8"`` witness codes, each measured (:meth:`CellLayout.measure`; the
        witnesses from the codes an empty store of this configuration holds after writing one sample token), the
        cell rounded up to ``align``. Raises ``ValueError`` in ``"f32"`` (no witness cells) or for codecs that do
        not encode each token on its own."""
        if self.witness != "log8":
            raise ValueError(
                f"a store keeps its witnesses in a serving engine's pages only as log8, not {self.witness}"
            )
        sample = self.emptied()
        one = torch.zeros(1, dtype=torch.int64)
        sample.append(torch.zeros(1, 1, 1, head_dim), torch.zeros(1, 1, 1, head_dim_v), one, one.to(torch.bool))
        witnesses = {name: getattr(sample, name).codes.view() for name in STORED_WITNESSES}
        return CellLayout.measure(self.key_codec, self.value_codec, head_dim, head_dim_v, align, witnesses)

    @property
    def n(self) -> int:
        """Number of live (physical) tokens."""
        return 0 if self.k is None else self.k.host.n

    def append(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, keep_exact_rows: torch.Tensor) -> None:
        """Encode the previous pending tokens, then append ``k, v[B, H, T, D]`` as pending (exact).

        ``rows[b]`` is the request UID of row ``b`` (used to key the dither); ``keep_exact_rows[b]`` marks
        rows whose entries must never be compressed (fail-closed identity).
        """
        if self.pages is not None and k.shape[0] != 1:
            raise ValueError(f"a store whose codes live in pages holds one sequence (B = 1), got B = {k.shape[0]}")
        if self.k is not None and (self.pages is not None) != self._witness_cells:
            raise ValueError("a store's pages must be set before its first write and kept (its witnesses live there)")
        if self.k is not None and self.pages is not None and (self.pages.host is not None) != self._host_cells:
            raise ValueError(
                "a store's host blocks must be given with its pages before its first write and kept (its exact "
                "host tier lives there)"
            )
        if self.k is None:
            self._init(k, v)
        assert self.k is not None and self.v is not None
        self.rows = rows
        self._keep_exact_rows = keep_exact_rows
        t, (b, h) = k.shape[2], k.shape[:2]
        positions = torch.arange(self.appended, self.appended + t, device=k.device).expand(b, h, t)
        self._encode_and_append(k, v, positions, flush=False)
        self.appended += t
        self._release_over_budget()

    def promote(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Bring host-tier tokens ``k, v[B, H, T, D]`` at logical ``positions[B, H, T]`` (each KV head its own) back
        onto the device tier, encoded at once (every pending token is flushed first; per-token codecs only).

        Each promoted token goes through the codec from its exact original and gets its write-time witnesses from
        that original, exactly as at a write (``|ŝ_t − s_t|`` and the value terms keep their bounds); its logical
        position is its own, not the next one (``appended`` is unchanged). A per-token deterministic codec maps
        a token to the same code whenever it is encoded, so promoting a token that was encoded before gives the
        codes it had. Raises ``ValueError`` for a dithered codec: its dither key takes one position per row for
        every KV head (``DitherKey.positions[B, T]``), so tokens promoted at different positions per head would
        be encoded with another head's dither realisation.
        """
        assert self.k is not None and self.v is not None
        self._unpaged("promote")
        for ts in (self.k, self.v):
            if ts.codec.needs_key or ts.codec.block != 1 or ts.codec.residual_window:
                raise ValueError(
                    f"promote needs a per-token codec without dither; {ts.codec.name!r} "
                    + ("keys its dither by one position per row" if ts.codec.needs_key else "encodes token blocks")
                )
        if positions.shape != k.shape[:3] or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"k, v and positions must share [B, H, T], got {k.shape}, {v.shape}, {positions.shape}")
        device = self.positions.view().device  # the device tier's (the host tier may be pinned CPU memory)
        self._encode_and_append(k.to(device), v.to(device), positions.to(device), flush=True)
        self.encode_pending(flush=True)
        self._release_over_budget()

    def _encode_and_append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, flush: bool) -> None:
        """:meth:`encode_pending`, then append ``k, v[B, H, T, D]`` at logical ``positions[B, H, T]`` as pending
        (exact) entries; the witness writes of both are stored after one host read-back."""
        writes = WriteBatch()
        self._encode(flush, writes)
        self._append_pending(k, v, positions, writes)
        self._commit(writes)

    def _append_pending(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, writes: WriteBatch) -> None:
        """Record in ``writes`` appending ``k, v[B, H, T, D]`` at logical ``positions[B, H, T]`` as pending
        (exact) entries."""
        assert self.k is not None and self.v is not None
        if self._append_pending_fused(k, v, positions, writes):
            return
        t = k.shape[2]
        b, h = k.shape[:2]
        for ts, x in ((self.k, k), (self.v, v)):
            writes.append(ts.host, x.to(ts.host.dtype).to(ts.host.device))
            writes.append(ts.served, x.to(torch.float32))
            writes.append_fill(ts.exact, t, True)
            writes.then(partial(ts.add_exact, b * h * t))
            writes.append_fill(ts.held, t, False)
        # pending entries are exact: residual witnesses 0, the served norms those of the entries themselves
        writes.append_zeros(self.k_band, (b, h, t, self.bands))
        writes.append_zeros(self.k_wit, (b, h, t))
        writes.append_zeros(self.v_res, (b, h, t))
        k_norm, v_norm, v_dist = _norms_up(k, v, self.v_centre)
        writes.appends(
            [(self.k_hat_norm, k_norm), (self.v_hat_norm, v_norm), (self.v_dist, v_dist), (self.positions, positions)]
        )
        if self.k_steps is not None:
            writes.append_fill(self.k_steps, t, 0.0)

    def _append_pending_fused(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, writes: WriteBatch
    ) -> bool:
        """:meth:`_append_pending` in two numpy-side steps, where it applies: on the numba backend, ``"log8"``
        witnesses, float32 ``k, v`` of the host tier's dtype, and every buffer copying through numpy (the steady
        state of a decode). One fused kernel (:func:`kvcert.quant.norms_numba.norms_up`, as :func:`_norms_up` runs
        it) gives the three served norms, and one recorded change appends every buffer's entries with numpy copies
        at the commit: the same elements as the general path stores (a zero residual witness is code 0, decoded 0,
        against any base; ``tests/cache/test_cache_store.py`` pins every buffer per element). Returns False,
        recording nothing, where it does not apply."""
        assert self.k is not None and self.v is not None
        grows: tuple[GrowBuffer | HostTokens, ...] = (
            self.k.host,
            self.k.served,
            self.k.exact,
            self.k.held,
            self.v.host,
            self.v.served,
            self.v.exact,
        )
        grows += (self.v.held, self.k_wit, self.positions, self.k_hat_norm, self.v_hat_norm, self.v_dist)
        grows += () if self.k_steps is None else (self.k_steps,)
        if not (
            self.witness == "log8"
            and fused_log8(k.device)
            and k.shape[2] > 0
            and k.dtype == v.dtype == self.k.host.dtype == self.v.host.dtype == self.v_centre.dtype == torch.float32
            and positions.dtype == self.positions.dtype
            and numpy_copyable(k)
            and numpy_copyable(v)
            and numpy_copyable(positions)
            and all(buf.numpy_ok for buf in grows)
            and all(_fused_codes(buf) is not None for buf in (self.k_band, self.v_res))
        ):
            return False
        norms = _norms_up(k, v, self.v_centre)
        writes.then(partial(self._store_pending, k.numpy(), v.numpy(), positions.numpy(), norms))
        return True

    def _store_pending(
        self, k: np.ndarray, v: np.ndarray, positions: np.ndarray, norms: tuple[torch.Tensor, ...]
    ) -> None:
        """Append the pending entries ``k, v[B, H, t, D]`` at ``positions[B, H, t]`` with their three served norms
        ``[B, H, t]`` (:data:`SERVED_NORMS` order; :meth:`_append_pending_fused`), every buffer by numpy."""
        assert self.k is not None and self.v is not None
        b, h, t = k.shape[:3]
        for ts, x in ((self.k, k), (self.v, v)):
            ts.host.append_array(x)
            ts.served.append_array(x)
            ts.exact.append_fill(t, True)
            ts.add_exact(b * h * t)
            ts.held.append_fill(t, False)
        for zero in (self.k_band, self.v_res):
            assert isinstance(zero, LogBuffer)
            _own_codes(zero).append_fill(t, 0)
            zero.decoded.append_fill(t, 0.0)
        self.k_wit.append_fill(t, 0.0)
        for buf, norm in zip((self.k_hat_norm, self.v_hat_norm, self.v_dist), norms, strict=True):
            buf.append_array(norm.numpy())
        self.positions.append_array(positions)
        if self.k_steps is not None:
            self.k_steps.append_fill(t, 0.0)

    def encode_pending(self, flush: bool = False) -> None:
        """Push every encodable pending token through its codec and record the write-time witnesses.

        ``flush=True`` also encodes a trailing partial ``write_block`` (eviction needs every head's pending
        tail encoded so the kept codes stay rectangular; per-token codecs only).
        """
        writes = WriteBatch()
        self._encode(flush, writes)
        self._commit(writes)
        hint = self._heavy_hint
        if hint is not None and self.k is not None and self.v is not None:
            if min(self.k.n_encoded, self.v.n_encoded) >= hint["k"].shape[-1]:
                self._heavy_hint = None  # every chosen entry is encoded

    def _encode(self, flush: bool, writes: WriteBatch) -> None:
        """:meth:`encode_pending` recorded in ``writes``: the codecs and witnesses are computed on the device, their
        checks deferred to the commit (:mod:`kvcert.checks`); the tiers, witnesses, chunks and counters change
        only at the commit (the Tier-B step buffer, all zeros, is created at once when a codec first has steps)."""
        assert self.k is not None and self.v is not None
        for is_key, ts in ((True, self.k), (False, self.v)):
            n = ts.encodable()
            if flush:
                n = max(ts.host.n - ts.codec.residual_window - ts.n_encoded, 0)
            if n == 0:
                writes.then(partial(ts.encoded, 0, ()))
                continue
            lo, hi = ts.n_encoded, ts.n_encoded + n
            x = ts.host.view()[:, :, lo:hi].to(ts.served.view().device, torch.float32)  # encode on the device tier
            finite = torch.isfinite(x).all(dim=-1)  # [B, H, n]
            other = (self.v if is_key else self.k).host.view()[:, :, lo:hi]
            finite &= torch.isfinite(other).all(dim=-1).to(finite.device)  # keep K and V of a bad token exact
            rows_exact = self._keep_exact_rows.view(-1, 1, 1).to(finite.device)
            sinks = self.positions.view()[:, :, lo:hi].to(finite.device) < self.exact_sinks
            keep = (~finite) | rows_exact | sinks
            xin = torch.where(finite.unsqueeze(-1), x, torch.zeros_like(x))
            key = None
            if ts.codec.needs_key:
                # logical positions (equal to base + slot without eviction): dither is never reused
                # after an eviction compacts the slots; pending tokens share positions across heads
                key = DitherKey(self.seed, self.rows.to(torch.int64), self.layer, self.positions.view()[:, 0, lo:hi])
            heavy = None
            with deferred(writes.require):
                if isinstance(ts.codec, TokenTiers):
                    heavy = self._heavy_of("k" if is_key else "v", lo, hi, xin.device)
                    packed, decoded = ts.codec.encode_decode_split(xin, key, heavy)
                else:
                    packed, decoded = ts.codec.encode_decode(xin, key=key)
                xhat = torch.where(keep.unsqueeze(-1), x, decoded.to(torch.float32))
                wit = self._witnesses(is_key, x, xhat, keep, ts.codec.steps(packed))
            where = (slice(None), slice(None), slice(lo, hi))
            writes.write(ts.served, where, xhat)
            writes.count(f"exact_{'k' if is_key else 'v'}", keep.sum() - ts.exact.view()[where].sum())
            writes.write(ts.exact, where, keep)
            if is_key:
                writes.count("nonfinite", (~finite).sum())
                writes.count("fail_closed", (finite & rows_exact).sum())
                if "k_steps" in wit and self.k_steps is None:
                    steps = wit["k_steps"]
                    self.k_steps = GrowBuffer(steps[:, :, :0])
                    self.k_steps.append(
                        torch.zeros(
                            *steps.shape[:2], ts.host.n, steps.shape[-1], dtype=steps.dtype, device=steps.device
                        )
                    )
            self._write_witnesses(where, wit, writes)
            stored_heavy = heavy.cpu() if heavy is not None and bool(heavy.any()) else None
            chunk = _Chunk(self.base + lo, self.base + hi, packed, key, stored_heavy)
            writes.then(partial(self._store_codes, "k" if is_key else "v", n, chunk))

    def choose_heavy(self, slots: torch.Tensor, value_slots: torch.Tensor | None = None) -> None:
        """Store the entries at physical ``slots[B, H, C]`` (distinct per (row, KV head)) in the heavy codes when they
        are encoded (a token-tier store, ``token_tiers=True``): typically the prefill's pending tokens its attention
        singled out. ``value_slots[B, H, C']`` (same rules) names the heavy values apart, when they are not those of
        ``slots`` (the heavy values' own share, ``docs/read-path.md#heavy-values``). A write encodes the chosen
        tokens it covers (each (row, KV head) its own count); an entry encoded before the choice keeps its codes.
        ``ValueError`` without token tiers, on pages, or on a bad shape or repeated slots."""
        if not self.token_tiers:
            raise ValueError("choose_heavy needs a token-tier store (StorageConfig(heavy_share=...))")
        self._unpaged("token tiers")
        assert self.k is not None
        keys = self._slot_mask(slots, "slots")
        values = keys if value_slots is None else self._slot_mask(value_slots, "value_slots")
        self._heavy_hint = {"k": keys, "v": values}

    def _slot_mask(self, slots: torch.Tensor, name: str) -> torch.Tensor:
        """``[B, H, n]`` bool, true at ``slots[B, H, C]``; ``ValueError`` naming ``name`` on a bad shape, a slot
        outside the live ones or a repeated slot."""
        assert self.k is not None
        b, h = self.k.served.shape[:2]
        if slots.dim() != 3 or tuple(slots.shape[:2]) != (b, h) or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be integer [B, H, C] with (B, H) = {(b, h)}, got {tuple(slots.shape)}")
        if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < self.n):
            raise ValueError(f"{name} must lie in [0, {self.n}), the live slots of this store")
        mask = torch.zeros(b, h, self.n, dtype=torch.bool, device=slots.device).scatter(2, slots.to(torch.int64), True)
        if bool((mask.sum(-1) != slots.shape[-1]).any()):
            raise ValueError(f"{name} repeat a slot of some (row, KV head): name each chosen entry once")
        return mask

    def _heavy_of(self, tensor: str, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """``[B, H, hi − lo]`` bool: the chosen heavy entries of ``tensor`` (``"k"`` or ``"v"``,
        :meth:`choose_heavy`) among the slots ``[lo, hi)``."""
        assert self.k is not None
        b, h = self.k.served.shape[:2]
        out = torch.zeros(b, h, hi - lo, dtype=torch.bool, device=device)
        hint = None if self._heavy_hint is None else self._heavy_hint[tensor]
        if hint is not None and lo < hint.shape[-1]:
            part = hint[:, :, lo:hi].to(device)
            out[:, :, : part.shape[-1]] = part
        return out

    def _store_codes(self, tensor: str, n: int, chunk: _Chunk) -> None:
        """Keep the codes of ``n`` newly encoded tokens: as ``chunk`` itself, or, with :attr:`pages`, copied into
        the pages it covers, one chunk of page views per page (:meth:`~kvcert.cache.paged.PagedCodes.place`)."""
        ts = self.k if tensor == "k" else self.v
        assert ts is not None
        if chunk.heavy is not None:
            self.heavy_entries += int(chunk.heavy.sum())
        if self.pages is None:
            ts.encoded(n, [chunk])
            return
        pieces = self.pages.place(tensor, chunk.start, chunk.stop, chunk.packed, chunk.key)
        ts.encoded(n, [_Chunk(lo, hi, packed, key) for lo, hi, packed, key in pieces])

    def _witnesses(
        self,
        is_key: bool,
        x: torch.Tensor,
        xhat: torch.Tensor,
        keep: torch.Tensor,
        steps: torch.Tensor | None,
        centre: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Write-time witnesses ``{buffer name: [B, H, n(, ·)] values}`` of a token range with exact values
        ``x``, served values ``xhat`` (the decoded codes, or ``x`` itself where ``keep``) and ``keep`` (entries
        served exact: residual 0): for keys the band norms ``ρ_{t,b}`` of ``x̂ − x`` (rounded up),
        ``W_t ≥ Σ_b ρ_{t,b}`` (float64 summation slack included), ``‖k̂_t‖`` and the Tier-B steps; for values
        ``‖Δv_t‖``, ``‖v̂_t‖`` and ``‖v̂_t − c‖``, all rounded up to float32. The norms are those of what is
        *served*, exact entries included (the logit slack and the output bound's spread and ``vmax`` range over
        them); only non-finite entries, whose reads fail closed, get 0 so the witnesses stay finite. ``centre``: the
        value centre of the rows and heads ``x`` holds (default: the whole ``[B, H]`` one)."""
        resid = torch.where(keep.unsqueeze(-1), 0.0, xhat.to(torch.float64) - x.to(torch.float64))
        served = torch.where(torch.isfinite(xhat).all(-1, keepdim=True), xhat, 0.0)
        if is_key:
            rho = round_up_f32(band_norms(resid, self.bands, self.pairing))
            out = {"k_band": rho, "k_wit": band_sum_up(rho, self.bands), "k_hat_norm": norm_up_f32(served)}
            if steps is not None:
                out["k_steps"] = torch.where(keep.unsqueeze(-1), torch.zeros_like(steps), steps.to(torch.float32))
            return out
        return {
            "v_res": torch.where(keep, 0.0, norm_up_f32(resid)),  # exactly 0 where served exact (0 ↦ 0 in log8)
            "v_hat_norm": norm_up_f32(served),
            "v_dist": norm_up_f32(served.to(torch.float64) - (self.v_centre if centre is None else centre)),
        }

    def _write_witnesses(self, index: TokenIndex, wit: Mapping[str, torch.Tensor | float], writes: WriteBatch) -> None:
        """Record writes of witnesses ``{buffer name: values}`` at ``index`` of their buffers in ``writes``
        (``k_wit`` only in ``"f32"``: :meth:`_commit` derives it in ``"log8"``)."""
        for name, val in wit.items():
            if name != "k_wit" or self.witness == "f32":
                writes.write(getattr(self, name), index, val)

    def _commit(self, writes: WriteBatch) -> None:
        """Store ``writes`` (one host sync: :meth:`WriteBatch.commit`) and add their counters. In ``"log8"`` the
        key witness ``W_t`` is not stored: it is re-derived as :func:`band_sum_up` of the *decoded* bands (each
        ``>=`` the true band norm, so ``W_t`` still bounds ``Σ_b ρ_{t,b}`` and ``‖Δk_t‖``) where bands were
        written, over the whole buffer when a band base was raised (decoded bands elsewhere grew)."""
        bands = writes.indices(self.k_band) if isinstance(self.k_band, LogBuffer) else []  # "log8"
        counts = writes.commit()
        self.nonfinite += counts.get("nonfinite", 0)
        self.fail_closed += counts.get("fail_closed", 0)
        if self.k is not None and self.v is not None:
            self.k.add_exact(counts.get("exact_k", 0))
            self.v.add_exact(counts.get("exact_v", 0))
        for where in [(slice(None),) * 3] if bands and self.k_band in writes.raised else bands:
            self.k_wit.write(where, band_sum_up(self.k_band.view()[where], self.bands))

    # ------------------------------------------------------------------------------------ maintenance
    def make_exact(self, b: int, h: int, tokens: slice | torch.Tensor) -> int:
        """Persistent repair: serve ``tokens`` (a slice or a boolean mask over physical slots) of (row b, KV
        head h) exact from now on. Returns the bytes written back; the witness becomes 0 (radius 0) there.
        """
        moved = self._hold_exact(b, h, tokens)
        self._write_exact_witnesses([(b, h, tokens)])
        return moved

    def _hold_exact(self, b: int, h: int, tokens: slice | torch.Tensor) -> int:
        """The served entries and exact / held flags of :meth:`make_exact` (its witnesses not yet written: see
        :meth:`_write_exact_witnesses`). Returns the bytes written back."""
        assert self.k is not None and self.v is not None
        moved = 0
        for ts in (self.k, self.v):
            host = ts.host.view()
            on_host = tokens.to(host.device) if isinstance(tokens, torch.Tensor) else tokens  # a device-tier mask
            ts.served.view()[b, h, tokens] = host[b, h, on_host].to(ts.served.view().device, torch.float32)
            newly = ~ts.exact.view()[b, h, tokens]
            count = int(newly.sum())
            moved += count * ts.host.view().shape[-1] * 2
            ts.held.view()[b, h, tokens] |= newly
            self._held_heads = None
            self.n_held += count
            ts.add_exact(count)
            ts.exact.view()[b, h, tokens] = True
        return moved

    def _write_exact_witnesses(self, held: Sequence[tuple[int, int, slice | torch.Tensor]]) -> None:
        """Store the witnesses of entries :meth:`_hold_exact` served exact, for every ``(row, KV head, tokens)`` of
        ``held`` at once (one write per witness buffer at the union of their places, one commit: one host sync):
        radius 0 (``k_band``, ``k_wit``, ``v_res``, ``k_steps``) and the norms of the served entries. Each value
        depends only on its own token's served entries, so it is the one a write per head would store."""
        assert self.k is not None and self.v is not None
        sel = torch.zeros(self.k.exact.shape, dtype=torch.bool, device=self.k.exact.view().device)
        for b, h, tokens in held:
            sel[b, h, tokens] = True
        where = sel.nonzero(as_tuple=True)  # the places of ``sel`` in its order: every write below indexes by them
        if self._exact_witnesses_fused(where):
            return
        centre = self.v_centre.expand(self.v.served.shape)[where]
        k_norm, v_norm, v_dist = _norms_up(self.k.served.view()[where], self.v.served.view()[where], centre)
        wit: dict[str, torch.Tensor | float] = {
            "k_band": 0.0,
            "k_wit": 0.0,
            "v_res": 0.0,
            "k_hat_norm": k_norm,
            "v_hat_norm": v_norm,
            "v_dist": v_dist,
        }
        if self.k_steps is not None:
            wit["k_steps"] = 0.0
        writes = WriteBatch()
        self._write_witnesses(where, wit, writes)
        self._commit(writes)

    def _exact_witnesses_fused(self, where: tuple[torch.Tensor, ...]) -> bool:
        """:meth:`_write_exact_witnesses` at the places ``where`` (``(rows, heads, tokens)`` index arrays) by numpy,
        where it applies: on the numba backend, ``"log8"`` witnesses and every buffer numpy-backed. One fused kernel
        (:func:`_norms_up` of the served entries) and a numpy assignment per buffer store what the general path's
        writes and commit store (radius 0 is code 0, decoded 0; ``W_t`` of zero bands is 0), element for element
        (``tests/cache/test_cache_store.py``). Returns False, storing nothing, elsewhere."""
        assert self.k is not None and self.v is not None
        norms = (self.k_hat_norm, self.v_hat_norm, self.v_dist)
        zeros = (self.k_band, self.v_res)
        flat = (self.k.served, self.v.served, self.k_wit) + (() if self.k_steps is None else (self.k_steps,))
        if not (
            self.witness == "log8"
            and fused_log8(self.k.served.device)
            and self.v_centre.dtype == torch.float32
            and numpy_copyable(self.v_centre)
            and all(buf.numpy_ok for buf in (*flat, *norms))
            and all(_fused_codes(buf) is not None for buf in zeros)
        ):
            return False
        b, h, t = (i.numpy() for i in where)
        centre = torch.from_numpy(self.v_centre.numpy()[b, h, 0])
        k_served, v_served = (torch.from_numpy(ts.served.array()[b, h, t]) for ts in (self.k, self.v))
        for buf, x in zip(norms, _norms_up(k_served, v_served, centre), strict=True):
            buf.array()[b, h, t] = x.numpy()
        for zero in zeros:
            assert isinstance(zero, LogBuffer)
            _own_codes(zero).array()[b, h, t] = 0
            zero.decoded.array()[b, h, t] = 0.0
        for buf in flat[2:]:
            buf.array()[b, h, t] = 0.0
        return True

    # --------------------------------------------------------------------------------- device budget
    def persist(self, b: int, h: int, tokens: slice | torch.Tensor) -> bool:
        """Persistent repair of ``tokens`` of (row b, KV head h) within the device budget.

        Kept (:meth:`make_exact`, returns True) iff ``bytes_device + added <= device_budget·bytes_fp16`` with
        ``added`` the 16-bit bytes of the entries it makes exact; otherwise nothing is kept (the caller has
        already served the read exact from the host tier: a *transient* page-in), the refusal and its page-in
        bytes are counted, and False is returned. After an eviction merged a dithered store's chunks the codes
        cannot be re-decoded for a later release, so repairs are then always transient under a budget.
        """
        return self.persist_heads([(b, h)], [tokens])[0]

    def persist_heads(
        self, heads: Sequence[tuple[int, int]], tokens: Sequence[slice | torch.Tensor], exact: bool = False
    ) -> list[bool]:
        """:meth:`persist` of ``tokens[j]`` of each (row, KV head) ``heads[j]``, in order (each budget check sees
        the entries the earlier ones kept), with the witnesses of every kept head stored together
        (:meth:`_write_exact_witnesses`: one host sync instead of one per head). ``exact``: hold the entries exact
        even with upgrade codecs (what an upgrade repair pages in exact when no upgrade passes). Returns the per-head
        :meth:`persist` results."""
        if len(heads) != len(tokens):
            raise ValueError(f"persist_heads: {len(heads)} heads but {len(tokens)} token selections")
        tokens = [_as_slots(t) for t in tokens]
        kept = [self._persist(b, h, t, exact) for (b, h), t in zip(heads, tokens, strict=True)]
        held = [(b, h, t) for (b, h), t, k in zip(heads, tokens, kept, strict=True) if k]
        if held and (self.upgrade is None or exact):
            self._write_exact_witnesses(held)
        return kept

    def _persist(self, b: int, h: int, tokens: slice | torch.Tensor, exact: bool = False) -> bool:
        """:meth:`persist` but for the witnesses of a kept exact repair (:meth:`_hold_exact` only); with upgrade
        codecs and not ``exact``, :meth:`_upgrade_entries`, witnesses included."""
        assert self.k is not None and self.v is not None
        if self.upgrade is not None and not exact:
            return self._upgrade_entries(b, h, tokens)
        if self.device_budget is None:
            self._hold_exact(b, h, tokens)
            return True
        added = sum(
            int((~ts.exact.view()[b, h, tokens]).sum()) * ts.host.shape[-1] * EXACT_BYTES for ts in (self.k, self.v)
        )
        locked = self.compacted and (self.key_codec.needs_key or self.value_codec.needs_key)
        if locked or self._over_budget(added):
            self._refuse(tokens)
            return False
        self._hold_exact(b, h, tokens)
        return True

    def _over_budget(self, added: int) -> bool:
        """Whether ``added`` more device bytes would take :meth:`bytes_device` past the device budget."""
        return self.device_budget is not None and self.bytes_device() + added > self.device_budget * self.bytes_fp16()

    def _refuse(self, tokens: slice | torch.Tensor) -> None:
        """Count a persistent repair of ``tokens`` the device budget refused: a transient page-in of their exact K/V."""
        assert self.k is not None and self.v is not None
        n = int(torch.ones(self.n, dtype=torch.bool)[tokens].sum())
        self.transient_repairs += 1
        self.bytes_transient += n * (self.k.host.shape[-1] + self.v.host.shape[-1]) * self.k.host.dtype.itemsize

    def _upgrade_entries(self, b: int, h: int, tokens: slice | torch.Tensor) -> bool:
        """:meth:`persist` with upgrade codecs (``upgrade=``): :meth:`commit_upgrade` of :meth:`plan_upgrade`."""
        return self.commit_upgrade(self.plan_upgrade(b, h, tokens))

    def light(self, b: int, h: int, is_key: bool) -> torch.Tensor:
        """``[n]`` bool (CPU) over the physical slots of (row ``b``, KV head ``h``): the keys (``is_key``) or values
        served from light codes, neither exact nor in the wide codes (upgraded, or stored heavy by token tiers)."""
        ts = self.k if is_key else self.v
        assert ts is not None
        return ~ts.exact.view()[b, h].cpu() & ~ts.wide(b, h, self.n, self.base)

    def plan_upgrade(self, b: int, h: int, tokens: slice | torch.Tensor, keys: bool = True) -> UpgradePlan:
        """What an upgrade repair of ``tokens`` of (row b, KV head h) would store, computed and not stored: each entry
        still served from light codes (:meth:`light`) re-encoded by the upgrade codec from its exact original, its
        served value and the write-time witnesses of the new codes (:meth:`_witnesses`: the same inequalities, for
        the new residual); the values only when ``keys`` is False (a value upgrade,
        ``docs/read-path.md#value-upgrades``). The dither of an upgrade codec is drawn from a stream of its own,
        keyed by the request, layer, KV head and position as every dither is, so planning the same entry twice gives
        the same codes. ``docs/read-path.md#upgrade-repair``."""
        assert self.k is not None and self.v is not None and self.upgrade is not None
        self._unpaged("an upgrade repair")
        n = self.n
        parts = []
        share_bypass(self.key_codec, self.upgrade[0])
        tensors = ((True, self.k, self.upgrade[0]), (False, self.v, self.upgrade[1]))
        for is_key, ts, codec in tensors if keys else tensors[1:]:
            sel = torch.zeros(n, dtype=torch.bool)
            sel[tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens] = True
            sel &= self.light(b, h, is_key)
            slots = sel.nonzero().view(-1)
            if len(slots) == 0:
                continue
            # encoded where the exact originals live (the host tier): only the codes and witnesses move to the device
            dev, at = ts.served.view().device, ts.host.view().device
            x = ts.host.view()[b : b + 1, :, slots.to(at)].to(torch.float32)  # [1, H, T, D]
            key = None
            if codec.needs_key:
                pos = self.positions.view()[b : b + 1, h, slots.to(self.positions.view().device)].to(at)  # [1, T]
                key = DitherKey(self.seed ^ UPGRADE_STREAM, self.rows[b : b + 1].to(at, torch.int64), self.layer, pos)
            packed, decoded = codec.encode_decode(x, key=key)
            one = _head_packed(packed, h)
            one = Packed(one.codec, one.shape, {name: t.to(dev) for name, t in one.tensors.items()}, one.heads)
            xhat = decoded[:, h : h + 1].to(torch.float32)
            steps = codec.steps(one) if is_key and self.k_steps is not None else None
            centre = self.v_centre[b : b + 1, h : h + 1].to(at)
            keep = torch.zeros(1, 1, len(slots), dtype=torch.bool, device=at)
            wit = self._witnesses(is_key, x[:, h : h + 1], xhat, keep, None if steps is None else steps.to(at), centre)
            witnesses = {name: val[0, 0].to(dev) for name, val in wit.items()}
            parts.append(UpgradePart(is_key, slots, one, xhat[0, 0].to(dev), witnesses))
        return UpgradePlan(b, h, tuple(parts), self._witness_entry_bytes(keys))

    def commit_upgrade(self, plan: UpgradePlan) -> bool:
        """Store ``plan`` (:meth:`plan_upgrade`, possibly a :meth:`UpgradePlan.subset`): its entries are served from
        the new codes, with their witnesses, from now on. In a token-tier store the entries' first (light) codes are
        dropped from their chunks (:meth:`~kvcert.quant.token_tiers.TokenTiers.drop`); elsewhere they stay beside the
        new ones (the chunks are rectangular). Kept iff ``bytes_device + added <= device_budget·bytes_fp16``, ``added``
        the measured bytes of the new codes less those of the dropped ones; otherwise nothing changes and the refusal
        is counted as :meth:`persist` counts it, its traffic the plan's :attr:`UpgradePlan.nbytes`."""
        drops = self._light_drops(plan)
        freed = sum(chunk.packed.nbytes - packed.nbytes for _, chunk, packed in drops)
        if self._over_budget(sum(part.packed.nbytes for part in plan.parts) - freed):
            self.transient_repairs += 1
            self.bytes_transient += plan.nbytes
            return False
        writes = WriteBatch()
        b, h = plan.b, plan.h
        for part in plan.parts:
            ts = self.k if part.is_key else self.v
            assert ts is not None
            on = part.slots.to(ts.served.view().device)
            ts.served.view()[b, h, on] = part.xhat
            ts.add_upgrade(_Upgrade(b, h, part.slots + self.base, part.packed, self._upgrade_records))
            self._upgrade_records += 1
            self.upgraded += len(part.slots)
            where = (torch.full_like(on, b), torch.full_like(on, h), on)
            self._write_witnesses(where, part.witnesses, writes)
        self._commit(writes)
        for ts, chunk, packed in drops:
            ts.repack(chunk, packed)
        return True

    def _light_drops(self, plan: UpgradePlan) -> list[tuple[_Tensorstore, _Chunk, Packed]]:
        """``(tensor store, chunk, its codes without those of the plan's entries)`` for each token-tier chunk holding
        an entry of ``plan`` (none in a store without token tiers)."""
        drops = []
        for part in plan.parts:
            ts = self.k if part.is_key else self.v
            assert ts is not None
            if not isinstance(ts.codec, TokenTiers):
                continue
            slots = part.slots + self.base
            for chunk in ts.covering(int(slots.min()), int(slots.max()) + 1):
                inside = slots[(slots >= chunk.start) & (slots < chunk.stop)] - chunk.start
                if len(inside) == 0:
                    continue
                which = torch.zeros(chunk.packed.shape[:3], dtype=torch.bool)
                which[plan.b, plan.h, inside] = True
                drops.append((ts, chunk, ts.codec.drop(chunk.packed, which)))
        return drops

    def _witness_entry_bytes(self, keys: bool = True) -> int:
        """Device bytes of the stored witnesses of one entry of one KV head, K and V together (the value's alone
        without ``keys``; measured from the buffers: in ``"log8"`` one code each, ``bands`` for the key band norms;
        in ``"f32"`` the float32 values, the derived ``W_t`` and Tier-B steps included)."""
        every: tuple[str, ...] = (
            STORED_WITNESSES if self.witness == "log8" else (*STORED_WITNESSES, *SERVED_NORMS, "k_wit")
        )
        names = every if keys else tuple(name for name in every if name.startswith("v_"))
        bufs = [getattr(self, name) for name in names]
        if keys and self.witness == "f32" and self.k_steps is not None:
            bufs.append(self.k_steps)
        one = [(buf.codes if isinstance(buf, LogBuffer) else buf).view()[0, 0, :1] for buf in bufs]
        return sum(t.nbytes for t in one)

    def held_heads(self) -> torch.Tensor:
        """``[B, H]`` bool: the (row, KV head) holds an entry kept exact by a persistent repair (a new tensor; the
        reduction over every live token is redone only after the held flags changed: a repair, a release, a trim,
        an eviction)."""
        assert self.k is not None and self.v is not None
        if self._held_heads is None:
            self._held_heads = self.k.held.view().any(-1) | self.v.held.view().any(-1)
        return self._held_heads.clone()

    def _release_over_budget(self) -> None:
        """Release repaired entries until ``bytes_device <= device_budget·bytes_fp16`` or none is left: upgrade
        records newest first (K then V), then held (persistently repaired) entries, newest chunk first, K then V. A
        released entry is served from its first codes again with the write-time witnesses :meth:`_witnesses`
        computes from its exact original — the same values as at encode time, so every later certificate stays
        valid."""
        if self.device_budget is None or self.k is None:  # O(1) on the decode path
            return
        assert self.v is not None
        if self.n_held == 0 and not self.k.upgrades and not self.v.upgrades:
            return
        limit = self.device_budget * self.bytes_fp16()
        if self.bytes_device() <= limit:
            return
        while self.k.upgrades or self.v.upgrades:  # the newest record of either tensor first
            newest_k = self.k.upgrades[-1].order if self.k.upgrades else -1
            is_key = newest_k > (self.v.upgrades[-1].order if self.v.upgrades else -1)
            ts = self.k if is_key else self.v
            u = ts.pop_upgrade()
            sel = torch.zeros(ts.held.shape, dtype=torch.bool, device=ts.held.view().device)
            sel[u.b, u.h, (u.slots - self.base).to(sel.device)] = True
            for c in ts.chunks:
                lo, hi = max(c.start - self.base, 0), c.stop - self.base
                if hi > lo and bool(sel[:, :, lo:hi].any()):
                    self._give_back_codes(ts, c, sel[:, :, lo:hi])
                    self._restore_codes(is_key, ts, c, lo, hi, sel[:, :, lo:hi])
            self.released += len(u.slots)
            if self.bytes_device() <= limit:
                return
        for is_key, ts in ((True, self.k), (False, self.v)):
            for c in reversed(ts.chunks):
                lo, hi = max(c.start - self.base, 0), c.stop - self.base
                held = ts.held.view()[:, :, lo:hi]
                if hi <= lo or not bool(held.any()) or (ts.codec.needs_key and c.key is None):
                    continue
                self._restore_codes(is_key, ts, c, lo, hi, held)
                ts.add_exact(-int((ts.exact.view()[:, :, lo:hi] & held).sum()))
                ts.exact.view()[:, :, lo:hi] &= ~held
                self.released += int(held.sum())
                self.n_held -= int(held.sum())
                held.zero_()
                self._held_heads = None
                if self.bytes_device() <= limit:
                    return

    def _give_back_codes(self, ts: _Tensorstore, c: _Chunk, sel: torch.Tensor) -> None:
        """Give chunk ``c`` of a token-tier store back the codes an upgrade repair dropped among the live entries
        ``sel[B, H, ·]`` (its slots from the live window's start on), encoded again from their exact originals with
        the chunk's dither key: the codes it was written with (:meth:`~kvcert.quant.token_tiers.TokenTiers.restore`).
        Nothing happens in a store without token tiers or where nothing of ``sel`` was dropped."""
        if not isinstance(ts.codec, TokenTiers):
            return
        off = max(self.base - c.start, 0)  # chunk slots before the live window (a sliding trim) are not read
        which = torch.zeros(c.packed.shape[:3], dtype=torch.bool)
        which[:, :, off:] = sel.cpu()
        which &= TokenTiers.dropped_mask(c.packed).cpu()
        if not bool(which.any()):
            return
        dev = ts.served.view().device  # encoded where the chunk was (the device tier), as at the write
        x = torch.zeros(c.packed.shape, dtype=torch.float32, device=dev)
        live = ts.host.view()[:, :, max(c.start - self.base, 0) : c.stop - self.base].to(dev, torch.float32)
        x[:, :, off:] = torch.where(which[:, :, off:].unsqueeze(-1).to(dev), live, torch.zeros_like(live))
        ts.repack(c, ts.codec.restore(c.packed, x, c.key, which))

    def _restore_codes(self, is_key: bool, ts: _Tensorstore, c: _Chunk, lo: int, hi: int, sel: torch.Tensor) -> None:
        """Serve the entries ``sel[B, H, hi − lo]`` of physical slots ``[lo, hi)`` (inside chunk ``c``) from ``c``'s
        codes again, with the write-time witnesses of those codes (a decoded value written back re-encodes to its own
        log8 code). Entries outside ``sel`` are not read from ``c`` (a token-tier chunk's dropped ones decode to
        NaN)."""
        assert not (ts.codec.needs_key and c.key is None), "a dithered chunk without its key cannot be decoded again"
        off = lo - (c.start - self.base)
        x = ts.host.view()[:, :, lo:hi].to(torch.float32)
        xhat = ts.codec.decode(c.packed, key=c.key).to(torch.float32)[:, :, off : off + hi - lo]
        on = sel.unsqueeze(-1).to(xhat.device)
        xhat = torch.where(on, xhat, x.to(xhat.device))
        steps = ts.codec.steps(c.packed)
        steps = None if steps is None else torch.where(on, steps[:, :, off : off + hi - lo], 0.0)
        wit = self._witnesses(is_key, x, xhat, torch.zeros_like(sel), steps)
        served = ts.served.view()[:, :, lo:hi]
        served.copy_(torch.where(sel.unsqueeze(-1), xhat, served))
        where = (slice(None), slice(None), slice(lo, hi))
        writes = WriteBatch()
        self._write_witnesses(
            where,
            {
                name: torch.where(
                    sel.view(*sel.shape, *([1] * (val.dim() - 3))), val, getattr(self, name).view()[where]
                )
                for name, val in wit.items()
            },
            writes,
        )
        self._commit(writes)

    def _token_buffers(self) -> tuple[GrowBuffer | LogBuffer, ...]:
        """The per-token witness and position buffers (trimmed and gathered together with the tiers)."""
        return (self.k_band, self.k_wit, self.k_hat_norm, self.v_res, self.v_hat_norm, self.v_dist, self.positions)

    def _unpaged(self, what: str) -> None:
        """Raise ``ValueError`` when the codes live in pages: a page holds the tokens at fixed sequence positions,
        so ``what`` (which moves or drops tokens) cannot keep them addressable."""
        if self.pages is not None:
            raise ValueError(f"{what} is not supported on a store whose codes live in a serving engine's pages")

    def drop_before(self, start: int) -> None:
        """Discard live tokens ``[0, start)`` (sliding-window layers). Packed chunks wholly before are freed."""
        if start <= 0 or self.k is None:
            return
        assert self.v is not None
        self._unpaged("drop_before")
        for ts in (self.k, self.v):
            for buf in (ts.host, ts.served, ts.exact, ts.held):
                buf.drop_before(start)
            ts.recount_exact()
            ts.n_encoded = max(ts.n_encoded - start, 0)
            ts.chunks = [c for c in ts.chunks if c.stop > self.base + start]
            ts.heavy_chunks = [c for c in ts.heavy_chunks if c.stop > self.base + start]
            ts.keep_upgrades_after(self.base + start)
        if self._heavy_hint is not None:
            self._heavy_hint = {t: hint[:, :, start:] for t, hint in self._heavy_hint.items()}
        self.n_held = sum(int(ts.held.view().sum()) for ts in (self.k, self.v))
        self._held_heads = None
        for token_buf in self._token_buffers():
            token_buf.drop_before(start)
        if self.k_steps is not None:
            self.k_steps.drop_before(start)
        self.base += start

    def gather(self, keep: torch.Tensor, retain_evicted: bool = False) -> None:
        """Eviction: keep only physical tokens ``keep[B, H, C]`` (strictly increasing per head).

        Every pending token is encoded first (``flush``), so all heads keep a rectangular run of codes.
        ``retain_evicted`` moves the exact K/V and positions of the evicted entries to the evicted archive
        (validate mode). Requires per-token codecs without a residual window (``ValueError`` otherwise).
        """
        assert self.k is not None and self.v is not None
        self._unpaged("gather")
        if self.upgrade is not None:
            raise ValueError("eviction is not supported on a store with upgrade codecs (upgrade repairs hold slots)")
        for ts in (self.k, self.v):
            if ts.codec.block != 1 or ts.codec.residual_window:
                raise ValueError(f"eviction needs a per-token codec; {ts.codec.name!r} encodes token blocks")
        n = self.n
        if keep.dim() != 3 or keep.shape[:2] != self.k.host.view().shape[:2] or keep.dtype != torch.int64:
            raise ValueError(f"keep must be int64 [B, H, C] for this layer, got {keep.dtype} {tuple(keep.shape)}")
        # one host sync for the three checks (bounds and strict order), not one per check
        if keep.numel() and bool((keep.min() < 0) | (keep.max() >= n) | ~(keep.diff(dim=-1) > 0).all()):
            raise ValueError(f"keep must hold strictly increasing slot indices in [0, {n})")
        if self.base:
            raise ValueError("eviction is not supported on sliding-window layers")
        self.encode_pending(flush=True)
        if retain_evicted and keep.shape[-1] < n:
            kept = torch.zeros(*keep.shape[:2], n, dtype=torch.bool, device=keep.device).scatter(-1, keep, True)
            evicted = torch.sort(kept.to(torch.int8), dim=-1, stable=True).indices[..., : n - keep.shape[-1]]
            for name, buf in (("k", self.k.host), ("v", self.v.host), ("positions", self.positions)):
                gone = evicted.to(buf.view().device)
                idx = gone.reshape(*gone.shape, *([1] * (buf.view().dim() - 3)))
                moved = torch.gather(buf.view(), 2, idx.expand(*gone.shape, *buf.view().shape[3:]))
                if name not in self.evicted:
                    self.evicted[name] = GrowBuffer(moved[:, :, :0])
                self.evicted[name].append(moved)
        for ts in (self.k, self.v):
            ts.chunks = [_Chunk(0, keep.shape[-1], _gather_packed(ts.chunks, keep, n))] if ts.chunks else []
            for buf in (ts.host, ts.served, ts.exact, ts.held):
                buf.gather(keep)
            ts.recount_exact()
            ts.n_encoded = keep.shape[-1]
            ts.last_encoded = 0
        self.compacted = True
        self._held_heads = None
        if self.n_held:  # nothing held stays nothing held: recount (a host sync) only when something was
            self.n_held = sum(int(ts.held.view().sum()) for ts in (self.k, self.v))
        for token_buf in self._token_buffers():
            token_buf.gather(keep)
        if self.k_steps is not None:
            self.k_steps.gather(keep)

    # ---------------------------------------------------------------------------------------- bytes
    def bytes_stored(self) -> int:
        """K/V bytes of the device tier measured from the stored tensors: packed chunks + exact entries (16-bit);
        witnesses excluded (see :meth:`bytes_device` for everything resident)."""
        if self.k is None:
            return 0
        assert self.v is not None
        d, dv = self.k.host.shape[-1], self.v.host.shape[-1]
        return self.k.packed_nbytes() + self.v.packed_nbytes() + self.k.exact_nbytes(d) + self.v.exact_nbytes(dv)

    def bytes_fp16(self) -> int:
        """What an fp16 cache would hold for the same live tokens."""
        if self.k is None:
            return 0
        assert self.v is not None
        return (math.prod(self.k.host.shape) + math.prod(self.v.host.shape)) * 2

    def bytes_witness(self) -> int:
        """Write-time witness bytes: the stored witness buffers (:data:`STORED_WITNESSES`; in ``"f32"`` also
        :data:`SERVED_NORMS`, ``k_wit`` and the Tier-B steps) and the value centre. In ``"log8"`` the codes and base
        exponents count; ``k_wit`` (a sum of decoded bands), the Tier-B steps (the dithered codec's stored scales, 0
        on exact entries) and the served norms (of the entries every read decodes) are derived from tensors already
        counted, as a kernel would recompute them."""
        if self.k is None:
            return 0
        names = STORED_WITNESSES if self.witness == "log8" else (*STORED_WITNESSES, *SERVED_NORMS, "k_wit")
        total = sum(getattr(self, name).nbytes for name in names) + self.v_centre.nbytes
        if self.witness == "f32" and self.k_steps is not None:
            total += self.k_steps.nbytes
        return total

    def bytes_device(self) -> int:
        """Everything resident on the device tier (measured): :meth:`bytes_stored` (codes, scales,
        zero-points, exact entries at 16 bits) + :meth:`bytes_witness`. See the module docstring."""
        return self.bytes_stored() + self.bytes_witness()

    def device_bytes_by_part(self) -> dict[str, int]:
        """:meth:`bytes_device` split by what holds it (measured from the same tensors; the parts sum to it): per
        tensor ``t`` (``k``, ``v``) ``"{t} codes"`` (a single codec's chunks) or, in a token-tier store, ``"{t} light
        codes"``, ``"{t} heavy codes"`` and ``"{t} tier masks"`` (the choice and the dropped-entry bits);
        ``"{t} upgrade codes"`` (the records of upgrade repairs); ``"{t} exact, not yet encoded"`` (the pending tail and
        a codec's residual window) and ``"{t} exact, held"`` (persistent repairs, non-finite and fail-closed entries,
        exact sinks), both at 16 bits; and ``"witnesses"`` (:meth:`bytes_witness`)."""
        parts: dict[str, int] = {}
        if self.k is None:
            return parts
        assert self.v is not None
        for t, ts in (("k", self.k), ("v", self.v)):
            for chunk in ts.chunks:
                for name, tensor in chunk.packed.tensors.items():
                    tier = name.split(".", 1)[0] if isinstance(ts.codec, TokenTiers) else ""
                    part = (
                        f"{t} {tier} codes"
                        if tier in ("light", "heavy")
                        else f"{t} tier masks"
                        if tier
                        else f"{t} codes"
                    )
                    parts[part] = parts.get(part, 0) + tensor.nbytes
            parts[f"{t} upgrade codes"] = sum(u.packed.nbytes for u in ts.upgrades)
            b, h, _, d = ts.host.shape
            pending = (ts.host.n - ts.n_encoded) * b * h * d * EXACT_BYTES
            parts[f"{t} exact, not yet encoded"] = pending
            parts[f"{t} exact, held"] = ts.exact_nbytes(d) - pending
        parts["witnesses"] = self.bytes_witness()
        return parts

    def bytes_host(self) -> int:
        """Host-tier bytes (exact originals)."""
        if self.k is None:
            return 0
        assert self.v is not None
        return self.k.host.nbytes + self.v.host.nbytes


def _as_slots(tokens: slice | torch.Tensor) -> slice | torch.Tensor:
    """A boolean token mask as the indices of its set slots (ascending: indexing by them selects what the mask
    selects, in the same order, without finding the set slots again at every indexing); slices and indices as given."""
    if isinstance(tokens, torch.Tensor) and tokens.dtype == torch.bool:
        return tokens.nonzero().view(-1)
    return tokens


def _head_packed(packed: Packed, h: int) -> Packed:
    """The codes of KV head ``h`` alone of ``packed`` (every tensor sliced on its head axis, dim 1)."""
    heads = packed.shape[1]
    for name, t in packed.tensors.items():
        if t.dim() < 2 or t.shape[1] != heads:
            raise ValueError(f"codec {packed.codec!r} stores {name!r} without a head axis: it cannot upgrade one head")
    tensors = {name: t[:, h : h + 1].clone() for name, t in packed.tensors.items()}
    return Packed(packed.codec, (packed.shape[0], 1, *packed.shape[2:]), tensors)


def _gather_packed(chunks: list[_Chunk], keep: torch.Tensor, n: int) -> Packed:
    """Concatenate per-token packed chunks (``n`` tokens, every one encoded) along the token axis and keep tokens
    ``keep[B, H, C]`` (indices below ``n``, on any device: moved to the codes' device)."""
    first = chunks[0].packed
    tensors: dict[str, torch.Tensor] = {}
    for name in first.tensors:
        cat = torch.cat([c.packed.tensors[name] for c in chunks], dim=2)
        if cat.shape[2] < n:  # the caller checked keep < n: a shape check, no host sync
            raise ValueError("eviction index beyond encoded tokens")
        on = keep.to(cat.device)
        if name in first.heads:  # a tensor of some heads only (a per-head mixed codec)
            on = on[:, list(first.heads[name])]
        idx = on.reshape(*on.shape, *([1] * (cat.dim() - 3))).expand(*on.shape, *cat.shape[3:])
        tensors[name] = torch.gather(cat, 2, idx)
    shape = (*first.shape[:2], keep.shape[-1], *first.shape[3:])
    return Packed(first.codec, shape, tensors, first.heads)


def _norms_up(k: torch.Tensor, v: torch.Tensor, centre: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(‖k‖, ‖v‖, ‖v − c‖)`` over the last dimension, rounded up to float32 (:func:`norm_up_f32`; ``centre``
    broadcasts to ``v``), of entries served exact (pending writes, persistently repaired entries). With equal key
    and value head dims one call on the three stacked (each row's reduction is the one a call of its own makes); on
    CPU with float32 entries one fused kernel (:func:`kvcert.quant.norms_numba.norms_up`: the same rounding up,
    never below the exact norm, within two float32 steps of the tensor form). ``tests/cache/test_cache_store.py``
    pins the stored values per element on both paths. A non-finite entry's norm is ``+inf`` (NaN included): every
    bound it enters is then ``+inf`` and its read fails closed."""
    if fused_log8(k.device) and k.dtype == v.dtype == centre.dtype == torch.float32:
        from kvcert.quant.norms_numba import norms_up  # numba on first use only (kvcert.quant.kernel_env says why)

        norms: tuple[torch.Tensor, ...] = norms_up(k, v, centre)
    else:
        v64 = v.to(torch.float64)
        if k.shape[-1] != v.shape[-1]:
            norms = norm_up_f32(k), norm_up_f32(v), norm_up_f32(v64 - centre)
        else:
            norms = norm_up_f32(torch.stack([k.to(torch.float64), v64, v64 - centre])).unbind(0)
    return tuple(x.nan_to_num(nan=math.inf, posinf=math.inf) for x in norms)
