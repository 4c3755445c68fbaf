"""Packed codes stored in a caller's byte pages (a serving engine's paged KV blocks) instead of own tensors.

A page holds ``page_tokens`` consecutive tokens of one sequence for every KV head, as a ``uint8`` tensor
``[H, page_tokens, C]``: one cell of ``C`` bytes per (KV head, token). :class:`CellLayout` places every packed
tensor of the key codec and of the value codec in that cell at a fixed byte offset, so each one is a strided
view of the page (``[1, H, t, width]`` of its own dtype) and the codec decodes it in place. The layout is
*measured*: :meth:`CellLayout.measure` encodes one sample token with each codec and reads the tensors' shapes
and dtypes (nothing is typed by hand), so ``C`` is exactly the packed bytes per (token, KV head) of the two
codecs, rounded up to ``align``.

:class:`PagedCodes` is what a :class:`~kvcert.cache.store.LayerStore` is given to put its codes there:
``page(i)`` returns the byte view of the sequence's ``i``-th page (its block-table entry). An encoded chunk is
copied into the pages it covers, one piece per page, and the store keeps only the page views: no second copy
of the codes exists.

Only per-token codecs fit a cell (``codec.block == 1``, no residual window, every stored tensor ``[B, H, T, *]``);
:meth:`CellLayout.measure` refuses the others with ``ValueError``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcert.quant import Codec, DitherKey, Packed, sample_key


def check_per_token(codec: Codec) -> None:
    """Raise ``ValueError`` unless ``codec`` encodes each token on its own (``block == 1``, no residual window)."""
    if codec.block != 1 or codec.residual_window:
        raise ValueError(
            f"codec {codec.name!r} encodes blocks of {codec.block} tokens"
            + (f" with a residual window of {codec.residual_window}" if codec.residual_window else "")
            + "; only per-token codecs can be stored in a serving engine's pages"
        )


@dataclass(frozen=True)
class Field:
    """One packed tensor of K or V in a cell: ``width`` elements of ``dtype`` at byte ``offset``."""

    tensor: str  # "k" or "v"
    name: str  # the tensor's name in :attr:`Packed.tensors`
    dtype: torch.dtype
    tail: tuple[int, ...]  # the tensor's shape after [B, H, T]
    offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of the field in one cell."""
        return math.prod(self.tail) * self.dtype.itemsize


