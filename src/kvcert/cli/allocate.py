"""``kvcert allocate``: a certificate-driven bit allocation per (layer, KV head) from a calibration pass on corpus
text (``docs/codecs.md#bit-allocation``), written as JSON for ``kvcert.quant.Allocation.load``.

The table carries its tiers: the coverages are **certified** shares (reads whose Tier-A certificate is ``≤ τ``) on
the calibration prompts, the bytes are **measured** from encoded tensors (codes and scales; the cache adds its
witnesses). :mod:`kvcert.cli.main` mounts :func:`allocate` as a command.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvcert.cli.common import load_model
from kvcert.cli.output_checks import out_file
from kvcert.cli.progress import progress_bar
from kvcert.cli.validate import at_least, checked_inputs, model_max_positions, seed_in_range
from kvcert.eval.bit_calibration import allocate as allocation_of
from kvcert.eval.bit_calibration import calibrate, calibration_ids, check_calibration
from kvcert.eval.corpora import CORPORA
from kvcert.quant import BUILTINS
from kvcert.quant.bit_allocation import VALUE_CANDIDATES, Allocation
from kvcert.quant.dither import DITHER_BITS
from kvcert.quant.per_head import PerHeadCodec
from kvcert.report.tables import ReportTable, print_table


def allocation_table(alloc: Allocation, head_dim: int) -> ReportTable:
    """Per layer: the key widths and value codecs per KV head, the certified coverage at τ of the chosen widths and
    of the widest, and with ``value_tol`` the value-term share per KV head of each value codec (from the
    calibration's provenance)."""
    cov = alloc.provenance.get("key_coverage", {})
    widest = str(max(int(b) for b in cov)) if cov else None
    shares: dict[str, list[list[float]]] = alloc.provenance.get("value_share", {})
    rows = []
    for layer, (bits, values) in enumerate(zip(alloc.key_bits, alloc.values, strict=True)):
        chosen = [cov[str(b)][layer][h] for h, b in enumerate(bits)] if cov else []
        ref = cov[widest][layer] if widest else []
        rows.append(
            (
                str(layer),
                " ".join(map(str, bits)),
                " ".join(values),
                " ".join(f"{x:.2f}" for x in chosen) or "—",
                " ".join(f"{x:.2f}" for x in ref) or "—",
                "; ".join(f"{v} " + " ".join(f"{x:.2f}" for x in s[layer]) for v, s in shares.items()) or "—",
            )
        )
    widest_bits = int(widest) if widest else max(b for row in alloc.key_bits for b in row)
    uniform = dataclasses.replace(alloc, key_bits=tuple((widest_bits,) * len(row) for row in alloc.key_bits))
    title = (
        f"allocation at tau={alloc.tau}, max_loss={alloc.max_loss}: mean key width {alloc.mean_key_bits():.2f} bits; "
        f"key+value codec bytes/token {alloc.bytes_per_token(head_dim):,.0f} (measured; every key at "
        f"{widest_bits} bits: {uniform.bytes_per_token(head_dim):,.0f})"
    )
    columns = (
        "layer",
        "key bits per KV head (allocated)",
        "values per KV head (allocated)",
        "coverage at tau, chosen (certified, calibration)",
        f"coverage at tau, {widest}-bit (certified, calibration)",
        "value term <= value_tol, share per codec and KV head (certified, calibration)",
    )
    return ReportTable(title, columns, tuple(rows))


def parse_widths(text: str) -> tuple[int, ...]:
    """``--widths``: distinct dithered widths, comma-separated; ``ValueError`` naming the option otherwise."""
    try:
        found = tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise ValueError(f"--widths: expected comma-separated integers among {DITHER_BITS}, got {text!r}") from None
    if not found or len(set(found)) != len(found) or not set(found) <= set(DITHER_BITS):
        raise ValueError(f"--widths: expected distinct widths among {DITHER_BITS}, got {text!r}")
    return found


def parse_value_candidates(text: str) -> tuple[str, ...]:
    """``--value-candidates``: distinct value codecs that a per-head value codec can hold (keyless, each token on its
    own), comma-separated; ``ValueError`` naming the option otherwise."""
    found = tuple(v.strip() for v in text.split(",") if v.strip())
    if not found or len(set(found)) != len(found):
        raise ValueError(f"--value-candidates: expected distinct codec names, got {text!r}")
    for v in found:
        try:
            PerHeadCodec((v,))
        except ValueError as err:
            raise ValueError(f"--value-candidates: {err}") from None
    return found


def allocate(
    out: Annotated[Path, typer.Option(help="where to write the allocation (JSON)")] = Path("allocation.json"),
    overwrite: Annotated[bool, typer.Option(help="replace an allocation file already at --out")] = False,
    model: Annotated[str, typer.Option(help="zoo name, local folder or tiny:<family>")] = "smollm2-135m",
    corpus: Annotated[str, typer.Option(help=f"calibration text, one of {sorted(CORPORA)}")] = "kjv",
    tokens: Annotated[int, typer.Option(help="tokens per calibration prompt")] = 1024,
    prompts: Annotated[int, typer.Option(help="calibration prompts (corpus windows at seeded offsets)")] = 2,
    steps: Annotated[
        int,
        typer.Option(help="greedy tokens per prompt and candidate (>= 2; the first comes from the exact prefill)"),
    ] = 16,
    tau: Annotated[float, typer.Option(help="the gate threshold a read must be certified at")] = 0.2,
    max_loss: Annotated[float, typer.Option(help="coverage a head may lose against the widest width")] = 0.02,
    value_tol: Annotated[
        float | None, typer.Option(help="choose values per KV head by the value term at this tolerance")
    ] = None,
    values: Annotated[str, typer.Option(help="the value codec of every KV head without --value-tol")] = "int4",
    value_candidates: Annotated[
        str, typer.Option(help="with --value-tol: the value codecs to choose from, comma-separated")
    ] = ",".join(VALUE_CANDIDATES),
    seed: Annotated[int, typer.Option(help="seed of the prompts' offsets, the dither and tiny weights")] = 0,
    widths: Annotated[
        str, typer.Option(help="candidate dithered key widths, comma-separated (the widest is the reference)")
    ] = ",".join(map(str, DITHER_BITS)),
) -> None:
    """Calibrate per-(layer, KV head) dithered key widths (and value codecs with --value-tol) from certificates, and
    write the allocation."""
    with checked_inputs("allocate"):
        model_max_positions(model)
        seed_in_range(seed)
        at_least("steps", steps, 2)
        out_file(out, overwrite)
        if values not in BUILTINS:
            raise ValueError(f"--values: unknown codec {values!r}; known are {sorted(BUILTINS)}")
        candidate_values = parse_value_candidates(value_candidates)
        if not 0.0 <= max_loss <= 1.0:
            raise ValueError(f"--max-loss must be in [0, 1], got {max_loss}")
        candidates = parse_widths(widths)
        check_calibration(steps, tau, candidates, value_tol)
        loaded = load_model(model, seed)
        ids = calibration_ids(loaded.tokenizer, corpus, tokens, prompts, seed)
    console = Console(width=max(100, Console().width))
    with progress_bar(f"calibrating on {prompts} prompt(s)", prompts, console) as tick:
        cal = calibrate(
            loaded.model,
            ids,
            steps=steps,
            tau=tau,
            widths=candidates,
            values=candidate_values,
            value_tol=value_tol,
            seed=seed,
            tick=tick,
        )
    head_dim = int(loaded.model.config.get_text_config().head_dim)
    alloc = allocation_of(
        cal,
        tau=tau,
        max_loss=max_loss,
        value_tol=value_tol,
        fixed_values=values,
        head_dim=head_dim,
        provenance={
            "model": model,
            "corpus": corpus,
            "tokens": tokens,
            "prompts": prompts,
            "steps": steps,
            "seed": seed,
        },
    )
    alloc.save(out)
    print_table(console, allocation_table(alloc, head_dim))
    if 1 / cal.reads > max_loss:
        console.print(
            f"[yellow]note:[/] {cal.reads} decode reads per KV head: one read is {1 / cal.reads:.3f} of a share, more "
            f"than --max-loss {max_loss}, so a single read decides between widths or codecs; more --prompts or "
            "--steps give finer shares"
        )
    console.print(f"wrote {out}")
