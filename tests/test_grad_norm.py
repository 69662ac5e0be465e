"""Pure tier: ``tessera.grad_norm.clip_grad_norm``, the one clipping entry point, in one process (the
multi-rank rule is checked by the parity tests of every layout that clips through it)."""

from __future__ import annotations

import pytest
import torch

from tessera.comm import CommGroup
from tessera.grad_norm import GradPiece, clip_grad_norm


def _params_with_grads(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def test_parameters_clip_like_torch_and_a_tied_weight_counts_once():
    ours, theirs = _params_with_grads(), _params_with_grads()
    norm = clip_grad_norm(ours + [ours[0]], {}, 0.5)  # the first parameter listed twice, as a tied weight
    expected = float(torch.nn.utils.clip_grad_norm_(theirs, 0.5))
    assert norm == pytest.approx(expected, rel=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)  # scaled once, by torch's factor (up to its eps)


def test_max_norm_zero_only_measures_and_a_rank_without_gradients_returns_zero():
    params = _params_with_grads()
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, {"tp": CommGroup.single("tp")}, 0.0, axes_of=lambda p: ("tp",))
    assert norm == pytest.approx(float(torch.cat([g.flatten() for g in before]).norm()), rel=1e-6)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    assert clip_grad_norm([torch.nn.Parameter(torch.ones(2))], {}, 1.0) == 0.0  # no gradient anywhere


def test_pieces_that_are_views_scale_the_tensors_named_in_scale():
    flat = torch.tensor([3.0, 4.0, 0.0, 12.0])  # a ZeRO slice: two parameter segments and padding
    pieces = [GradPiece(flat[:2], frozenset({"dp_shard"})), GradPiece(flat[3:], frozenset({"dp_shard"}))]
    norm = clip_grad_norm(pieces, {"dp_shard": CommGroup.single("dp_shard")}, 6.5, scale=[flat])
    assert norm == pytest.approx(13.0)
    torch.testing.assert_close(flat, torch.tensor([1.5, 2.0, 0.0, 6.0]), rtol=1e-6, atol=0)
    with pytest.raises(TypeError, match="axes_of"):  # pieces carry their axes: a second source is refused
        clip_grad_norm(pieces, {}, 1.0, axes_of=lambda p: ())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_flags_any_inf_or_nan_in_any_dtype_group(dtype, bad):
    from tessera.precision import nonfinite

    cpu = torch.device("cpu")
    clean = [torch.randn(300, dtype=dtype), torch.randn(4, 5, dtype=torch.float32), torch.zeros(0, dtype=dtype)]
    assert float(nonfinite(clean, cpu)) == 0.0
    for i in range(2):  # the bad value in either dtype group, at the end of a long tensor
        tensors = [t.clone() for t in clean]
        tensors[i].view(-1)[-1] = bad
        assert float(nonfinite(tensors, cpu)) == 1.0
    # the largest finite values of a 16-bit dtype stay finite: fp32 norms do not overflow on them
    assert float(nonfinite([torch.full((1000,), torch.finfo(torch.float16).max, dtype=torch.float16)], cpu)) == 0.0
    assert float(nonfinite([], cpu)) == 0.0
