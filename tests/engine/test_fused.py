"""The fused RoPE and SwiGLU kernels against PyTorch's ops (CUDA with Triton only)."""

import pytest
import torch
import torch.nn.functional as F

from disagg.engine.reference import fused

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and fused.triton is not None), reason="needs CUDA and Triton"
)


def test_rope_matches_the_complex_product():
    rows, heads, v_cols, hd = 37, 6, 256, 128
    ang = torch.arange(4096, dtype=torch.float64)[:, None] / (
        10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    )
    rot = torch.polar(torch.ones_like(ang), ang).to(torch.complex64).cuda()
    pos = torch.randint(0, 4096, (rows,), device="cuda")
    x = torch.randn(rows, heads * hd + v_cols, device="cuda", dtype=torch.bfloat16)
    pairs = x[:, : heads * hd].float().view(rows, heads, hd // 2, 2)
    want = torch.view_as_real(torch.view_as_complex(pairs) * rot[pos][:, None]).reshape(rows, -1)
    got = x.clone()
    fused.rope_(got, heads, hd, rot.real.float().contiguous(), rot.imag.float().contiguous(), pos)
    torch.testing.assert_close(got[:, : heads * hd].float(), want, atol=1e-2, rtol=1e-2)
    assert torch.equal(got[:, heads * hd :], x[:, heads * hd :])  # values untouched


@pytest.mark.parametrize("inter", [8192, 1000])
def test_silu_mul_matches_pytorch(inter):
    x = torch.randn(53, 2 * inter, device="cuda", dtype=torch.bfloat16)
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(x).float(), F.silu(gate) * up, atol=2e-2, rtol=1e-2)
