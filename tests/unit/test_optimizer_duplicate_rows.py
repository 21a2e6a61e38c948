"""Tensor-parallel duplicate rows (replicated K/V) in the optimizers' grad norm: the mixed-precision
main params inherit the mark; duplicate_range_in_shard says which elements of a distributed-optimizer
shard they are, in the shard's own coordinates (the multi-rank check: tests/parallel/test_llama_parallel.py)."""

import torch

from megatron.core.optimizer import Float16OptimizerWithFloat16Params, OptimizerConfig
from megatron.core.optimizer.distrib_optimizer import duplicate_range_in_shard


def test_float16_main_params_leave_the_duplicate_rows_out_of_the_norm():
    param = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.bfloat16))
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
    param.tensor_parallel_duplicate_rows = (1, 3)
    optimizer = Float16OptimizerWithFloat16Params(torch.optim.SGD([param], lr=0.1),
                                                  OptimizerConfig(bf16=True, log_num_zeros_in_grad=True), None)
    param.grad = torch.tensor([[1.0, 0.0], [5.0, 5.0], [5.0, 5.0], [2.0, 2.0]], dtype=torch.bfloat16)
    optimizer.prepare_grads()
    (grad,) = optimizer.get_main_grads_for_grad_norm()
    assert grad.tolist() == [[1.0, 0.0], [2.0, 2.0]]
    assert optimizer.count_zeros() == 1
    assert optimizer.clip_grad_norm(100.0) == 3.0  # sqrt(1 + 4 + 4)


def test_shard_holding_the_whole_param():
    # rows [2, 4) of a [4, 3] param at buffer offset 10: elements [16, 22)
    assert duplicate_range_in_shard((2, 4), 3, 10, 10, 22) == (6, 12)
    assert duplicate_range_in_shard((2, 4), 3, 10, 0, 40) == (16, 22)


def test_shard_boundaries_cutting_the_rows():
    assert duplicate_range_in_shard((2, 4), 3, 10, 18, 30) == (0, 4)  # starts inside them
    assert duplicate_range_in_shard((2, 4), 3, 10, 5, 17) == (11, 12)  # ends inside them
    assert duplicate_range_in_shard((2, 4), 3, 10, 17, 19) == (0, 2)  # inside them


def test_shard_missing_the_rows():
    assert duplicate_range_in_shard((2, 4), 3, 10, 10, 16) is None
    assert duplicate_range_in_shard((2, 4), 3, 10, 22, 30) is None
