"""The tolerance of the kernel tests that run on a GPU (``pytest -m cuda``): a kernel's output
against a float64 reference computed from the same (already rounded) inputs, as a relative
error per output vector (a query head's attention output, a batch row of a projection).

    relative_error(out, ref) = ||out - ref||_2 / ||ref||_2   over the last dim(s)

must stay within ``rtol(dtype)``: 8 unit roundoffs of a 16-bit dtype (bfloat16: 2^-5, about
0.031; float16: 2^-8), 2^-14 for float32. The bound scales with the reference itself, so
it holds at any output magnitude: an attention output over 128K tokens whose entries are
about 0.005 (where an absolute bound of 0.02 accepted an all-zero output) is held to the
same 3% as one over 100 tokens. An all-zero output has relative error 1, a shuffled one
(heads or rows permuted, independent outputs) about sqrt(2); one token of the 128 attended
swapped for another moved the worst head of a query group by 0.05-0.23 in
``tests/test_tolerance.py``, which shows each of these failing.

Why 8 unit roundoffs for 16-bit outputs: the kernels compute in float32 from 16-bit inputs
(products of two bfloat16 values are exact in float32) and round once when they store; the
products' operands a kernel rounds to bfloat16 on the way (softmax probabilities before the
P V dot, a normed activation before a projection's dot) add errors of the same size that
average out over the sums, so the rms relative error is about one unit roundoff; 8 leaves
room for the worst head. float32 (2^-14, about 1000 unit roundoffs): the GPU's exp2 is an
approximation (about 2 ulp) whose error the logits' magnitude scales, and sums over 128K
terms grow as their square root.
"""

from __future__ import annotations

import torch
from torch import Tensor

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11,
                 torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}


def rtol(dtype: torch.dtype) -> float:
    """The bound on ``relative_error`` of a kernel's output in ``dtype`` (the dtype of its
    data and output): 8 unit roundoffs for 16-bit dtypes, 2^-14 for float32."""
    if dtype == torch.float32:
        return 2.0 ** -14
    return 8 * UNIT_ROUNDOFF[dtype]


def relative_error(out: Tensor, ref: Tensor, dims: int = 1) -> Tensor:
    """||out - ref||_2 / ||ref||_2 over the last ``dims`` dims, in float64: one value per
    leading index (e.g. per (batch, head) of a (B, H, 1, D) output with ``dims`` 2). A
    reference slice that is all zero gives 0 where ``out`` is zero there too, else inf.

    Raises:
        ValueError: ``ref`` not float64 (the reference must not carry the dtype's rounding),
            or the shapes differ.
    """
    if ref.dtype != torch.float64:
        raise ValueError(f"the reference must be float64, got {ref.dtype}")
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    start = max(0, ref.dim() - dims)
    d = (out.to(ref.device, torch.float64) - ref).flatten(start)
    num, den = d.norm(dim=-1), ref.flatten(start).norm(dim=-1)
    return torch.where(den == 0, torch.where(num == 0, 0.0, float("inf")), num / den)


def assert_near(out: Tensor, ref: Tensor, dtype: torch.dtype | None = None, dims: int = 1,
                what: str = "") -> float:
    """Assert ``relative_error(out, ref, dims)`` within ``rtol(dtype)`` (``dtype``: out's by
    default) for every leading index, naming the worst one; returns the largest error."""
    dtype = dtype or out.dtype
    err = relative_error(out, ref, dims)
    worst = float(err.max())
    bound = rtol(dtype)
    if not worst <= bound:
        at = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape)) \
            if err.dim() else ()
        raise AssertionError(f"{what}: relative error {worst:.3g} at {at} > {bound:.3g} "
                             f"({dtype})")
    return worst
