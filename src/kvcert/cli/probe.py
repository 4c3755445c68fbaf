"""``kvcert probe ...``: run the heterogeneous-memory probe on a model, and gate probe snapshots.

``kvcert probe run`` serves one request through every memory path the model has (dense KV through a
validate-mode certified cache, a top-k selector read, block-pooled entries, MLA latents, recurrent gates), prints
every layer's composed chain with its tier, verdict and dominant stage, writes the ``kvcert.probe/1`` snapshot and
gates it. ``kvcert probe verify FILE...`` gates snapshot files. The lead mounts ``app`` as the ``probe`` sub-app.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Annotated, cast

import torch
import typer
from transformers import PreTrainedModel

from kvcert.cli.common import TINY_PREFIX, load_model
from kvcert.cli.output_checks import out_file
from kvcert.cli.validate import at_least, checked_inputs, fail, seed_in_range
from kvcert.integrations.forget_gates import tiny_recurrent_model
from kvcert.integrations.live_probe.heterogeneous import ProbeConfig, probe_request
from kvcert.integrations.mla import tiny_deepseek_v3
from kvcert.integrations.pooled_attention import Weighting
from kvcert.models.tiny import SUPPORTED_FAMILIES
from kvcert.probe.verify import VerifyResult, verify_file
from kvcert.probe.verify import verify as gate_snapshot
from kvcert.quant.rtn import RTNCodec

HETEROGENEOUS_TINY = ("deepseek_v3", "mamba2", "qwen3_next")
KEY_BITS = (2, 4, 8)

app = typer.Typer(help="Probe snapshot tools.", no_args_is_help=True)

EXIT_OK, EXIT_FAIL, EXIT_NO_FILES = 0, 1, 2


@app.callback()
def probe() -> None:
    """Probe snapshot tools."""


def _expand(patterns: list[str]) -> list[tuple[str, Path | None]]:
    """Each argument as an existing path, else its glob matches (sorted), else ``(arg, None)``."""
    out: list[tuple[str, Path | None]] = []
    for pattern in patterns:
        matches = [pattern] if Path(pattern).exists() else sorted(glob.glob(pattern))
        if not matches:
            out.append((pattern, None))
        out.extend((m, Path(m)) for m in matches)
    return out


@app.command()
def verify(
    files: Annotated[list[str] | None, typer.Argument(help="snapshot files or glob patterns")] = None,
) -> None:
    """Gate each snapshot: integrity (its digest), registry, coverage, magnitude, soundness. Exit 0 all pass,
    1 any failure (also an unreadable or malformed file), 2 no files."""
    if not files:
        typer.echo("no snapshot files given", err=True)
        raise typer.Exit(EXIT_NO_FILES)
    targets = _expand(files)
    failed = 0
    for name, path in targets:
        if path is None:
            result = VerifyResult(ok=False, stage="schema", reasons=(f"schema: no such file {name!r}",))
        else:
            result = verify_file(path)
        if result.ok:
            typer.echo(f"PASS {name}")
            continue
        failed += 1
        typer.echo(f"FAIL {name} [{result.stage}] -- this run's numbers are void")
        for reason in result.reasons:
            typer.echo(f"  {reason}")
    typer.echo(f"{failed} of {len(targets)} snapshot(s) failed" if failed else f"all {len(targets)} passed")
    raise typer.Exit(EXIT_FAIL if failed else EXIT_OK)


def _load(spec: str, seed: int) -> tuple[PreTrainedModel, object | None]:
    """``(model, tokenizer or None)``: the tiny MLA / recurrent configs by name, anything else via
    :func:`kvcert.cli.common.load_model` (zoo name, local folder, ``tiny:<dense family>``)."""
    family = spec[len(TINY_PREFIX) :] if spec.startswith(TINY_PREFIX) else None
    if family not in HETEROGENEOUS_TINY:
        loaded = load_model(spec, seed=seed)
        return loaded.model, loaded.tokenizer
    if family == "deepseek_v3":
        return tiny_deepseek_v3(seed=seed), None
    return tiny_recurrent_model(family, seed=seed), None


def request_ids(vocab: int, tokens: int, seed: int, tokenizer: object | None, prompt: str | None) -> torch.Tensor:
    """The probed request ``[1, tokens]``: ``prompt`` tokenized (repeated to length) if given, else seeded
    random token ids. ``ValueError`` if ``tokens < 2`` or a prompt is given without a tokenizer."""
    if tokens < 2:
        raise ValueError(f"tokens must be >= 2 (a prefill and a decode step), got {tokens}")
    if prompt is None:
        return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))
    if tokenizer is None:
        raise ValueError("prompt needs a model with a tokenizer (the tiny MLA / recurrent configs have none)")
    ids = tokenizer(prompt, return_tensors="pt").input_ids  # type: ignore[operator]
    if ids.shape[1] == 0:
        raise ValueError("prompt tokenizes to nothing")
    return ids.repeat(1, -(-tokens // ids.shape[1]))[:, :tokens]


@app.command()
def run(
    model: Annotated[
        str,
        typer.Option(
            help="smollm2-135m, a local folder, tiny:<llama|qwen2|mistral|gemma3>, "
            "or tiny:<deepseek_v3|mamba2|qwen3_next>"
        ),
    ] = "tiny:llama",
    out: Annotated[Path, typer.Option(help="snapshot file to write")] = Path("probe.json"),
    overwrite: Annotated[bool, typer.Option(help="replace a snapshot file already at --out")] = False,
    tokens: Annotated[int, typer.Option(help="request length (prefill ⌈T/2⌉, then decode steps)")] = 32,
    key_bits: Annotated[int, typer.Option(help="RTN bits of stored keys and pooled entries (group 8)")] = 4,
    pool_block: Annotated[int, typer.Option(help="tokens per pooled entry; 0 disables the pooling path")] = 4,
    pool_weighting: Annotated[str, typer.Option(help="attention | mean")] = "attention",
    prompt: Annotated[str | None, typer.Option(help="text to probe (default: seeded random token ids)")] = None,
    seed: Annotated[int, typer.Option(help="weights (tiny models), token ids and dither seed")] = 0,
) -> None:
    """Probe one request on MODEL: per-layer chains, the snapshot in OUT, and its gate (exit 0 pass, 1 fail)."""
    with checked_inputs("probe run"):  # every option, before a model is built (one line, exit 2)
        if key_bits not in KEY_BITS:
            raise ValueError(f"--key-bits must be one of {KEY_BITS}, got {key_bits}")
        at_least("tokens", tokens, 2)
        at_least("pool-block", pool_block, 0)
        if pool_weighting not in ("attention", "mean"):
            raise ValueError(f"--pool-weighting must be attention or mean, got {pool_weighting!r}")
        seed_in_range(seed)
        family = model[len(TINY_PREFIX) :] if model.startswith(TINY_PREFIX) else None
        if family is not None and family not in (*SUPPORTED_FAMILIES, *HETEROGENEOUS_TINY):
            raise ValueError(
                f"--model: unknown tiny family {family!r}; supported are {', '.join(SUPPORTED_FAMILIES)} (dense) and "
                f"{', '.join(HETEROGENEOUS_TINY)}"
            )
        out_file(out, overwrite)
    try:
        cfg = ProbeConfig(
            key_codec=RTNCodec(key_bits, group_size=8),
            seed=seed,
            pool_block=pool_block or None,
            pool_weighting=cast(Weighting, pool_weighting),  # ProbeConfig refuses any other string (ValueError)
        )
        net, tokenizer = _load(model, seed)
        ids = request_ids(int(net.config.vocab_size), tokens, seed, tokenizer, prompt)
        res = probe_request(net, ids, run_id=f"{model}-seed{seed}", model_name=model, config=cfg)
    except ValueError as exc:
        fail("probe run", str(exc))
    typer.echo(f"{model}: {ids.shape[1]} tokens, paths {', '.join(res.snapshot.declared.paths)}")
    typer.echo("layer  path             chain value   tier       verdict      dominant stage")
    for c in res.chains:
        ev = c.evaluation
        # a reading is printed as the snapshot holds it: a TV value is never above 1
        shown = min(ev.value, 1.0) if c.verdict is None and ev.m_out.norm == "tv" else ev.value
        typer.echo(
            f"{c.layer:5d}  {c.path:15}  {shown:11.4g}   {c.tier.value:9}  {c.verdict or '(reading)':11}  "
            f"{c.dominant_stage}"
        )
    if res.pooling is not None:
        seen = ~torch.isnan(res.pooling.a_l2_max)
        typer.echo(
            f"pooling: {int(res.pooling.blocks.sum())} blocks; ‖w‖₂ (certified coefficient) in "
            f"[{float(res.pooling.a_l2_min[seen].min()):.4f}, {float(res.pooling.a_l2_max[seen].max()):.4f}]"
            f", top1_norm max {float(res.pooling.top1_norm_max[seen].max()):.4f} (empirical)"
        )
    res.snapshot.write(out)
    gate = gate_snapshot(res.snapshot)
    typer.echo(f"snapshot {out}: {'PASS' if gate.ok else 'FAIL [' + gate.stage + ']'}")
    for reason in gate.reasons:
        typer.echo(f"  {reason}")
    raise typer.Exit(EXIT_OK if gate.ok else EXIT_FAIL)
