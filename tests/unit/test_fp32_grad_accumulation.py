"""bf16 gradients of several micro-batches are summed in fp32 (param.main_grad, a view into the
DistributedDataParallel grad buffer with grad_reduce_in_fp32), as in Megatron."""
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.model import Float16Module, GPTModel, TransformerConfig


def make_model():
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)
    return Float16Module(config, GPTModel(config, vocab_size=64, max_sequence_length=8))


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        tokens = torch.randint(0, 64, (2, 9), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def backward(model, tokens, labels):
    model(tokens, torch.arange(8).expand(2, 8), None, labels=labels).mean().backward()


def test_main_grad_is_the_fp32_sum_of_the_micro_batch_grads():
    reference = make_model()
    per_micro_batch = []
    for tokens, labels in batches():
        reference.zero_grad(set_to_none=True)
        backward(reference, tokens, labels)
        per_micro_batch.append({n: p.grad.float().clone() for n, p in reference.named_parameters()})
    expected = {n: sum(g[n] for g in per_micro_batch) for n in per_micro_batch[0]}

    inner = make_model()
    model = DistributedDataParallel(inner.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), inner)
    assert len(model.param_to_bucket) == len(expected)
    for tokens, labels in batches():
        backward(model, tokens, labels)
    for name, param in inner.named_parameters():
        assert param.grad is None and param.main_grad.dtype == torch.float32
        torch.testing.assert_close(param.main_grad, expected[name], rtol=0, atol=0, msg=name)

    # summing the same gradients in bf16 (what .grad accumulation would do) loses bits
    bf16_sum = {n: sum(g[n].bfloat16() for g in per_micro_batch[1:]) + per_micro_batch[0][n].bfloat16()
                for n in expected}
    assert any(not torch.equal(bf16_sum[n].float(), expected[n]) for n in expected)

    model.zero_grad_buffer()
    assert all(torch.count_nonzero(p.main_grad) == 0 for p in model.parameters())
