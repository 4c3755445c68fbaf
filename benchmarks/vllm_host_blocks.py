"""Resident memory of the vLLM plugin's block-keyed exact host tier: allocated versus written.

Question: the plugin allocates one host-block pool per layer (``kvcert.cache.host_pages.HostBlocks.empty``:
``[num_blocks, H, block_size, D]`` for K and for V, ``torch.empty``) as large as vLLM's whole block pool. Does the
process pay for the pool's size, or only for the tokens written into it?

Builds the pools of every layer (defaults: SmolLM2-135M under the plugin at ``VLLM_CPU_KVCACHE_SPACE=1``: 30 layers,
3 KV heads of dimension 64, 803 blocks of 128 tokens, float32; ``docs/serving-vllm.md``), then writes ``--tokens``
tokens of each of ``--sequences`` sequences into every layer through the sequences' block-table rows
(``HostPages.write``, the store's write; sequence ``i`` gets blocks ``i·B .. (i+1)·B − 1``). Prints the pools'
size, the process's resident set (``/proc/self/statm``) after each phase, and the resident growth of the writes
against the bytes written (measured; one run, deterministic: constant values, no randomness). Linux only.

    .venv/bin/python benchmarks/vllm_host_blocks.py
"""

from __future__ import annotations

import argparse
import os

import torch

from kvcert.cache.host_pages import HostBlocks, HostPages

MIB = 2**20


def rss() -> int:
    """The process's resident set in bytes (``/proc/self/statm``, second field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=803)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512, help="tokens written per sequence")
    a = ap.parse_args()
    per_seq = -(-a.tokens // a.block_size)
    if a.sequences * per_seq > a.blocks:
        raise SystemExit(f"{a.sequences} sequences of {a.tokens} tokens need more than {a.blocks} blocks")
    torch.set_num_threads(1)
    x = torch.ones(1, a.heads, a.tokens, a.head_dim)  # the allocation the writes copy from, made before measuring
    start = rss()
    pools = [
        HostBlocks.empty(a.blocks, a.heads, a.block_size, a.head_dim, a.head_dim, torch.float32)
        for _ in range(a.layers)
    ]
    allocated = rss()
    for pool in pools:
        for i in range(a.sequences):
            table = torch.arange(i * per_seq, (i + 1) * per_seq, dtype=torch.int32)  # vLLM's block-table dtype
            pages = HostPages(pool, table)
            pages.write("k", 0, x)
            pages.write("v", 0, x)
    written = rss()
    size = sum(p.k.nbytes + p.v.nbytes for p in pools)
    data = a.layers * a.sequences * a.tokens * a.heads * 2 * a.head_dim * 4
    print(
        f"pools: {a.layers} layers x K/V [{a.blocks}, {a.heads}, {a.block_size}, {a.head_dim}] float32 "
        f"= {size / MIB:.1f} MiB ({size // (a.blocks * a.block_size)} B per token slot)"
    )
    print(f"RSS before            {start / MIB:9.1f} MiB")
    print(f"RSS after allocating  {allocated / MIB:9.1f} MiB  (+{(allocated - start) / MIB:.1f} MiB)")
    print(
        f"RSS after writing     {written / MIB:9.1f} MiB  (+{(written - allocated) / MIB:.1f} MiB for "
        f"{a.sequences} x {a.tokens} tokens = {data / MIB:.1f} MiB written, ratio {(written - allocated) / data:.3f})"
    )


if __name__ == "__main__":
    main()
