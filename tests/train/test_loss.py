"""The training loss (`train.loss.label_smoothed_loss`, the output layer and its cross-entropy in one
autograd function) against its definition, autograd through `F.cross_entropy`."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import random_model, random_sources
from transformer_mt.train.loss import label_smoothed_loss

PAD = 0


def reference_loss(states, weight, bias, target_ids, epsilon):
    return F.cross_entropy(F.linear(states, weight, bias).float(), target_ids, ignore_index=PAD,
                           label_smoothing=epsilon, reduction="sum")


def operands(seed: int, dtype=torch.float32, bias: bool = True, n: int = 23, d: int = 16, vocab: int = 97):
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(n, d, generator=gen)
    weight = torch.randn(vocab, d, generator=gen) * 0.5
    bias_ = torch.randn(vocab, generator=gen) if bias else None
    targets = torch.randint(1, vocab, (n,), generator=gen)
    targets[::5] = PAD  # pad rows: no loss, no gradient
    leaves = [t.to(dtype).requires_grad_() for t in (states, weight, bias_) if t is not None]
    return leaves if bias else [*leaves, None], targets


def loss_and_grads(loss_fn, leaves, targets, epsilon, scale=0.37):
    loss = loss_fn(*leaves, targets, epsilon)
    (loss * scale).backward()  # a loss divided by the update's tokens, as a step does
    grads = [None if t is None else t.grad.clone() for t in leaves]
    for t in leaves:
        if t is not None:
            t.grad = None
    return loss.detach(), grads


def test_the_loss_matches_a_hand_computation():
    # logits = log(1, 1, 2, 4) -> p = (1/8, 1/8, 2/8, 4/8). Gold class 3: -log p = log 2.
    # Mean over the 4 classes of -log p = (3 + 3 + 2 + 1)/4 · log 2 = 2.25 log 2.
    # With ε = 0.1: 0.9 · log 2 + 0.1 · 2.25 log 2 = 1.125 log 2. The second target is pad: ignored.
    states = torch.log(torch.tensor([[1.0, 1.0, 2.0, 4.0], [5.0, 1.0, 1.0, 1.0]]))  # the logits, through I
    loss = label_smoothed_loss(states, torch.eye(4), None, torch.tensor([3, PAD]), PAD, 0.1)
    assert math.isclose(loss.item(), 1.125 * math.log(2), rel_tol=1e-6)


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("bias", [True, False])
def test_the_loss_and_its_gradients_are_cross_entropys(epsilon: float, bias: bool):
    leaves, targets = operands(1, bias=bias)
    ours = loss_and_grads(lambda *a: label_smoothed_loss(*a[:3], a[3], PAD, a[4]), leaves, targets, epsilon)
    reference = loss_and_grads(reference_loss, leaves, targets, epsilon)
    assert ours[0].dtype == torch.float32
    torch.testing.assert_close(ours[0], reference[0], rtol=1e-6, atol=1e-5)
    for name, a, b in zip(("states", "weight", "bias"), ours[1], reference[1]):
        if b is None:
            assert a is None, name
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.count_nonzero(ours[1][0][targets == PAD]) == 0  # pad rows get no gradient


def test_bf16_operands_give_cross_entropys_gradients_in_bf16():
    leaves, targets = operands(2, dtype=torch.bfloat16)
    ours = loss_and_grads(lambda *a: label_smoothed_loss(*a[:3], a[3], PAD, a[4]), leaves, targets, 0.1)
    reference = loss_and_grads(reference_loss, leaves, targets, 0.1)
    torch.testing.assert_close(ours[0], reference[0], rtol=1e-5, atol=1e-4)  # fp32 from the same bf16 logits
    for a, b in zip(ours[1], reference[1]):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)  # one bf16 rounding apart


def test_a_frozen_output_layer_gets_no_gradient_and_the_states_theirs():
    (states, weight, bias), targets = operands(3)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    label_smoothed_loss(states, weight, bias, targets, PAD, 0.1).backward()
    expected = states.grad.clone()
    states.grad = None
    reference_loss(states, weight, bias, targets, 0.1).backward()
    torch.testing.assert_close(expected, states.grad, rtol=1e-5, atol=1e-6)
    assert weight.grad is None and bias.grad is None


def test_the_models_loss_under_autocast_follows_its_logits():
    # Transformer.project and output_operands: bf16 logits under bf16 autocast, fp32 otherwise.
    model = random_model(0).train()
    src = random_sources(4)
    tgt_in = random_sources(5)
    targets = random_sources(6, batch=tgt_in.shape[0], max_len=tgt_in.shape[1] + 1)[:, :tgt_in.shape[1]]
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            states = model.target_states(src, tgt_in, pack=False)
            logits = model.project(states)
            ours = label_smoothed_loss(*model.output_operands(states), targets.flatten(), PAD, 0.1)
            whole = model(src, tgt_in, pack=False)
        assert logits.dtype == (torch.bfloat16 if autocast else torch.float32)
        torch.testing.assert_close(logits, whole)
        expected = F.cross_entropy(logits.float(), targets.flatten(), ignore_index=PAD, label_smoothing=0.1,
                                   reduction="sum")
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-4)


def test_without_gradients_the_loss_keeps_no_buffer():
    (states, weight, bias), targets = operands(4)
    with torch.no_grad():
        loss = label_smoothed_loss(states, weight, bias, targets, PAD, 0.1)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, reference_loss(states, weight, bias, targets, 0.1).detach())
