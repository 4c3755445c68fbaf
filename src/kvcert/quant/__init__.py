"""Quantizer registry and built-in KV codecs with real packed storage and measured byte counts."""

from kvcert.quant.base import (
    Codec,
    DitherKey,
    Packed,
    Quantized,
    bytes_per_token_head,
    check_input,
    quantize,
    sample_key,
)
from kvcert.quant.bit_allocation import Allocation
from kvcert.quant.dither import keyed_uniform
from kvcert.quant.outlier import OutlierBypass
from kvcert.quant.query_subspace import QuerySubspaceWitness, calibrate_basis
from kvcert.quant.registry import BUILTINS, get, names, register, resolve, unregister

__all__ = [
    "Allocation",
    "BUILTINS",
    "Codec",
    "DitherKey",
    "OutlierBypass",
    "Packed",
    "Quantized",
    "QuerySubspaceWitness",
    "bytes_per_token_head",
    "calibrate_basis",
    "check_input",
    "get",
    "keyed_uniform",
    "names",
    "quantize",
    "register",
    "resolve",
    "sample_key",
    "unregister",
]
