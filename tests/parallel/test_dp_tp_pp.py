"""All three at once: DP=2 x TP=2 x PP=2 over 8 gloo processes against the serial model.

Each rank trains the serial GPT (one stage, TP = 1, no data parallelism) for STEPS optimizer
steps on the whole global batch, then its own piece of the 3-D layout (its pipeline stage's
layers, its TP shard, wrapped in DistributedDataParallel) on its data-parallel half of each
global batch with the 1F1B schedule. After the last step every parameter, gathered over TP and
mapped to its global layer, equals the serial one. This module spawns its own 8-rank pool
(the shared one has 4 ranks).
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import schedules
from tests.helpers import pp_gpt, tp_gpt
from tests.helpers.pp_gpt import MBS, SEQ, VOCAB
from tests.parallel.harness import DistributedPool, init_parallel

GLOBAL, STEPS = 8, 3


def _global_batch(step: int):
    generator = torch.Generator().manual_seed(500 + step)
    batches = []
    for _ in range(GLOBAL):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        loss_mask = torch.ones(MBS, SEQ)
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
        batches.append((tokens, labels, loss_mask, position_ids))
    return batches


def _train(chunks, optimizer, share: slice, ddp: bool):
    losses = []
    for step in range(STEPS):
        batches = _global_batch(step)[share]
        for chunk in chunks:
            if ddp:
                chunk.zero_grad_buffer()
        optimizer.zero_grad()
        func = schedules.get_forward_backward_func() if ddp else schedules.forward_backward_no_pipelining
        reported = func(forward_step_func=pp_gpt.make_forward_step(False), data_iterator=iter(batches), model=chunks,
                        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS,
                        finalize_model_grads_func=finalize_model_grads if ddp else None)
        optimizer.step()
        losses.append([x["lm loss"].item() for x in reported])
    return losses


def _optimizer(chunks, use_distributed_optimizer: bool):
    config = OptimizerConfig(optimizer="sgd", lr=1e-2, clip_grad=1.0)  # SGD: see test_data_parallel.py
    return get_megatron_optimizer(config, chunks, use_distributed_optimizer=use_distributed_optimizer)


def _compare(use_distributed_optimizer: bool):
    init_parallel(tp=1)
    (serial,), _ = pp_gpt.build_chunks(1, 1, None)
    serial_losses = _train([serial], _optimizer([serial], False), slice(None), ddp=False)
    expected = {name: p.detach().clone() for name, p in serial.named_parameters()}
    parallel_state.destroy_model_parallel()

    init_parallel(tp=2, pp=2)
    chunks, offsets = pp_gpt.build_chunks(2, 2, None)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=4000,
                                               use_distributed_optimizer=use_distributed_optimizer)
    wrapped = [DistributedDataParallel(chunk.config, ddp_config, chunk) for chunk in chunks]
    for chunk in wrapped:
        chunk.broadcast_params()
    d, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    half = GLOBAL // d
    losses = _train(wrapped, _optimizer(wrapped, use_distributed_optimizer), slice(r * half, (r + 1) * half),
                    ddp=True)
    errors = {}
    for chunk, offset in zip(chunks, offsets):
        for name, param in chunk.named_parameters():
            full = tp_gpt.gather(param, param.detach())
            reference = expected[pp_gpt.serial_name(name, offset, untied=False)]
            rows = slice(0, VOCAB) if name.endswith(("word_embeddings.weight", "output_layer.weight")) else slice(None)
            errors[f"{offset}:{name}"] = ((full[rows] - reference[rows]).abs().max()
                                         / reference[rows].abs().max()).item()
    return {"d": d, "dp_rank": r, "last": parallel_state.is_pipeline_last_stage(), "losses": losses,
            "serial_losses": serial_losses, "errors": errors}


@pytest.fixture(scope="module")
def pool8():
    pool = DistributedPool(8)
    yield pool
    pool.close()


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["ddp", "distributed-optimizer"])
def test_dp2_tp2_pp2_equals_the_serial_model(pool8, use_distributed_optimizer):
    results = pool8.run(_compare, use_distributed_optimizer)
    for rank, result in enumerate(results):
        assert result["d"] == 2
        bad = {name: error for name, error in result["errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
        if result["last"]:
            # this replica's micro-batches are its half of the serial run's
            half = GLOBAL // 2
            for step, losses in enumerate(result["losses"]):
                own = result["serial_losses"][step][result["dp_rank"] * half:(result["dp_rank"] + 1) * half]
                assert losses == pytest.approx(own, rel=1e-5), (rank, step)
