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

The cell also holds the store's write-time witness codes (``"log8"``: the uint8 codes of every stored witness
buffer, ``docs/math.md#compact-witnesses``) when :meth:`CellLayout.measure` is given them (measured from a
sample token the store wrote: :meth:`kvcert.cache.store.LayerStore.cell_layout`). :class:`CellTokens` is the
codes tensor of one witness buffer kept in those fields: a write of the codes of tokens ``[lo, hi)`` writes the
cells of those tokens, and a raised base exponent (which re-codes every stored code ``c`` of a (row, KV head) as
``max(c − Δ, 1)``) rewrites the cells of that sequence in place. The base exponents themselves (one ``int32`` per
(row, KV head)) stay with the store, as the block table does. The exact host tier can live in blocks of the same
ids too (:mod:`kvcert.cache.host_pages`: ``PagedCodes.host``, ``BlockPool.host``).

Only per-token codecs fit a cell (``codec.block == 1``, no residual window, every stored tensor ``[B, H, T, *]``);
:meth:`CellLayout.measure` refuses the others with ``ValueError``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from kvcert.cache.host_pages import HostBlocks, HostPages
from kvcert.quant import Codec, DitherKey, Packed, sample_key


def check_per_token(codec: Codec) -> None:
    """Raise ``ValueError`` unless ``codec`` encodes each token on its own (``block == 1``, no residual window) into
    one cell layout for every head (not a per-head mixed codec: ``dither-mixed``, ``mixed[...]``)."""
    if codec.heads is not None:
        raise ValueError(
            f"codec {codec.name!r} stores each head in its own codec; a serving engine's pages hold one cell layout "
            "for every head"
        )
    if codec.block != 1 or codec.residual_window:
        raise ValueError(
            f"codec {codec.name!r} encodes blocks of {codec.block} tokens"
            + (f" with a residual window of {codec.residual_window}" if codec.residual_window else "")
            + "; only per-token codecs can be stored in a serving engine's pages"
        )