@dataclass(frozen=True)
class CellLayout:
    """Byte layout of one (KV head, token) cell: every packed tensor of the key and value codecs (see module doc)."""

    key_codec: str
    value_codec: str
    fields: tuple[Field, ...]
    packed_bytes: int  # Σ field bytes: the measured packed bytes per (token, KV head) of K and V together
    nbytes: int  # the cell: packed_bytes rounded up to the alignment

    @classmethod
    def measure(
        cls, key_codec: Codec, value_codec: Codec, head_dim: int, head_dim_v: int, align: int = 1
    ) -> CellLayout:
        """Encode one sample token per codec and lay out its stored tensors: widest element types first (every
        offset is then a multiple of its own element size), the cell rounded up to a multiple of ``align`` and of
        the widest element. Raises ``ValueError`` for a codec that does not store each token on its own."""
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        found: list[tuple[str, str, torch.dtype, tuple[int, ...]]] = []
        for tensor, codec, dim in (("k", key_codec, head_dim), ("v", value_codec, head_dim_v)):
            check_per_token(codec)
            x = torch.randn(1, 1, 1, dim, generator=torch.Generator().manual_seed(0))
            packed = copy.deepcopy(codec).encode(x, sample_key(x) if codec.needs_key else None)
            for name, t in packed.tensors.items():
                if t.dim() < 3 or tuple(t.shape[:3]) != (1, 1, 1):
                    raise ValueError(
                        f"codec {codec.name!r} stores {name!r} as {tuple(t.shape)} for one token of one head; "
                        "only per-token tensors [B, H, T, ...] can be stored in a serving engine's pages"
                    )
                found.append((tensor, name, t.dtype, tuple(t.shape[3:])))
        found.sort(key=lambda f: -f[2].itemsize)  # stable: K before V, the codec's order within each
        fields, offset = [], 0
        for tensor, name, dtype, tail in found:
            fields.append(Field(tensor, name, dtype, tail, offset))
            offset += fields[-1].nbytes
        unit = math.lcm(align, max((f.dtype.itemsize for f in fields), default=1))
        return cls(key_codec.name, value_codec.name, tuple(fields), offset, -(-offset // unit) * unit)

    def views(self, page: torch.Tensor, tensor: str, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """The fields of ``tensor`` ("k" / "v") for tokens ``[lo, hi)`` of the byte page ``page[H, N, C]``, as
        ``{name: [1, H, hi − lo, *tail]}`` views of their own dtypes (writing them writes the page)."""
        if page.dtype != torch.uint8 or page.dim() != 3 or page.shape[-1] != self.nbytes:
            raise ValueError(f"page must be uint8 [H, N, {self.nbytes}], got {page.dtype} {tuple(page.shape)}")
        out = {}
        for f in self.fields:
            if f.tensor == tensor:
                cell = page[:, lo:hi, f.offset : f.offset + f.nbytes].view(f.dtype)  # [H, t, prod(tail)]
                out[f.name] = (cell.unflatten(-1, f.tail) if f.tail else cell.squeeze(-1)).unsqueeze(0)
        return out


#: a sequence's pages: page index (token position // page_tokens) -> its ``uint8 [H, page_tokens, C]`` byte view
PageLookup = Callable[[int], torch.Tensor]


@dataclass
class PagedCodes:
    """Where a :class:`~kvcert.cache.store.LayerStore` stores its packed codes (see the module docstring).

    ``page`` may be replaced between writes (a serving engine hands a fresh block-table row each step); pages
    already written must keep their bytes for as long as the store lives."""

    layout: CellLayout
    page_tokens: int
    page: PageLookup

    def __post_init__(self) -> None:
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}")

    def place(
        self, tensor: str, start: int, stop: int, packed: Packed, key: DitherKey | None
    ) -> list[tuple[int, int, Packed, DitherKey | None]]:
        """Copy the codes ``packed`` of tokens ``[start, stop)`` (positions in the sequence) into the pages they
        fall in. Returns one ``(start, stop, Packed of page views, dither key)`` per page touched, in order."""
        pieces = []
        lo = start
        while lo < stop:
            idx, off = divmod(lo, self.page_tokens)
            hi = min(stop, (idx + 1) * self.page_tokens)
            views = self.layout.views(self.page(idx), tensor, off, off + hi - lo)
            if views.keys() != packed.tensors.keys():
                raise ValueError(f"packed tensors {sorted(packed.tensors)} do not match the layout's {sorted(views)}")
            for name, view in views.items():
                view.copy_(packed.tensors[name][:, :, lo - start : hi - start].reshape(view.shape))
            shape = (*packed.shape[:2], hi - lo, *packed.shape[3:])
            piece_key = (
                None
                if key is None
                else DitherKey(key.seed, key.request, key.layer, key.positions[:, lo - start : hi - start])
            )
            pieces.append((lo, hi, Packed(packed.codec, shape, views), piece_key))
            lo = hi
        return pieces


@dataclass(frozen=True)
class BlockPool:
    """One layer's block pool of a serving engine, ``blocks[num_blocks, H, page_tokens, C]`` (``uint8``, cells laid
    out by ``layout``), and the step's ``block_table[rows, max_blocks]``: page ``j`` of row ``i`` is block
    ``block_table[i, j]``."""

    layout: CellLayout
    blocks: torch.Tensor
    block_table: torch.Tensor

    def __post_init__(self) -> None:
        b = self.blocks
        if b.dtype != torch.uint8 or b.dim() != 4 or b.shape[-1] != self.layout.nbytes:
            raise ValueError(
                f"blocks must be uint8 [num_blocks, H, page_tokens, {self.layout.nbytes}] (the packed cell of "
                f"{self.layout.key_codec!r} / {self.layout.value_codec!r}), got {b.dtype} {tuple(b.shape)}"
            )

    def codes(self, row: int) -> PagedCodes:
        """Where the store of batch row ``row`` keeps its codes this step."""
        table = self.block_table[row]
        return PagedCodes(self.layout, self.blocks.shape[2], lambda j: self.blocks[int(table[j])])
