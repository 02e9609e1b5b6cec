"""The RL objective against a float64 reference written out by hand, and the staleness filter."""

from __future__ import annotations

import pytest
import torch

from trainer_core.objectives import clipped_policy_gradient_sum, sft_loss_sum, stale_trajectory_mask


def test_clipped_surrogate_matches_a_hand_written_reference():
    generator = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    behaviour = logprobs.detach() + torch.randn(3, 5, generator=generator, dtype=torch.float64) * 0.4
    advantages = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=generator) > 0.3
    loss, stats = clipped_policy_gradient_sum(logprobs, behaviour, advantages, mask, clip_low=0.2, clip_high=0.28)
    expected, clipped_count = 0.0, 0
    for i in range(3):
        for t in range(5):
            if mask[i, t]:
                r = float(torch.exp(logprobs[i, t].detach() - behaviour[i, t]))
                a = float(advantages[i, t])
                clipped = min(max(r, 0.8), 1.28) * a
                expected += -min(r * a, clipped)
                clipped_count += clipped < r * a
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert stats.clipped_fraction == pytest.approx(clipped_count / int(mask.sum()))
    loss.backward()
    # Where the clipped branch is active the gradient is zero; elsewhere it is -r·A.
    r = torch.exp(logprobs.detach() - behaviour)
    active = (r * advantages <= r.clamp(0.8, 1.28) * advantages) & mask
    torch.testing.assert_close(logprobs.grad, torch.where(active, -r * advantages, torch.zeros_like(r)))


def test_on_policy_surrogate_gradient_is_advantage_weighted_sft():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    advantages = torch.tensor([[1.0, -0.5, 2.0]])
    mask = torch.tensor([[True, True, False]])
    loss, _ = clipped_policy_gradient_sum(logprobs, logprobs.detach(), advantages, mask)
    loss.backward()
    assert torch.equal(logprobs.grad, torch.tensor([[-1.0, 0.5, 0.0]]))
    assert float(sft_loss_sum(logprobs, mask)) == 3.0


def test_stale_trajectories_are_dropped_and_counted_or_rejected():
    versions = torch.tensor([10, 7, 9, 4])
    keep, num_stale = stale_trajectory_mask(versions, current_version=10, max_data_staleness=2)
    assert keep.tolist() == [True, False, True, False] and num_stale == 2
    with pytest.raises(
        ValueError,
        match=r"2 trajectory entries \(first at \[\[1\], \[3\]\]\) come from a policy more than max_data_staleness=2",
    ):
        stale_trajectory_mask(versions, current_version=10, max_data_staleness=2, policy="error")
    per_token = torch.tensor([[10, 10, -1], [3, 3, 9]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    keep, num_stale = stale_trajectory_mask(per_token, current_version=10, max_data_staleness=2, valid=valid)
    assert keep.tolist() == [[True, True, True], [False, False, True]] and num_stale == 2


@pytest.mark.parametrize("poison", [float("-inf"), float("nan"), float("inf")])
def test_masked_out_positions_holding_non_finite_values_change_neither_loss_nor_gradient(poison):
    """Padding logprobs of −inf (a masked vocabulary) or NaN must not leak: the mask selects, never multiplies."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -0.7]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.2, -1.5, -0.5, -0.9]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, -0.5, 2.0, 0.3]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, False]])
    # Positions 2 and 3 are masked out: poison every input there, one tensor at a time and all at once.
    for poisoned in ("logprobs", "behaviour", "advantages", "all"):
        inputs = {"logprobs": logprobs.clone(), "behaviour": behaviour.clone(), "advantages": advantages.clone()}
        for name in inputs:
            if poisoned in (name, "all"):
                inputs[name][0, 2:] = poison
        leaf = inputs["logprobs"].requires_grad_()
        loss, stats = clipped_policy_gradient_sum(
            leaf, inputs["behaviour"], inputs["advantages"], mask, clip_low=0.2, clip_high=0.2
        )
        # By hand, tokens 0 and 1 only: r0 = e^0.2 ≈ 1.2214 clipped to 1.2 (A = 1 > 0: min picks 1.2);
        # r1 = e^-0.5 ≈ 0.6065, A = −0.5: min(−0.3033, −0.4) = −0.4 (clipped at 0.8).
        r0, r1 = (float(torch.exp(torch.tensor(x, dtype=torch.float64))) for x in (0.2, -0.5))
        expected = -min(r0 * 1.0, min(max(r0, 0.8), 1.2) * 1.0) - min(r1 * -0.5, min(max(r1, 0.8), 1.2) * -0.5)
        assert float(loss) == pytest.approx(expected, rel=1e-12), poisoned
        assert stats.clipped_fraction == pytest.approx(1.0) and stats.mean_ratio == pytest.approx((r0 + r1) / 2)
        loss.backward()
        # Both tokens sit on the clipped branch: zero gradient there, and exactly zero at the masked positions.
        assert torch.equal(leaf.grad, torch.zeros_like(leaf)), (poisoned, leaf.grad)
        sft_leaf = inputs["logprobs"].detach().clone().requires_grad_()
        sft = sft_loss_sum(sft_leaf, mask)
        assert float(sft) == 3.0, poisoned
        sft.backward()
        assert torch.equal(sft_leaf.grad, torch.tensor([[-1.0, -1.0, 0.0, 0.0]], dtype=torch.float64)), poisoned


def test_a_weighted_float_mask_still_weighs_and_its_zeros_still_select():
    """Per-token weights (a float mask) scale each token's term, as before; a zero weight leaves NaN out entirely."""
    logprobs = torch.tensor([[-1.0, -2.0, float("nan")]], dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([[1.0, 0.5, 0.0]], dtype=torch.float64)
    sft = sft_loss_sum(logprobs, weights)
    assert float(sft) == 1.0 + 0.5 * 2.0
    sft.backward()
    assert torch.equal(logprobs.grad, torch.tensor([[-1.0, -0.5, 0.0]], dtype=torch.float64))
    on_policy = logprobs.detach().clone().requires_grad_()
    advantages = torch.tensor([[2.0, -1.0, float("nan")]], dtype=torch.float64)
    loss, stats = clipped_policy_gradient_sum(on_policy, on_policy.detach(), advantages, weights)
    # r = 1 everywhere it counts: the term is −A per token, weighted: −(1·2 + 0.5·(−1)).
    assert float(loss) == -(1.0 * 2.0 + 0.5 * -1.0) and stats.mean_ratio == pytest.approx(1.0)
    loss.backward()
    assert torch.equal(on_policy.grad, torch.tensor([[-2.0, 0.5, 0.0]], dtype=torch.float64))
