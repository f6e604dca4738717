"""The Triton row copy's direct launch (``page_copy.launch_raw``): GPU only (skipped
elsewhere; run on the lent H200)."""

from __future__ import annotations

import pytest
import torch

from disagg.transport import page_copy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or page_copy._triton_kernel() is None,
    reason="needs a CUDA device and Triton",
)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_launch_raw_reuses_the_compiled_kernel(dtype):
    src = torch.randint(0, 256, (64, 4096), dtype=torch.uint8, device="cuda")
    dst = torch.zeros((48, 4096), dtype=torch.uint8, device="cuda")
    c = page_copy.prepare_device(dst, src)
    assert c is not None
    buf = torch.zeros(64, dtype=dtype, device="cuda")  # slots at 0, rows at 32: aligned
    stream = torch.cuda.current_stream().cuda_stream
    assert not page_copy.launch_raw(c, 3, buf.data_ptr(), buf[32:].data_ptr(), dtype, stream)
    buf[:3] = torch.tensor([5, 0, 40])
    buf[32:35] = torch.tensor([63, 7, 8])
    page_copy.launch_device(c, buf[:3], buf[32:35])  # the JIT compiles it
    assert dst[[5, 0, 40]].equal(src[[63, 7, 8]])
    dst.zero_()
    buf[:5] = torch.tensor([1, 2, 3, 4, 47])
    buf[32:37] = torch.tensor([9, 10, 11, 12, 0])
    assert page_copy.launch_raw(c, 5, buf.data_ptr(), buf[32:].data_ptr(), dtype, stream)
    torch.cuda.synchronize()
    assert dst[[1, 2, 3, 4, 47]].equal(src[[9, 10, 11, 12, 0]])
    assert int(dst.any(dim=1).sum()) == 5, "a row outside the indices was written"
    # misaligned index arrays were not what Triton specialised for: refused, not launched
    odd = buf[1:].data_ptr()
    assert not page_copy.launch_raw(c, 1, odd, buf[32:].data_ptr(), dtype, stream)
