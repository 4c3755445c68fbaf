"""The exact host tier of paged stores, kept in one block pool per layer addressed by a serving engine's block ids.

:class:`HostBlocks` is one layer's pool: ``k[num_blocks, H, page_tokens, D]`` and ``v[num_blocks, H, page_tokens,
Dv]`` in the host tier's dtype, the same block count and block size as the engine's pool of packed cells
(:class:`~kvcert.cache.paged.BlockPool`). :class:`HostPages` is one sequence's view of it: the exact K (V) of
token ``t`` of the sequence sits at ``k[table[t // page_tokens], :, t % page_tokens]`` (``v[...]``), with
``table`` the sequence's row of the engine's block table, the row that also addresses its packed cells.
:class:`HostTokens` gives a :class:`~kvcert.cache.store.LayerStore`'s host tier the interface of the
:class:`~kvcert.cache.buffer.GrowBuffer` it otherwise keeps (``n``, ``shape``, ``dtype``, ``device``, ``nbytes``,
``view``, ``append``) over those blocks, as :class:`~kvcert.cache.paged.CellTokens` does for the witness codes.

Memory: :meth:`HostBlocks.empty` allocates with ``torch.empty`` (pinned when CUDA is present, as the host tier
of a store on its own tensors is). On CPU the operating system commits a page of it only when it is first
written, so the resident memory grows with the tokens written, not with the pool's size
(``tests/cache/test_host_pages.py`` measures it; a pinned pool is committed at once).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

#: which exact tensor of a layer: the keys or the values
KV = Literal["k", "v"]


@dataclass(frozen=True)
class HostBlocks:
    """One layer's exact host tier: ``k[num_blocks, H, page_tokens, D]``, ``v[num_blocks, H, page_tokens, Dv]`` of
    one floating dtype on one device (block ``j`` of both holds the tokens the engine's block ``j`` holds)."""

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        k, v = self.k, self.v
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(
                "host blocks must be k[num_blocks, H, page_tokens, D] and v[num_blocks, H, page_tokens, Dv] with the "
                f"same blocks, heads and block size, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.dtype != v.dtype or not k.dtype.is_floating_point or k.device != v.device:
            raise ValueError(
                f"host blocks must share one floating dtype and device, got {k.dtype} on {k.device} and "
                f"{v.dtype} on {v.device}"
            )

    @classmethod
    def empty(
        cls, num_blocks: int, heads: int, page_tokens: int, head_dim: int, head_dim_v: int, dtype: torch.dtype
    ) -> HostBlocks:
        """An uninitialised CPU pool (``torch.empty``: pages are committed as they are written), pinned when CUDA
        is present."""
        pin = torch.cuda.is_available()
        k = torch.empty(num_blocks, heads, page_tokens, head_dim, dtype=dtype, pin_memory=pin)
        v = torch.empty(num_blocks, heads, page_tokens, head_dim_v, dtype=dtype, pin_memory=pin)
        return cls(k, v)

    def tensor(self, which: KV) -> torch.Tensor:
        """The pool of the keys (``"k"``) or of the values (``"v"``)."""
        return self.k if which == "k" else self.v


@dataclass(frozen=True)
class HostPages:
    """One sequence's exact K/V in ``blocks``: page ``j`` (tokens ``[j·P, (j+1)·P)``, ``P`` the block size) is block
    ``table[j]``."""

    blocks: HostBlocks
    table: torch.Tensor

    def _ids(self, first: int, last: int) -> torch.Tensor:
        """The block ids of pages ``[first, last)`` as int64 on the pool's device; ``ValueError`` when the table row
        has fewer entries."""
        if last > self.table.shape[0]:
            raise ValueError(f"the block table row has {self.table.shape[0]} pages, the tokens need {last}")
        return self.table[first:last].to(self.blocks.k.device, torch.int64)

    def read(self, which: KV, n: int) -> torch.Tensor:
        """Tokens ``[0, n)`` as ``[1, H, n, D]`` (a copy: one ``index_select`` of the row's blocks, then one copy
        into token order)."""
        pool = self.blocks.tensor(which)
        _, h, p, d = pool.shape
        pages = -(-n // p)
        picked = pool.index_select(0, self._ids(0, pages))  # [pages, H, P, D]
        return picked.transpose(0, 1).reshape(1, h, pages * p, d).narrow(2, 0, n)

    def write(self, which: KV, start: int, x: torch.Tensor) -> None:
        """Store ``x[1, H, t, D]`` as tokens ``[start, start + t)``: token ``s`` at block ``table[s // P]``, offset
        ``s % P`` (one copy per block the tokens fall in)."""
        pool = self.blocks.tensor(which)
        p, stop = pool.shape[2], start + x.shape[2]
        ids = self._ids(start // p, -(-stop // p)).tolist()
        lo = start
        while lo < stop:
            page, off = divmod(lo, p)
            hi = min(stop, (page + 1) * p)
            pool[ids[page - start // p], :, off : off + hi - lo].copy_(x[0, :, lo - start : hi - start])
            lo = hi


class HostTokens:
    """The exact ``[1, H, n, D]`` tokens of one of K / V of a paged store, kept in the sequence's host blocks
    (see the module docstring) instead of a tensor of its own: the interface of the
    :class:`~kvcert.cache.buffer.GrowBuffer` a store's host tier otherwise is.

    ``pages()`` returns the store's current :class:`HostPages` (a serving engine may hand a fresh block-table row
    each step; the blocks of tokens already written must keep their contents). :meth:`view` gathers the tokens
    (a copy: writing it writes nothing); :meth:`append` writes their blocks. Moving tokens (:meth:`drop_before`,
    :meth:`gather`) raises ``ValueError``: a block holds the tokens at fixed sequence positions."""

    def __init__(self, pages: Callable[[], HostPages], which: KV, like: torch.Tensor) -> None:
        """``like``: an empty ``[1, H, 0, D]`` tensor of the host tier's dtype and device; raises ``ValueError``
        unless the pool of ``which`` has ``H`` heads of dimension ``D`` of that dtype on that device."""
        b, h, _, d = like.shape
        if b != 1:
            raise ValueError(f"a host tier in blocks holds one sequence (B = 1), got B = {b}")
        pool = pages().blocks.tensor(which)
        if (pool.shape[1], pool.shape[3], pool.dtype, pool.device) != (h, d, like.dtype, like.device):
            raise ValueError(
                f"the host blocks of {which!r} are {pool.dtype} [.., {pool.shape[1]}, .., {pool.shape[3]}] on "
                f"{pool.device} but the store writes {like.dtype} [1, {h}, .., {d}] on {like.device}"
            )
        self._pages, self._which, self._heads, self._dim = pages, which, h, d
        self.dtype, self.device = like.dtype, like.device
        self.n = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of :meth:`view`."""
        return (1, self._heads, self.n, self._dim)

    @property
    def nbytes(self) -> int:
        """Bytes of the live tokens (not of the pool)."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def numpy_ok(self) -> bool:
        """False: appends go through :meth:`append` (the blocks are not one numpy array of this sequence)."""
        return False

    def view(self) -> torch.Tensor:
        """The live tokens ``[1, H, n, D]``, gathered from the blocks (a copy)."""
        return self._pages().read(self._which, self.n)

    def append(self, x: torch.Tensor) -> None:
        """Write ``x[1, H, t, D]`` (this buffer's dtype) as the next ``t`` tokens."""
        if x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != (1, self._heads, self._dim):
            raise ValueError(f"append: expected [1, {self._heads}, t, {self._dim}], got {tuple(x.shape)}")
        self._pages().write(self._which, self.n, x)
        self.n += x.shape[2]

    def append_array(self, x: object) -> None:
        """Refused: ``ValueError`` (as :meth:`GrowBuffer.append_array` on a buffer whose :attr:`numpy_ok` is
        False)."""
        raise ValueError("append_array: a host tier in blocks takes appends through append, not numpy")

    def drop_before(self, start: int) -> None:
        """Refused: ``ValueError`` (the blocks hold the tokens at fixed sequence positions)."""
        raise ValueError("a host tier in a serving engine's blocks cannot drop tokens")

    def gather(self, index: torch.Tensor) -> None:
        """Refused: ``ValueError`` (the blocks hold the tokens at fixed sequence positions)."""
        raise ValueError("a host tier in a serving engine's blocks cannot gather tokens")
