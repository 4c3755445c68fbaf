import torch
from quant_cases import fp16_exact

from kvcert.quant import get


def test_sign_reconstruction_is_sign_times_group_mean_abs():
    codec = get("sign-1")
    x = fp16_exact(2, 2, 8, 64, seed=1)
    packed = codec.encode(x)
    mean_abs = x.unflatten(-1, (2, 32)).abs().mean(-1).to(torch.float16).to(torch.float32)
    expected = torch.where(x >= 0, 1.0, -1.0) * mean_abs.repeat_interleave(32, dim=-1)
    assert torch.equal(codec.decode(packed), expected)
    assert packed.nbytes == 2 * 2 * 8 * (64 // 8 + 2 * 2)


def test_none_is_fp16_storage():
    codec = get("none")
    x = torch.randn(1, 2, 8, 64, dtype=torch.float32)
    packed = codec.encode(x)
    assert packed.tensors["values"].dtype == torch.float16
    assert torch.equal(codec.decode(packed), x.to(torch.float16).to(torch.float32))
    assert packed.nbytes == 2 * x.numel()
