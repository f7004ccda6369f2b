"""The chunk form's in-chunk inverse ``(I + L)^{-1}`` (blocks by substitution, merged pairwise) against
LAPACK in float64, at chunk sizes that are and are not a power-of-two multiple of its block, and its
gradient against finite differences."""

import pytest
import torch

from efla.ops.torch_chunk import _substitute, _UnitLowerInverse, _unit_lower_inverse


def _error(L: torch.Tensor, got: torch.Tensor) -> float:
    want = torch.linalg.inv(torch.eye(L.shape[-1], dtype=torch.float64) + L)
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("C", [1, 7, 8, 16, 17, 24, 32, 48, 64])
def test_inverse_matches_lapack_in_float64(C):
    gen = torch.Generator().manual_seed(C)
    L = (torch.randn(5, C, C, generator=gen, dtype=torch.float64) * 0.3).tril(-1)
    got = _unit_lower_inverse(L)
    assert _error(L, got) < 1e-14
    assert torch.equal(got.triu(1), torch.zeros_like(got))


@pytest.mark.parametrize("C", [32, 64])
def test_inverse_of_an_ill_conditioned_chunk_is_as_accurate_as_row_by_row_substitution(C):
    gen = torch.Generator().manual_seed(C)
    L = (torch.randn(5, C, C, generator=gen, dtype=torch.float64) * 0.8).tril(-1)  # inverses up to ~1e7
    assert _error(L, _unit_lower_inverse(L)) <= 2 * _error(L, _substitute(L)) + 1e-15


def test_inverse_gradient_matches_finite_differences():
    gen = torch.Generator().manual_seed(0)
    L = (torch.randn(2, 3, 16, 16, generator=gen, dtype=torch.float64) * 0.3).tril(-1).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: _UnitLowerInverse.apply(x.tril(-1)), (L,))
