"""Two elementwise steps of the decoder layer fused into one pass each on CUDA (Triton):
RoPE applied in place to the query and key columns of the q/k/v projection, and SwiGLU's
``silu(gate) * up`` over the fused gate/up projection.

Unfused, a 12,288-token prefill of README's 1B shape spends ~13 ms of its ~90 in these
steps: strided views of the gate/up halves, a float copy of q/k for the complex product
and the conversions back (docs/design/reference-engine.md). Fused, each reads its input
once and writes its output once, computing in float32.

``rope_`` and ``silu_mul`` take the same arguments on every device; where Triton or CUDA
is absent (and on the batch-invariant path, whose tiles must be the same calls whatever
the batch) the model keeps PyTorch's ops. The fused path rounds once where PyTorch's
rounds twice, so CUDA tokens may differ from the unfused path's; every engine of one
deployment runs the same path, which is what token-for-token checks compare.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU test machine has no Triton
    triton = None


def available(device: torch.device, head_dim: int) -> bool:
    """Whether the fused kernels run on ``device`` for heads of ``head_dim`` (a power of
    two: the RoPE kernel spans half a head in one block)."""
    half = head_dim // 2
    return triton is not None and device.type == "cuda" and half > 0 and half & (half - 1) == 0


if triton is not None:

    @triton.jit
    def _rope_kernel(
        x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_row, heads, HEADS: tl.constexpr, HALF: tl.constexpr
    ):  # pragma: no cover - runs on CUDA only
        # one program: HEADS heads of one row (a [HEADS, HALF] tile of pairs)
        row = tl.program_id(0)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]
        j = tl.arange(0, HALF)[None, :]
        pos = tl.load(pos_ptr + row)
        c = tl.load(cos_ptr + pos * HALF + j)
        s = tl.load(sin_ptr + pos * HALF + j)
        mask = (h < heads) & (j < HALF)
        base = x_ptr + row * stride_row + h * (2 * HALF) + 2 * j
        a = tl.load(base, mask=mask).to(tl.float32)
        b = tl.load(base + 1, mask=mask).to(tl.float32)
        tl.store(base, (a * c - b * s).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(base + 1, (a * s + b * c).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(
        x_ptr, out_ptr, stride_row, inter, BLOCK: tl.constexpr
    ):  # pragma: no cover - runs on CUDA only
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(x_ptr + row * stride_row + cols, mask=mask).to(tl.float32)
        u = tl.load(x_ptr + row * stride_row + inter + cols, mask=mask).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rope_(
    x: torch.Tensor,
    heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
) -> None:
    """Rotate, in place, the first ``heads`` heads (interleaved pairs, ``head_dim`` each) of
    every row of ``x`` ``[rows, >= heads * head_dim]`` (row-contiguous) by its position's
    angles: ``cos``/``sin`` ``[max_positions, head_dim // 2]`` float32, ``pos`` ``[rows]``."""
    rows = x.shape[0]
    if rows == 0:
        return
    assert x.stride(1) == 1 and head_dim % 2 == 0
    per = 8  # heads a program
    grid = (rows, triton.cdiv(heads, per))
    _rope_kernel[grid](x, cos, sin, pos, x.stride(0), heads, HEADS=per, HALF=head_dim // 2)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x`` ``[rows, 2 * inter]`` (gate first), as ``[rows, inter]``."""
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, device=x.device, dtype=x.dtype)
    if rows:
        assert x.stride(1) == 1
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, x.stride(0), inter, BLOCK=block)
    return out
