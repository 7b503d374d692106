"""The fused draft KL loss in bf16: it equals the plain formulation on the same bf16 logits, softmax in fp32."""

import torch

from peagle.training.loss import draft_kl_loss


def test_bf16_loss_and_gradients_equal_the_plain_formulation():
    g = torch.Generator().manual_seed(0)
    n, d, vocab, rows = 37, 16, 50, 9
    hidden = torch.randn(n, d, generator=g).bfloat16().requires_grad_()
    head = (torch.randn(vocab, d, generator=g) / 4).bfloat16().requires_grad_()
    table = torch.log_softmax(torch.randn(rows, vocab, generator=g) * 3, dim=-1)
    row = torch.randint(0, rows, (n,), generator=g)
    scale = torch.rand(n, generator=g) / n

    loss, argmax = draft_kl_loss(hidden, head, table, row, scale, chunk_size=16)  # three chunks, the last short
    loss.backward()

    h_ref = hidden.detach().clone().requires_grad_()
    w_ref = head.detach().clone().requires_grad_()
    logits = h_ref @ w_ref.t()  # bf16, as the head's matrix product leaves it
    logq = torch.log_softmax(logits.float(), dim=-1)
    teacher_logp = table[row]
    ref = ((teacher_logp.exp() * (teacher_logp - logq)).sum(-1) * scale).sum()
    ref.backward()

    assert hidden.grad.dtype == head.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(argmax, logits.float().argmax(-1))
    # The fused gradient is formed in bf16 before its products, the reference's in fp32: agreement to bf16.
    torch.testing.assert_close(hidden.grad.float(), h_ref.grad.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(head.grad.float(), w_ref.grad.float(), rtol=2e-2, atol=2e-3)
