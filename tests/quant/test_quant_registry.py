import pytest
import torch
from quant_cases import fp16_exact

from kvcert.quant import get, names, quantize, register, unregister

BUILTIN_NAMES = [
    "none",
    "int8",
    "int4",
    "int2",
    "dither-int8",
    "dither-int6",
    "dither-int5",
    "dither-int4",
    "dither-int3",
    "fp8-e4m3",
    "fp8-e5m2",
    "fp8-e4m3-scaled",
    "fp8-e5m2-scaled",
    "kivi-2",
    "kivi-4",
    "minmax-int2",
    "minmax-int4",
    "kvquant-4",
    "sign-1",
    "hadamard-int4",
    "hadamard-int2",
]


def test_builtin_names_and_fresh_instances():
    assert names()[: len(BUILTIN_NAMES)] == BUILTIN_NAMES
    for name in BUILTIN_NAMES:
        a, b = get(name), get(name)
        assert a is not b and a.name == name


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown codec 'int3'.*int8"):
        get("int3")


def test_unknown_option_is_a_value_error():
    with pytest.raises(ValueError, match="invalid options"):
        get("int8", axis="key")


def test_registered_function_measured_through_its_residual():
    def halve_last_channel(x):
        y = x.clone()
        y[..., -1] = y[..., -1] / 2
        return y

    register("test-halve", halve_last_channel)
    try:
        assert "test-halve" in names()
        x = fp16_exact(1, 2, 4, 64, seed=2)
        q = quantize(get("test-halve"), x, bands=8)
        expected = (x[..., -1] / 2).abs().to(torch.float64)
        assert torch.allclose(q.residual_norms, expected, rtol=0, atol=1e-7)
        assert q.steps is None
        assert q.packed.nbytes == x.numel() * 4  # the stored x_hat, float32 as returned
        with pytest.raises(ValueError, match="already registered"):
            register("test-halve", halve_last_channel)
        register("test-halve", lambda x: x, overwrite=True)
        assert torch.equal(get("test-halve").decode(get("test-halve").encode(x)), x)
        with pytest.raises(ValueError, match="takes no options"):
            get("test-halve", group_size=16)
    finally:
        unregister("test-halve")
    assert "test-halve" not in names()


def test_register_rejects_non_callable_and_builtin_names():
    with pytest.raises(ValueError, match="callable"):
        register("test-bad", 3)
    with pytest.raises(ValueError, match="built-in"):
        register("int8", lambda x: x)
    with pytest.raises(ValueError, match="must not contain '\\+bypass'"):
        register("mine+bypass2", lambda x: x)  # the suffix names an outlier bypass around a codec
    with pytest.raises(ValueError, match="no registered function"):
        unregister("test-never")


def test_shape_changing_or_non_finite_function_rejected_at_encode():
    register("test-drop", lambda x: x[..., :-2])
    register("test-nan", lambda x: x * float("nan"))
    try:
        with pytest.raises(ValueError, match="must return shape"):
            get("test-drop").encode(torch.randn(1, 1, 2, 64))
        with pytest.raises(ValueError, match="finite"):
            get("test-nan").encode(torch.randn(1, 1, 2, 64))
    finally:
        unregister("test-drop")
        unregister("test-nan")
