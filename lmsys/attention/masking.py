"""Causal products in which a masked position contributes nothing, even a NaN or an inf.

Zeroing a masked probability is not enough: in `p @ v`, 0 * NaN is NaN, so a non-finite v[j] would reach every row i
of a dense product, also the rows i < j that cannot see it. `seen_product(a, b)` is `a @ b` for an `a` that is zero
where row i cannot see position j: it multiplies a copy of `b` whose non-finite entries are zero, then sets to NaN the
entries (i, c) of the rows that do see a non-finite b[j, c] (their sum would have been NaN or inf; the sign of an
inf is not kept). Which rows see one is a cumulative count along the positions: O(rows * d), not another product.

`masked_scores` and `masked_values` are the autograd versions for naive attention: x y^T with the hidden scores
filled, and a @ b. Each backward is made of the other one (the gradient of a masked product with respect to its
triangular factor is a masked score matrix, and the other gradient is a product with the transposed triangle), so a
non-finite value stays out of the rows that cannot see it in every gradient too, and a second backward goes through
the same functions.
"""

import torch


def _hidden(n: int, lower: bool, device) -> torch.Tensor:
    """(n, n) True where row i cannot see position j: j > i when `lower` (causal), j < i otherwise (its transpose)."""
    ones = torch.ones(n, n, dtype=torch.bool, device=device)
    return ones.triu(1) if lower else ones.tril(-1)


def seen_product(a: torch.Tensor, b: torch.Tensor, lower: bool = True) -> torch.Tensor:
    """a @ b for a (..., n, n) `a` that is zero where row i cannot see position j (j > i when `lower`, j < i
    otherwise) and a (..., n, d) `b`: a non-finite b[j, c] makes column c of the rows that see j NaN, and of no other
    row."""
    finite = torch.isfinite(b)
    out = a @ torch.where(finite, b, 0)
    bad = (~finite).to(torch.int32)
    seen = (bad.cumsum(-2) if lower else bad.flip(-2).cumsum(-2).flip(-2)) > 0
    return torch.where(seen, torch.nan, out)


class _MaskedScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, lower, fill):
        ctx.save_for_backward(x, y)
        ctx.lower = lower
        return (x @ y.mT).masked_fill(_hidden(x.shape[-2], lower, x.device), fill)

    @staticmethod
    def backward(ctx, ds):
        x, y = ctx.saved_tensors
        ds = ds.masked_fill(_hidden(x.shape[-2], ctx.lower, x.device), 0)
        return masked_values(ds, y, ctx.lower), masked_values(ds.mT, x, not ctx.lower), None, None


class _MaskedValues(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, lower):
        ctx.save_for_backward(a, b)
        ctx.lower = lower
        return seen_product(a, b, lower)

    @staticmethod
    def backward(ctx, do):
        a, b = ctx.saved_tensors
        return masked_scores(do, b, ctx.lower, 0.0), masked_values(a.mT, do, not ctx.lower), None


def masked_scores(x: torch.Tensor, y: torch.Tensor, lower: bool = True, fill: float = float("-inf")) -> torch.Tensor:
    """x @ y^T for (..., n, d) x and y, with the entries where row i cannot see position j set to `fill` (j > i when
    `lower`); differentiable, the hidden entries taking no gradient."""
    return _MaskedScores.apply(x, y, lower, fill)


def masked_values(a: torch.Tensor, b: torch.Tensor, lower: bool = True) -> torch.Tensor:
    """`seen_product(a, b, lower)`, differentiable: no gradient reaches a row that cannot see a non-finite entry."""
    return _MaskedValues.apply(a, b, lower)
