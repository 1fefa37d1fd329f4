"""The fused elementwise kernels (workers/engine/cpu/csrc/elementwise.cpp) of every build this CPU
runs, against torch's operators as the model runs them without the kernels
(:class:`~workers.engine.model.TorchElementwise`): the residual add and the RMSNorm after it, with
and without an addend, and SiLU of the gate times up, over row lengths with and without a tail
past the last whole vector, in float32 and bfloat16; the residual written in place is the sum;
and what they refuse, they refuse by name."""

from __future__ import annotations

import pytest
import torch

from workers.engine.cpu import kernels
from workers.engine.model import TorchElementwise

BUILDS = [capability for capability in kernels.runnable() if kernels.load(capability) is not None]
pytestmark = pytest.mark.skipif(not BUILDS, reason="no kernel build runs here (make kernels)")
TORCH = TorchElementwise()


def assert_as_torch(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: equal to rounding (a row's sum of squares in another order); bfloat16: every
    element equal or one rounding step apart, and nearly all equal."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    ulp = want.float().abs().clamp_min(1e-30) * 2.0**-7
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("capability", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [576, 72, 13])
@pytest.mark.parametrize("with_x", [True, False], ids=["add", "norm-only"])
def test_add_rms_norm_is_torchs(capability, dtype, cols, with_x):
    generator = torch.Generator().manual_seed(cols)
    residual = (torch.randn(37, cols, generator=generator) * 3).to(dtype)
    x = torch.randn(37, cols, generator=generator).to(dtype) if with_x else None
    weight = (torch.rand(cols, generator=generator) + 0.5).to(dtype)
    want_normed, want_sum = TORCH.add_rms_norm(x, residual.clone(), weight, 1e-5)
    written = residual.clone()
    normed, summed = kernels.load(capability).add_rms_norm(x, written, weight, 1e-5)
    assert summed is written  # the residual is the sum, in place
    assert torch.equal(written, want_sum)  # one add, one rounding: exactly torch's
    assert_as_torch(normed, want_normed)


@pytest.mark.parametrize("capability", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1536, 24, 5])
def test_silu_mul_is_torchs(capability, dtype, cols):
    generator = torch.Generator().manual_seed(cols)
    gate_up = (torch.randn(33, 2 * cols, generator=generator) * 4).to(dtype)
    assert_as_torch(kernels.load(capability).silu_mul(gate_up), TORCH.silu_mul(gate_up))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda k: k.silu_mul(torch.zeros(2, 3)), "even number of columns"),
        (lambda k: k.silu_mul(torch.zeros(4, 2).t()), "contiguous"),
        (lambda k: k.silu_mul(torch.zeros(2, 4, dtype=torch.float16)), "bfloat16 or float32"),
        (lambda k: k.add_rms_norm(None, torch.zeros(2, 4), torch.ones(3), 1e-5), "weight"),
        (lambda k: k.add_rms_norm(torch.zeros(3, 4), torch.zeros(2, 4), torch.ones(4), 1e-5), "x must match"),
        (
            lambda k: k.add_rms_norm(None, torch.zeros(2, 4), torch.ones(4, dtype=torch.bfloat16), 1e-5),
            "weight",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(call, message):
    with pytest.raises(RuntimeError, match=message):
        call(kernels.load(BUILDS[0]))
