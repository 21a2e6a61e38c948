"""LoRA in one process: the adapted model is base + (alpha / r) B A, fresh adapters change nothing,
A is drawn as PEFT draws it, and only the adapters train: the exact trainable count, no gradient
or main_grad for the base, DDP's buffer and every optimizer's state sized by the adapters alone.
The multi-rank layouts are in tests/parallel/test_lora_parallel.py."""

import math

import pytest
import torch
from torch import nn

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, optimizer_memory_per_parameter
from megatron.core.tensor_parallel.lora import LoRAConfig, draw_lora_a
from megatron.model import Float16Module
from megatron.model.lora import is_lora_parameter, lora_state_dict, merge_lora_state_dict
from tests.helpers import lora as tiny

KINDS = ["gpt", "llama"]


def _logits(model, batch):
    tokens, _, _, position_ids = batch
    with torch.no_grad():
        return model(tokens, position_ids, None)  # [b, s, v]


@pytest.mark.parametrize("kind", KINDS)
def test_adapted_model_is_the_base_plus_scaled_low_rank_update(kind):
    batch = tiny.microbatches(1)[0]
    base = tiny.build(kind, lora=None)
    fresh = tiny.build(kind, randomize=False)
    torch.testing.assert_close(_logits(fresh, batch), _logits(base, batch), rtol=0, atol=0)  # B = 0
    adapted = tiny.build(kind)
    assert len(lora_state_dict(adapted)) == 2 * 4 * tiny.LAYERS
    merged = merge_lora_state_dict(adapted.state_dict(), tiny.LORA.scaling)
    base.load_state_dict(merged)  # strict: exactly the base keys
    expected, actual = _logits(base, batch), _logits(adapted, batch)
    assert (actual - _logits(fresh, batch)).abs().max() > 1e-3  # the adapters do something
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_a_is_drawn_as_peft_draws_lora_a():
    generator = torch.Generator().manual_seed(3)
    a = draw_lora_a(8, 64, generator)
    reference = torch.empty(8, 64)
    nn.init.kaiming_uniform_(reference, a=math.sqrt(5), generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, reference)
    assert a.abs().max() <= 1 / math.sqrt(64)  # kaiming-uniform with a = sqrt(5): bound 1/sqrt(fan_in)
    assert LoRAConfig(rank=8, alpha=16).scaling == 2.0


def _ddp(model, dtype, distributed):
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
    if dtype != torch.float32:
        model = Float16Module(model.config, model)
    return DistributedDataParallel(model.config, config, model)


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_only_the_adapters_train(kind, precision, distributed):
    dtype = PRECISIONS[precision]
    model = tiny.build(kind, bf16=dtype == torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == tiny.trainable_count(kind)
    assert all(is_lora_parameter(n) for n in trainable) and len(trainable) == 8 * tiny.LAYERS
    ddp = _ddp(model, dtype, distributed)
    assert sum(buffer.numel for buffer in ddp.buffers) == tiny.trainable_count(kind)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=dtype == torch.bfloat16, params_dtype=dtype),
                                       [ddp])
    before = {n: p.detach().clone() for n, p in ddp.named_parameters()}
    tokens, labels, loss_mask, position_ids = tiny.microbatches(1)[0]
    ddp.zero_grad_buffer()
    loss = (ddp(tokens, position_ids, None, labels=labels).float() * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    ddp.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok
    for name, param in ddp.named_parameters():
        if is_lora_parameter(name):
            assert not torch.equal(param, before[name]), name  # stepped
        else:
            assert param.grad is None and not hasattr(param, "main_grad"), name
            assert torch.equal(param, before[name]), name
    memory = optimizer_memory_per_parameter([ddp], optimizer)["bytes"]
    count = tiny.trainable_count(kind)
    assert memory["model_params"] == total * dtype.itemsize
    assert memory["grads"] == 4 * count  # the fp32 grad buffer, adapters only
    assert memory["optimizer_state"] == 8 * count  # Adam's two fp32 moments, adapters only
    assert memory["main_params"] == (0 if dtype == torch.float32 else 4 * count)


def test_lora_flags_are_checked():
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.argument_utils import ArgsError

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
            "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]
    args = parse_and_validate_args(argv=base + ["--lora-rank", "4", "--lora-target-modules", "linear_qkv"])
    assert (args.lora_rank, args.lora_alpha, args.lora_target_modules) == (4, 32.0, ["linear_qkv"])
    for extra, message in [(["--lora-rank", "-1"], "--lora-rank"), (["--lora-rank", "2", "--lora-dropout", "1"],
                                                                     "--lora-dropout"),
                           (["--lora-rank", "2", "--lora-alpha", "0"], "--lora-alpha"),
                           (["--lora-rank", "2", "--num-experts", "2"], "--num-experts")]:
        with pytest.raises(ArgsError, match=message):
            parse_and_validate_args(argv=base + extra)


def test_target_modules_choose_the_adapted_layers():
    model = tiny.build("llama", lora=LoRAConfig(rank=2, alpha=4.0, target_modules=("linear_qkv", "linear_fc2")))
    names = sorted({n.split(".")[-4] for n, p in model.named_parameters() if p.requires_grad})
    assert names == ["linear_fc2", "linear_qkv"]
    qkv_out = (tiny.HEADS + 2 * 2) * (tiny.HIDDEN // tiny.HEADS)
    expected = tiny.LAYERS * 2 * ((tiny.HIDDEN + qkv_out) + (tiny.FFN + tiny.HIDDEN))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_gives_the_adapters_their_gradients(granularity):
    """Full recompute reruns each layer from its input, which the frozen embedding would leave without
    gradient: the adapters must get the gradients of the run without recompute."""
    recompute = dict(recompute_granularity=granularity)
    if granularity == "full":
        recompute.update(recompute_method="uniform", recompute_num_layers=1)
    grads = []
    for overrides in ({}, recompute):
        model = tiny.build("llama", **overrides)
        tokens, labels, loss_mask, position_ids = tiny.microbatches(1)[0]
        (model(tokens, position_ids, None, labels=labels) * loss_mask).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert all(g is not None and g.abs().max() > 0 for g in grads[1].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=0)
