"""The CPU matmul every linear layer uses (oneDNN when available) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from v1engine.model.layers.linear import linear


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(0, 24), (1, 24), (37, 24), (2, 5, 24)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(dtype, tol, shape, with_bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator).to(dtype)
    weight = torch.randn(40, 24, generator=generator).to(dtype)
    bias = torch.randn(40, generator=generator).to(dtype) if with_bias else None
    with torch.inference_mode():
        out = linear(x, weight, bias)
    assert out.shape == (*shape[:-1], 40) and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=tol, rtol=tol)


def test_non_contiguous_input():
    x = torch.randn(24, 7).t()  # [7, 24], column-major
    weight = torch.randn(16, 24)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