@dataclass(frozen=True)
class Field:
    """One packed tensor of K or V in a cell: ``width`` elements of ``dtype`` at byte ``offset``."""

    tensor: str  # "k", "v", or "w" (a witness buffer's codes)
    name: str  # the tensor's name in :attr:`Packed.tensors` (for "w": the witness buffer's name in the store)
    dtype: torch.dtype
    tail: tuple[int, ...]  # the tensor's shape after [B, H, T]
    offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of the field in one cell."""
        return math.prod(self.tail) * self.dtype.itemsize


@dataclass(frozen=True)
class CellLayout:
    """Byte layout of one (KV head, token) cell: every packed tensor of the key and value codecs and, when measured
    with them, the witness codes (see module doc)."""

    key_codec: str
    value_codec: str
    fields: tuple[Field, ...]
    packed_bytes: int  # Σ K/V field bytes: the measured packed bytes per (token, KV head) of K and V together
    witness_bytes: int  # Σ witness field bytes: the measured witness codes per (token, KV head)
    nbytes: int  # the cell: packed_bytes + witness_bytes rounded up to the alignment

    @classmethod
    def measure(
        cls,
        key_codec: Codec,
        value_codec: Codec,
        head_dim: int,
        head_dim_v: int,
        align: int = 1,
        witnesses: Mapping[str, torch.Tensor] | None = None,
    ) -> CellLayout:
        """Encode one sample token per codec and lay out its stored tensors, then the ``witnesses`` (``{buffer
        name: the codes one token of one KV head stores, [1, 1, 1, *tail]}``, as a store wrote them; none by
        default): widest element types first (every offset is then a multiple of its own element size), the cell
        rounded up to a multiple of ``align`` and of the widest element. Raises ``ValueError`` for a codec that
        does not store each token on its own, or a witness tensor not of one token of one head."""
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
        for name, t in (witnesses or {}).items():
            if t.dim() < 3 or tuple(t.shape[:3]) != (1, 1, 1):
                raise ValueError(f"witness {name!r} must be the codes of one token of one head, got {tuple(t.shape)}")
            found.append(("w", name, t.dtype, tuple(t.shape[3:])))
        found.sort(key=lambda f: -f[2].itemsize)  # stable: K before V before witnesses, each in its own order
        fields, offset = [], 0
        for tensor, name, dtype, tail in found:
            fields.append(Field(tensor, name, dtype, tail, offset))
            offset += fields[-1].nbytes
        unit = math.lcm(align, max((f.dtype.itemsize for f in fields), default=1))
        wit = sum(f.nbytes for f in fields if f.tensor == "w")
        return cls(key_codec.name, value_codec.name, tuple(fields), offset - wit, wit, -(-offset // unit) * unit)

    def field(self, tensor: str, name: str) -> Field:
        """The field ``name`` of ``tensor`` ("k" / "v" / "w"); ``ValueError`` when the cell has none."""
        for f in self.fields:
            if f.tensor == tensor and f.name == name:
                return f
        raise ValueError(f"the cell of {self.key_codec!r} / {self.value_codec!r} has no field {tensor}:{name}")

    def views(self, page: torch.Tensor, tensor: str, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """The fields of ``tensor`` ("k" / "v" / "w") for tokens ``[lo, hi)`` of the byte page ``page[H, N, C]``,
        as ``{name: [1, H, hi − lo, *tail]}`` views of their own dtypes (writing them writes the page)."""
        return {f.name: self.view(page, f, lo, hi) for f in self.fields if f.tensor == tensor}

    def view(self, page: torch.Tensor, f: Field, lo: int, hi: int) -> torch.Tensor:
        """Field ``f`` of tokens ``[lo, hi)`` of the byte page ``page[H, N, C]``: a ``[1, H, hi − lo, *tail]`` view
        of its own dtype (writing it writes the page)."""
        if page.dtype != torch.uint8 or page.dim() != 3 or page.shape[-1] != self.nbytes:
            raise ValueError(f"page must be uint8 [H, N, {self.nbytes}], got {page.dtype} {tuple(page.shape)}")
        cell = page[:, lo:hi, f.offset : f.offset + f.nbytes].view(f.dtype)  # [H, t, prod(tail)]
        return (cell.unflatten(-1, f.tail) if f.tail else cell.squeeze(-1)).unsqueeze(0)


#: a sequence's pages: page index (token position // page_tokens) -> its ``uint8 [H, page_tokens, C]`` byte view
PageLookup = Callable[[int], torch.Tensor]


@dataclass
class PagedCodes:
    """Where a :class:`~kvcert.cache.store.LayerStore` stores its packed codes (see the module docstring).

    ``page`` may be replaced between writes (a serving engine hands a fresh block-table row each step); pages
    already written must keep their bytes for as long as the store lives. ``host``, when given, is where the
    store keeps its exact host tier (:class:`~kvcert.cache.host_pages.HostTokens`), addressed by the same row."""

    layout: CellLayout
    page_tokens: int
    page: PageLookup
    host: HostPages | None = None

    def __post_init__(self) -> None:
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}")
        if self.host is not None and self.host.blocks.k.shape[2] != self.page_tokens:
            raise ValueError(
                f"the host blocks hold {self.host.blocks.k.shape[2]} tokens each, the pages {self.page_tokens}"
            )

    def spans(self, start: int, stop: int) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """The pages tokens ``[start, stop)`` (positions in the sequence) fall in: one ``(page, offset in the page,
        lo, hi)`` per page, in order, tokens ``[lo, hi)`` at ``[offset, offset + hi − lo)`` of ``page``."""
        lo = start
        while lo < stop:
            idx, off = divmod(lo, self.page_tokens)
            hi = min(stop, (idx + 1) * self.page_tokens)
            yield self.page(idx), off, lo, hi
            lo = hi

    def place(
        self, tensor: str, start: int, stop: int, packed: Packed, key: DitherKey | None
    ) -> list[tuple[int, int, Packed, DitherKey | None]]:
        """Copy the codes ``packed`` of tokens ``[start, stop)`` (positions in the sequence) into the pages they
        fall in. Returns one ``(start, stop, Packed of page views, dither key)`` per page touched, in order."""
        pieces = []
        for page, off, lo, hi in self.spans(start, stop):
            views = self.layout.views(page, tensor, off, off + hi - lo)
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
        return pieces


@dataclass(frozen=True)
class BlockPool:
    """One layer's block pool of a serving engine, ``blocks[num_blocks, H, page_tokens, C]`` (``uint8``, cells laid
    out by ``layout``), and the step's ``block_table[rows, max_blocks]``: page ``j`` of row ``i`` is block
    ``block_table[i, j]``. ``host``, when given, is the layer's exact host tier in blocks of the same ids
    (:class:`~kvcert.cache.host_pages.HostBlocks`, ``[num_blocks, H, page_tokens, D]``), addressed by the same
    table."""

    layout: CellLayout
    blocks: torch.Tensor
    block_table: torch.Tensor
    host: HostBlocks | None = None

    def __post_init__(self) -> None:
        b = self.blocks
        if b.dtype != torch.uint8 or b.dim() != 4 or b.shape[-1] != self.layout.nbytes:
            raise ValueError(
                f"blocks must be uint8 [num_blocks, H, page_tokens, {self.layout.nbytes}] (the packed cell of "
                f"{self.layout.key_codec!r} / {self.layout.value_codec!r}), got {b.dtype} {tuple(b.shape)}"
            )
        if self.host is not None and self.host.k.shape[:3] != b.shape[:3]:
            raise ValueError(
                f"the host blocks [num_blocks, H, page_tokens] = {list(self.host.k.shape[:3])} do not match the "
                f"engine's blocks {list(b.shape[:3])}: block ids would address other tokens"
            )

    def codes(self, row: int) -> PagedCodes:
        """Where the store of batch row ``row`` keeps its codes (and, with :attr:`host`, its exact host tier) this
        step."""
        table = self.block_table[row]
        host = None if self.host is None else HostPages(self.host, table)
        return PagedCodes(self.layout, self.blocks.shape[2], lambda j: self.blocks[int(table[j])], host)


class CellTokens:
    """The codes ``[1, H, n, *tail]`` (``uint8``) of one witness buffer of a paged store, kept in the field ``"w":
    name`` of the cells of the sequence's pages (token ``t`` at page ``t // page_tokens``, offset
    ``t % page_tokens``) instead of a tensor of its own: the interface of a
    :class:`~kvcert.cache.buffer.GrowBuffer` that :class:`~kvcert.cache.buffer.LogBuffer` keeps its codes in.

    ``pages()`` returns the store's current :class:`PagedCodes` (a serving engine may hand a fresh block-table row
    each step). :meth:`view` gathers the codes from the cells (a copy: writing it writes nothing); :meth:`write`
    and :meth:`append` write the cells. Moving tokens (:meth:`drop_before`, :meth:`gather`) raises ``ValueError``:
    a page holds the tokens at fixed sequence positions."""

    def __init__(self, pages: Callable[[], PagedCodes], name: str, like: torch.Tensor) -> None:
        """``like``: an empty ``[1, H, 0, *tail]`` tensor of the codes' dtype and device; raises ``ValueError``
        unless the cell has a witness field ``name`` of that dtype and tail."""
        b, h, _, *tail = like.shape
        if b != 1:
            raise ValueError(f"a witness buffer in pages holds one sequence (B = 1), got B = {b}")
        f = pages().layout.field("w", name)
        if f.dtype != like.dtype or f.tail != tuple(tail):
            raise ValueError(
                f"witness {name!r} stores {like.dtype} {tuple(tail)} per token but the cell's field holds "
                f"{f.dtype} {f.tail}: the layout was measured for another witness configuration"
            )
        self._pages, self._field, self._heads, self._device = pages, f, h, like.device
        self.n = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of :meth:`view`."""
        return (1, self._heads, self.n, *self._field.tail)

    @property
    def nbytes(self) -> int:
        """Bytes of the live tokens' codes in the cells."""
        return math.prod(self.shape) * self._field.dtype.itemsize

    def view(self) -> torch.Tensor:
        """The codes of the live tokens ``[1, H, n, *tail]``, gathered from the cells (a copy)."""
        pages = self._pages()
        parts = [pages.layout.view(p, self._field, off, off + hi - lo) for p, off, lo, hi in pages.spans(0, self.n)]
        if not parts:
            return torch.zeros(self.shape, dtype=self._field.dtype, device=self._device)
        return torch.cat(parts, dim=2)

    def _put(self, start: int, x: torch.Tensor) -> None:
        """Write the codes ``x[1, H, t, *tail]`` of tokens ``[start, start + t)`` into their cells."""
        pages = self._pages()
        for page, off, lo, hi in pages.spans(start, start + x.shape[2]):
            pages.layout.view(page, self._field, off, off + hi - lo).copy_(x[:, :, lo - start : hi - start])

    def write(self, index: tuple[int | slice | torch.Tensor, ...], values: torch.Tensor) -> None:
        """``view()[index] = values``, written to the cells: a run of tokens of every (row, head) writes only
        those tokens' cells; any other index rewrites the cells of every live token."""
        every = slice(None)
        tokens = index[2] if len(index) == 3 else None
        if isinstance(tokens, slice) and index[:2] == (every, every):
            run = range(self.n)[tokens]
            if run.step == 1:
                self._put(run.start, torch.broadcast_to(values, (*self.shape[:2], len(run), *self._field.tail)))
                return
        codes = self.view()
        codes[index] = values
        self._put(0, codes)

    def append(self, x: torch.Tensor) -> None:
        """Write the codes ``x[1, H, t, *tail]`` of the next ``t`` tokens into their cells."""
        self._put(self.n, x)
        self.n += x.shape[2]

    def drop_before(self, start: int) -> None:
        """Refused: ``ValueError`` (the cells hold the tokens at fixed sequence positions)."""
        raise ValueError("a witness buffer whose codes live in a serving engine's pages cannot drop tokens")

    def gather(self, index: torch.Tensor) -> None:
        """Refused: ``ValueError`` (the cells hold the tokens at fixed sequence positions)."""
        raise ValueError("a witness buffer whose codes live in a serving engine's pages cannot gather tokens")
