"""Bytes per parameter (Megatron's table at d = 1) and the distributed optimizer in one process.

At one data-parallel rank the distributed optimizer owns every bucket whole, so it must step
exactly like the plain optimizers, and Megatron's table reads 20 / 18 / 16 bytes per parameter
for fp16+fp16, bf16+fp32 and fp32+fp32 either way. The multi-rank cases (d = 2, 4) are in
tests/parallel/test_distributed_optimizer.py.
"""

import os

import pytest
import torch
from torch import nn

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import (
    DistributedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
    optimizer_memory_per_parameter,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

# (param dtype, grad_reduce_in_fp32) -> Megatron's bytes per parameter (non-distributed, distributed at d = 1)
TABLE = {"fp16/fp16": (torch.float16, False, 20.0), "bf16/fp32": (torch.bfloat16, True, 18.0),
         "fp32/fp32": (torch.float32, True, 16.0)}


class _Config:  # DistributedDataParallel reads only calculate_per_token_loss from it
    calculate_per_token_loss = False


def _ddp(dtype: torch.dtype, fp32_grads: bool, distributed: bool, **ddp_kwargs) -> DistributedDataParallel:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8)).to(dtype)
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=fp32_grads, use_distributed_optimizer=distributed,
                                           **ddp_kwargs)
    return DistributedDataParallel(_Config(), config, model)


def _optimizer(ddp: DistributedDataParallel, dtype: torch.dtype, **kwargs):
    config = OptimizerConfig(lr=0.01, weight_decay=0.1, clip_grad=0.05, fp16=dtype == torch.float16,
                             bf16=dtype == torch.bfloat16, params_dtype=dtype,
                             loss_scale=128.0 if dtype == torch.float16 else None, **kwargs)
    return get_megatron_optimizer(config, [ddp])


def _steps(ddp: DistributedDataParallel, optimizer, steps: int = 2) -> list:
    generator = torch.Generator().manual_seed(1)
    results = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        x = torch.randn(4, 16, generator=generator).to(next(ddp.parameters()).dtype)
        loss = ddp(x).float().pow(2).mean()
        optimizer.scale_loss(loss).backward()
        ddp.finish_grad_sync()
        results.append(optimizer.step())
    return results


@pytest.mark.parametrize("precision", list(TABLE))
@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_bytes_per_parameter_after_a_step_are_megatrons(precision, distributed):
    dtype, fp32_grads, expected = TABLE[precision]
    ddp = _ddp(dtype, fp32_grads, distributed)
    optimizer = _optimizer(ddp, dtype)
    plain = {torch.float32: FP32Optimizer}.get(dtype, Float16OptimizerWithFloat16Params)
    assert isinstance(optimizer, DistributedOptimizer if distributed else plain)
    before = optimizer_memory_per_parameter([ddp], optimizer)
    assert before["optimizer_state"] == 0.0  # Adam allocates its moments in the first step
    assert all(ok for ok, _, _ in _steps(ddp, optimizer))
    memory = optimizer_memory_per_parameter([ddp], optimizer)
    assert memory["num_parameters"] == sum(p.numel() for p in ddp.parameters())
    assert memory["total"] == expected, memory
    size = dtype.itemsize
    assert memory["model_params"] == size and memory["optimizer_state"] == 8.0
    assert memory["grads"] == (4.0 if fp32_grads else size)
    # separate fp32 copies exist only for half-precision params; an fp32 main grad only over an fp16 buffer
    assert memory["main_params"] == (0.0 if dtype == torch.float32 else 4.0)
    assert memory["main_grads"] == (0.0 if fp32_grads else 4.0)


@pytest.mark.parametrize("precision", list(TABLE))
def test_distributed_optimizer_at_one_rank_steps_like_the_plain_one(precision):
    dtype, fp32_grads, _ = TABLE[precision]
    runs = []
    for distributed in (False, True):
        ddp = _ddp(dtype, fp32_grads, distributed, bucket_size=300)  # several buckets
        optimizer = _optimizer(ddp, dtype)
        results = _steps(ddp, optimizer, 3)
        runs.append((results, [p.detach().float().clone() for p in ddp.parameters()]))
    (plain_results, plain_params), (results, params) = runs
    assert [r[0] for r in results] == [r[0] for r in plain_results] == [True] * 3
    assert [r[1] for r in results] == pytest.approx([r[1] for r in plain_results], rel=1e-6)
    assert all(r[1] > 0.05 for r in results)  # clipping is active
    for got, expected in zip(params, plain_params):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0.0)


def test_scheduler_drives_the_distributed_optimizers_groups():
    ddp = _ddp(torch.float32, True, True)
    optimizer = _optimizer(ddp, torch.float32)
    assert sorted(g["wd_mult"] for g in optimizer.param_groups) == [0.0, 1.0]
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=0.01, min_lr=0.001, lr_warmup_steps=10,
                                        lr_decay_steps=100, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=100, wd_incr_style="constant")
    scheduler.step(5)
    assert {g["wd_mult"]: (g["lr"], g["weight_decay"]) for g in optimizer.param_groups} == {
        1.0: (pytest.approx(0.005), 0.1), 0.0: (pytest.approx(0.005), 0.0)}


def test_parameter_state_round_trip_and_refusal(tmp_path):
    ddp = _ddp(torch.bfloat16, True, True, bucket_size=300)
    optimizer = _optimizer(ddp, torch.bfloat16)
    _steps(ddp, optimizer, 2)
    path = str(tmp_path / "distrib_optim.pt")
    optimizer.save_parameter_state(path)
    assert os.listdir(tmp_path) == ["distrib_optim.pt"]  # no temporary file left behind
    saved = torch.load(path, weights_only=True)
    key = (torch.bfloat16, torch.float32)
    numel = sum(p.numel() for p in ddp.parameters())
    assert saved["buckets_coalesced"] and saved[0][key]["numel_unpadded"] == numel
    assert sum(saved["per_bucket_numel_unpadded"][0][key]) == numel
    main = torch.cat([shard.main for shard in sorted(optimizer.shards(), key=lambda s: s.start)])
    assert torch.equal(saved[0][key]["param"], main)  # one rank owns everything, in buffer order

    fresh_ddp = _ddp(torch.bfloat16, True, True)  # one bucket: the file does not depend on buckets
    fresh = _optimizer(fresh_ddp, torch.bfloat16)
    fresh.load_state_dict(optimizer.state_dict())
    fresh.load_parameter_state(path)
    again = fresh.get_parameter_state_dp_zero()
    for name in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(again[0][key][name], saved[0][key][name])
    assert all(float(fresh.optimizer.state[s.main]["step"]) == 2.0 for s in fresh.shards())

    plain_ddp = _ddp(torch.bfloat16, True, False)
    plain = _optimizer(plain_ddp, torch.bfloat16)
    _steps(plain_ddp, plain, 1)
    with pytest.raises(ValueError, match="without --use-distributed-optimizer"):
        fresh.load_state_dict(plain.state_dict())

    wider = DistributedDataParallel(_Config(), DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), nn.Linear(16, 40).to(torch.bfloat16))
    with pytest.raises(ValueError, match=rf"holds {numel} parameter elements .*this model 680"):
        _optimizer(wider, torch.bfloat16).load_parameter_state(path)


def test_distributed_optimizer_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="overlap_param_gather needs use_distributed_optimizer"):
        _ddp(torch.float32, True, False, overlap_param_gather=True)
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        get_megatron_optimizer(OptimizerConfig(lr=0.01), [_ddp(torch.float32, True, False)],
                               use_distributed_optimizer=True)
