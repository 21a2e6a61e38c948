"""One global batch of 8 split as 8x1, 4x2, 2x4, 1x8 micro-batches: same loss, same gradients.

Two normalisations are offered, as in Megatron:
* default: each micro-batch's loss is its mean over its loss tokens, and micro-batches weigh the
  same (divided by the number of micro-batches). Equal across splits when every micro-batch has
  the same number of loss tokens.
* --calculate-per-token-loss: the sum over every loss token of the global batch divided by their
  total count. Equal across splits whatever the loss masks.
"""
import pytest
import torch

from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.model import GPTModel, TransformerConfig
from megatron.training.training import _reduce_losses
from pretrain_gpt import loss_func

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 97


def make_model():
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ)


def make_batch(uneven_mask):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    loss_mask = torch.ones(GLOBAL_BATCH, SEQ)
    if uneven_mask:  # sample i has its first 2*i tokens masked out of the loss
        for i in range(GLOBAL_BATCH):
            loss_mask[i, : 2 * i] = 0.0
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask,
            "position_ids": torch.arange(SEQ).expand(GLOBAL_BATCH, SEQ)}


def micro_batches(batch, micro_batch_size):
    for start in range(0, GLOBAL_BATCH, micro_batch_size):
        yield {k: v[start:start + micro_batch_size] for k, v in batch.items()}


def forward_step(data_iterator, model):
    data = next(data_iterator)
    output = model(data["tokens"], data["position_ids"], None, labels=data["labels"])
    return output, lambda out: loss_func(data["loss_mask"], out)


def run(batch, micro_batch_size, per_token):
    model = make_model()
    losses = forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=micro_batches(batch, micro_batch_size), model=model,
        num_microbatches=GLOBAL_BATCH // micro_batch_size, calculate_per_token_loss=per_token)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return _reduce_losses(losses)["lm loss"], grads


def reference(batch, per_token, micro_batch_size=None):
    """The loss written out directly on the whole batch; its gradients by autograd."""
    model = make_model()
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s]
    mask = batch["loss_mask"]
    if per_token:
        loss = (losses * mask).sum() / mask.sum()
    else:
        per_mb = [(losses[i:i + micro_batch_size] * mask[i:i + micro_batch_size]).sum()
                  / mask[i:i + micro_batch_size].sum() for i in range(0, GLOBAL_BATCH, micro_batch_size)]
        loss = torch.stack(per_mb).mean()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_same(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-6, abs=1e-7)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-micro-batch", "per-token"])
def test_splits_agree_with_full_loss_masks(per_token):
    batch = make_batch(uneven_mask=False)
    full = reference(batch, per_token=True)
    for micro_batch_size in (1, 2, 4, 8):
        assert_same(run(batch, micro_batch_size, per_token), full)


def test_per_token_splits_agree_with_uneven_loss_masks():
    batch = make_batch(uneven_mask=True)
    full = reference(batch, per_token=True)
    for micro_batch_size in (1, 2, 4, 8):
        assert_same(run(batch, micro_batch_size, per_token=True), full)


def test_default_normalisation_weighs_micro_batches_equally():
    """With uneven masks the default differs between splits, exactly as its definition says."""
    batch = make_batch(uneven_mask=True)
    for micro_batch_size in (1, 2, 4):
        got = run(batch, micro_batch_size, per_token=False)
        assert_same((reference(batch, per_token=False, micro_batch_size=micro_batch_size)[0], got[1]),
                    reference(batch, per_token=False, micro_batch_size=micro_batch_size))
    one, eight = run(batch, 1, per_token=False), run(batch, 8, per_token=False)
    name = "embedding.word_embeddings.weight"
    assert not torch.allclose(one[1][name], eight[1][name], rtol=1e-3, atol=1e-6)
