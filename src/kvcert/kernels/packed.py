"""The store's packed codes laid out for the Triton read, which dequantizes them in registers.

The store keeps each of K and V as a list of encoded chunks (:class:`~kvcert.quant.Packed`, one per write block)
plus a float32 *decode scratch* of what is served. The Triton read (:mod:`kvcert.kernels.triton_read`) reads
the codes instead of the scratch, so it needs them as one token-major run per layer: :func:`code_tiles` keeps,
per store tensor, a **mirror** — every packed tensor of the chunks appended along the token axis in growable
buffers — updated incrementally (a new chunk is appended; chunks dropped in front by a sliding window are
trimmed; any other change of the chunk list, an eviction's gather, rebuilds it), and returns what the kernels
load (:class:`CodeTiles`).

Served value of a live slot ``t``: the scratch where the store's ``exact`` flag is set (pending tokens, entries
kept exact at write, persistent repairs: the scratch holds the exact value there), otherwise the codec's
``decode`` of its codes, evaluated in the kernel with the same floating-point operations as the codec, hence
**bit for bit** the scratch value (which every witness was computed from):

* ``int8`` / ``int4`` / ``int2`` (:class:`~kvcert.quant.rtn.RTNCodec`): ``code·scale`` in float32 — the product of
  a code of at most 7 bits and an fp16 scale (11 bits) is exact, so the order and fusion of operations cannot
  change it;
* ``kivi-2`` / ``kivi-4`` (:class:`~kvcert.quant.kivi.KiviCodec`, key axis: per channel over token blocks; value
  axis: per token over channel groups): ``zero + code·scale`` in float32 — the product (≤ 4 + 11 bits) is
  exact, one rounding in the addition, with or without a fused multiply-add;
* ``dither-int8`` (:class:`~kvcert.quant.dither.DitherInt8Codec`): ``fl32(scale·(code − u))`` in float64 with
  the dither ``u`` regenerated in the kernel from one stored hash state per token and head
  (:func:`~kvcert.quant.dither.keyed_state`; ``code − u`` and the product are exact in float64);
* ``none`` (fp16): the conversion to float32, exact.

Other codecs (fp8, kvquant, sign, Hadamard, outlier bypass, registered functions) and a dithered store whose
chunks lost their keys (an eviction merged them) are read from the scratch (mode ``SCRATCH``).

Bytes: the mirror holds the same codes, scales and zero-points as the chunks (plus 8 bytes per token and head of
hash state for the dithered codec). ``LayerStore.bytes_device`` counts the chunks, not the mirror: like the
decode scratch, the mirror is a second layout of the same data for this read path, not counted.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kvcert.cache.buffer import GrowBuffer
from kvcert.cache.store import LayerStore, _Chunk, _Tensorstore
from kvcert.quant.dither import DitherInt8Codec, keyed_state
from kvcert.quant.identity import NoneCodec
from kvcert.quant.kivi import KiviCodec
from kvcert.quant.rtn import OFFSET, RTNCodec

__all__ = ["MODES", "CodeTiles", "code_tiles"]

#: how the kernels turn a tile of one store tensor into float32 (the ``MODE`` constexpr of the kernels)
MODES: dict[str, int] = {
    "scratch": 0,
    "rtn8": 1,
    "rtn_packed": 2,
    "dither": 3,
    "kivi_tokens": 4,
    "kivi_channels": 5,
    "fp16": 6,
}


@dataclass(frozen=True)
class CodeTiles:
    """What the Triton read loads for one of K or V of a layer (live views; ``[B, H, ·]`` token-major).

    ``mode``: one of :data:`MODES`; ``codes`` ``[B, H, N, Dc]`` (int8, bit-packed uint8 or fp16), ``scales`` and
    ``zeros`` fp16 ``[B, H, N / group, D]`` (KIVI key axis) or ``[B, H, N, D / group]``, ``state`` int64
    ``[B, H, N]`` (dither hash states), ``exact`` the store's flags as uint8 ``[B, H, S]``; mirror token ``t +
    offset`` holds live slot ``t``. ``group``: channels per scale (token block for the KIVI key axis); ``bits``
    of a packed code and its storage ``offset_code``. In mode ``SCRATCH`` every tensor but ``exact`` is a
    placeholder the kernel never reads.
    """

    mode: int
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    state: torch.Tensor
    exact: torch.Tensor
    offset: int
    group: int
    bits: int
    offset_code: int


def _mode(codec: object) -> tuple[int, int, int, int] | None:
    """``(mode, group, bits, offset_code)`` of a codec the kernels decode in registers; ``None`` otherwise (exact
    class checks: a subclass or wrapper may decode differently)."""
    if type(codec) is RTNCodec:
        bits = int(codec.bits)
        return (
            (MODES["rtn8"], codec.group_size, 8, 0)
            if bits == 8
            else (MODES["rtn_packed"], codec.group_size, bits, OFFSET[bits])
        )
    if type(codec) is DitherInt8Codec:
        return MODES["dither"], codec.group_size, 8, 0
    if type(codec) is KiviCodec:
        if codec.axis == "key":
            return MODES["kivi_tokens"], codec.block, int(codec.bits), 0
        return MODES["kivi_channels"], codec.group_size, int(codec.bits), 0
    if type(codec) is NoneCodec:
        return MODES["fp16"], 1, 16, 0
    return None


class _Mirror:
    """Every chunk's packed tensors appended along the token axis; mirror token 0 is absolute slot ``origin``."""

    def __init__(self, ts: _Tensorstore, dither: bool) -> None:
        first = ts.chunks[0]
        # every stored tensor of the codec: codes (the fp16 codec's "values"), scales, KIVI's zero-points
        self.names: tuple[str, ...] = tuple(
            n for n in ("codes", "values", "scales", "zeros") if n in first.packed.tensors
        )
        self.dither = dither
        self.keyed = True  # every chunk of a dithered store carries its key
        self.origin = first.start
        self.last: _Chunk | None = None
        self.rows: dict[str, int] = {}  # tokens per stored row of each tensor (1, or the KIVI token block)
        self.bufs: dict[str, GrowBuffer] = {}
        self.state: GrowBuffer | None = None
        for c in ts.chunks:
            self.add(c)

    def add(self, c: _Chunk) -> None:
        for name in self.names:
            x = c.packed.tensors[name]
            if name not in self.bufs:
                self.rows[name] = (c.stop - c.start) // x.shape[2]
                self.bufs[name] = GrowBuffer(x[:, :, :0])
            self.bufs[name].append(x)
        if self.dither and c.key is None:  # an eviction merged the chunks: no dither to regenerate per token
            self.keyed = False
        if self.dither and self.keyed and c.key is not None:
            st = keyed_state(c.key, c.packed.shape[1]).to(c.packed.tensors["codes"].device)
            if self.state is None:
                self.state = GrowBuffer(st[:, :, :0])
            self.state.append(st)
        self.last = c

    def trim(self, start: int) -> None:
        """Drop mirror tokens before absolute slot ``start`` (a chunk start: whole stored rows)."""
        delta = start - self.origin
        for name, buf in self.bufs.items():
            buf.drop_before(delta // self.rows[name])
        if self.state is not None:
            self.state.drop_before(delta)
        self.origin = start


_MIRRORS: weakref.WeakKeyDictionary[_Tensorstore, _Mirror] = weakref.WeakKeyDictionary()


def _contiguous(chunks: list[_Chunk], after: _Chunk | None = None) -> bool:
    prev = after
    for c in chunks:
        if prev is not None and c.start != prev.stop:
            return False
        prev = c
    return True


def _mirror(ts: _Tensorstore, dither: bool) -> _Mirror | None:
    """The up-to-date mirror of ``ts``'s chunks (incremental: appended, trimmed in front, else rebuilt);
    ``None`` if the chunks do not tile one run of slots (then the scratch is read)."""
    chunks = ts.chunks
    m = _MIRRORS.get(ts)
    if m is not None and m.last is not None and chunks[0].start >= m.origin:
        # the chunk list only grows at the end and loses whole chunks in front, except on a gather (a new list):
        # find the last mirrored chunk by its start (chunks are contiguous and sorted) and check it is the same
        i = next((j for j in range(len(chunks) - 1, -1, -1) if chunks[j].start <= m.last.start), -1)
        delta = chunks[0].start - m.origin
        aligned = all(delta % r == 0 for r in m.rows.values())
        if i >= 0 and chunks[i] is m.last and aligned and _contiguous(chunks[i + 1 :], m.last):
            if delta:
                m.trim(chunks[0].start)
            for c in chunks[i + 1 :]:
                m.add(c)
            return m
    _MIRRORS.pop(ts, None)
    if not _contiguous(chunks):
        return None
    m = _MIRRORS[ts] = _Mirror(ts, dither)
    return m


def _scratch_tiles(exact: torch.Tensor) -> CodeTiles:
    return CodeTiles(MODES["scratch"], exact, exact, exact, exact, exact, 0, 1, 8, 0)


def _tiles(ts: _Tensorstore, base: int) -> CodeTiles:
    exact = ts.exact.view().view(torch.uint8)
    mode = _mode(ts.codec)
    dither = mode is not None and mode[0] == MODES["dither"]
    if mode is None or not ts.chunks:
        return _scratch_tiles(exact)
    m = _mirror(ts, dither)
    if m is None or not m.keyed:
        return _scratch_tiles(exact)
    codes = m.bufs[m.names[0]].view()
    scales = m.bufs["scales"].view() if "scales" in m.bufs else codes
    zeros = m.bufs["zeros"].view() if "zeros" in m.bufs else scales
    state = m.state.view() if m.state is not None else codes
    return CodeTiles(mode[0], codes, scales, zeros, state, exact, base - m.origin, *mode[1:])


def code_tiles(store: LayerStore) -> tuple[CodeTiles, CodeTiles]:
    """``(keys, values)`` tiles of ``store`` for :func:`kvcert.kernels.triton_read.decode_read` (see the module
    docstring: codes where the codec decodes in registers, the scratch elsewhere and at every exact entry)."""
    assert store.k is not None and store.v is not None
    return _tiles(store.k, store.base), _tiles(store.v, store.base)
