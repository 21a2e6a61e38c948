"""A 4-layer GPT trained by data-parallel ranks (tests/parallel/test_data_parallel.py): its sizes, the
global batch of each step, the forward step, a few SGD steps, the optimizer. Runs inside DistributedPool workers.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import schedules

VOCAB, SEQ, MBS, HIDDEN, LAYERS, SEED, GLOBAL, STEPS = 256, 8, 2, 32, 4, 1234, 8, 3


def microbatches(step: int, count: int = GLOBAL):
    """The global batch of a step: `count` (tokens, labels) micro-batches."""
    generator = torch.Generator().manual_seed(100 + step)
    return [(torch.randint(0, VOCAB, (MBS, SEQ), generator=generator),
             torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)) for _ in range(count)]


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    output = model(tokens, positions, None, labels=labels)

    def loss_func(losses):
        loss = losses.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def train(model, optimizer, share: slice, steps: int = STEPS):
    """STEPS optimizer steps on this rank's share of each global batch; returns the logged losses."""
    logged = []
    for step in range(steps):
        batches = microbatches(step)[share]
        if hasattr(model, "zero_grad_buffer"):
            model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = schedules.forward_backward_no_pipelining(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), grad_scale_func=optimizer.scale_loss,
            finalize_model_grads_func=finalize_model_grads)
        optimizer.step()
        local = torch.tensor([sum(x["lm loss"].item() for x in losses), len(losses)], dtype=torch.float64)
        if hasattr(model, "zero_grad_buffer"):
            dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
        logged.append((local[0] / local[1]).item())
    return logged


def make_optimizer(model, bf16: bool):
    return get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1e-2, bf16=bf16, clip_grad=1.0,
                                                  params_dtype=torch.bfloat16 if bf16 else torch.float32), [model])
