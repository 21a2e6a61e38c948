"""--calculate-per-token-loss under data parallelism: DP=2 and DP=2 x TP=2 (plain DDP and the
distributed optimizer) give the serial run's gradients, grad norm, logged loss and SGD step.

The global batch has GLOBAL micro-batches whose loss masks keep different numbers of tokens
(LENGTHS: 29 loss tokens on data-parallel rank 0's share, 10 on rank 1's), so the per-token loss
(the sum over all 39 loss tokens / 39) differs from any mean of per-micro-batch or per-rank
means. The serial reference is written out directly: that loss over the whole global batch on the
same TP layout without DistributedDataParallel, its gradients by autograd. DP=2 at TP=1 uses
explicit groups {0, 1}, {2, 3} handed to DistributedDataParallel (the pool has 4 ranks), so
finalize_model_grads must sum the token count over the group DDP reduced over.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import schedules
from megatron.model import GPTModel, TransformerConfig
from tests.helpers import dp_gpt
from tests.helpers.dp_gpt import MBS, SEQ, VOCAB
from tests.helpers.groups import destroy_groups, dp_group
from tests.parallel.harness import init_parallel

SEED, HIDDEN, LAYERS, GLOBAL, LR = 1234, 32, 2, 4, 0.1
# Loss tokens kept at the start of each sample, [micro-batch][sample]: uneven within and across ranks
LENGTHS = [[8, 7], [6, 8], [2, 3], [1, 4]]


def _model():
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, calculate_per_token_loss=True,
                               tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size())
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ)


def _batches():
    """The global batch: (tokens, labels, loss_mask) per micro-batch, each [MBS, SEQ]."""
    masks = [(torch.arange(SEQ) < torch.tensor(lengths).unsqueeze(1)).float() for lengths in LENGTHS]
    return [(tokens, labels, mask) for (tokens, labels), mask in zip(dp_gpt.microbatches(0, GLOBAL), masks)]


def _forward_step(data_iterator, model):
    tokens, labels, mask = next(data_iterator)
    output = model(tokens, torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ), None, labels=labels)  # [b, s]

    def loss_func(losses):  # Megatron-Core's form: (sum over loss tokens, their count, [sum, count])
        loss = (losses.float() * mask).sum()
        count = mask.sum().to(torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

    return output, loss_func


def _optimizer(model):
    # SGD without momentum or weight decay: the step is -LR x gradient; clip_grad only makes it
    # compute the norm (which stays far below it)
    return get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=LR, weight_decay=0.0, sgd_momentum=0.0,
                                                  clip_grad=1e6), [model])


def _serial():
    """The per-token loss of the whole global batch, written out; (loss, grads, grad norm, step)."""
    model = _model()
    optimizer = _optimizer(model)
    tokens, labels, mask = (torch.cat(parts) for parts in zip(*_batches()))  # [GLOBAL * MBS, SEQ]
    losses = model(tokens, torch.arange(SEQ).unsqueeze(0).expand(len(tokens), SEQ), None, labels=labels)
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ok, norm, _ = optimizer.step()
    assert ok
    steps = {name: p.detach() - before[name] for name, p in model.named_parameters()}
    return loss.item(), grads, norm, steps


def _data_parallel(group, distributed: bool):
    """The same global batch dealt to the ranks of group; (logged loss, grads or None, grad norm, step)."""
    d, r = dist.get_world_size(group), dist.get_rank(group)
    model = _model()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed),
                                  model, data_parallel_group=group)
    optimizer = _optimizer(ddp)
    share = _batches()[r * GLOBAL // d:(r + 1) * GLOBAL // d]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    reported = schedules.forward_backward_no_pipelining(
        forward_step_func=_forward_step, data_iterator=iter(share), model=[ddp], num_microbatches=len(share),
        calculate_per_token_loss=True, finalize_model_grads_func=finalize_model_grads)
    total = torch.stack([x["lm loss"] for x in reported]).sum(0).double()  # [sum, count] of this rank's share
    dist.all_reduce(total, group=group)
    # with the distributed optimizer only this rank's shard of main_grad is reduced
    grads = None if distributed else {name: p.main_grad.clone() for name, p in ddp.module.named_parameters()}
    before = {name: p.detach().clone() for name, p in ddp.module.named_parameters()}
    ok, norm, _ = optimizer.step()
    assert ok
    ddp.finish_param_sync()
    steps = {name: p.detach() - before[name] for name, p in ddp.module.named_parameters()}
    return (total[0] / total[1]).item(), grads, norm, steps


def _max_relative_errors(got, expected):
    return {name: ((got[name] - value).abs().max() / value.abs().max()).item() for name, value in expected.items()}


def _compare(tp: int):
    """tp = 1: DP = 2 over explicit groups; tp = 2: parallel_state's DP = 2 of a TP = 2 model."""
    init_parallel(tp=tp)
    created = []
    group = dp_group(2, created)
    serial_loss, serial_grads, serial_norm, serial_steps = _serial()
    results = {"serial": (serial_loss, serial_norm), "d": dist.get_world_size(group)}
    for distributed in (False, True):
        loss, grads, norm, steps = _data_parallel(group, distributed)
        results["dist-opt" if distributed else "ddp"] = {
            "loss": loss, "norm": norm, "steps": _max_relative_errors(steps, serial_steps),
            "grads": None if grads is None else _max_relative_errors(grads, serial_grads)}
    destroy_groups(created)
    return results


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "dp2-tp2"])
def test_per_token_loss_at_dp2_gives_the_serial_gradients_and_grad_norm(dist_pool, tp):
    for rank, result in enumerate(dist_pool.run(_compare, tp)):
        assert result["d"] == 2
        serial_loss, serial_norm = result["serial"]
        for name in ("ddp", "dist-opt"):
            got = result[name]
            assert got["loss"] == pytest.approx(serial_loss, rel=1e-6), (rank, name)
            assert got["norm"] == pytest.approx(serial_norm, rel=1e-5), (rank, name)
            for kind in ("grads", "steps"):
                bad = {param: error for param, error in (got[kind] or {}).items() if error > 1e-5}
                assert not bad, (rank, name, kind, bad)
        assert result["ddp"]["grads"] is not None
