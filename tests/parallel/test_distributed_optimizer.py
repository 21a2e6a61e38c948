"""The distributed optimizer: DP=2 / DP=4 (and TP=2 x DP=2) with sharded optimizer state take
the same steps as one data-parallel rank with the plain optimizer; Megatron's memory table comes
out exactly; distrib_optim.pt saved at DP=4 resumes at DP=2 and DP=1.

Every rank first trains the reference (DistributedDataParallel over a one-rank group, the plain
optimizer) on the whole global batch of GLOBAL micro-batches, then the sharded model on its
share of GLOBAL / d consecutive micro-batches. Data-parallel sizes other than the pool's
world / tp come from explicit groups ({0,1}, {2,3} for 2; one per rank for 1) handed to
DistributedDataParallel, which the optimizer follows.

Adam runs with eps 1e-4: with the default 1e-8 a gradient that is zero up to rounding (the
attention key bias's: softmax ignores a shift shared by all keys) becomes a +-lr step whose
sign is rounding noise, so summation order alone would decide those parameters.
"""

import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import (
    DistributedOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
    optimizer_memory_per_parameter,
)
from megatron.core.pipeline_parallel import schedules
from megatron.model import Float16Module, GPTModel, TransformerConfig
from tests.helpers import dp_gpt
from tests.helpers.groups import WORLD, destroy_groups, dp_group
from tests.parallel.harness import init_parallel

VOCAB, SEQ, MBS, HIDDEN, SEED, GLOBAL = 256, 8, 2, 32, 1234, 4
# 2 layers: 33,920 parameters, a multiple of 4, so one bucket needs no padding at d = 1, 2, 4
LAYERS = 2
HALF = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model(precision: str = "fp32", layers: int = LAYERS):
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    dtype = HALF[precision] or torch.float32
    config = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, bf16=precision == "bf16", fp16=precision == "fp16",
                               params_dtype=dtype,
                               tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                               pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size())
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    return Float16Module(config, model) if HALF[precision] else model


def _wrap(model, group, distributed: bool, overlap: bool = False, bucket_size=None, fp32_grads: bool = True,
          overlap_param_gather: bool = False):
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=fp32_grads, overlap_grad_reduce=overlap,
                                           use_distributed_optimizer=distributed, bucket_size=bucket_size,
                                           overlap_param_gather=overlap_param_gather)
    return DistributedDataParallel(model.config, config, model, data_parallel_group=group)


def _optimizer(ddp, precision: str = "fp32", clip_grad: float = 0.1, **kwargs):
    config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, adam_eps=1e-4, clip_grad=clip_grad,
                             bf16=precision == "bf16", fp16=precision == "fp16",
                             params_dtype=HALF[precision] or torch.float32, **kwargs)
    return get_megatron_optimizer(config, [ddp])


def _microbatches(step: int):
    return dp_gpt.microbatches(step, GLOBAL)


def _backward(ddp, optimizer, step: int):
    """Forward/backward of this data-parallel rank's share of global batch `step`; its mean loss."""
    group = ddp.data_parallel_group
    d, r = dist.get_world_size(group), dist.get_rank(group)
    batches = _microbatches(step)[r * GLOBAL // d:(r + 1) * GLOBAL // d]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = schedules.get_forward_backward_func()(
        forward_step_func=dp_gpt.forward_step, data_iterator=iter(batches), model=[ddp],
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS, grad_scale_func=optimizer.scale_loss,
        finalize_model_grads_func=finalize_model_grads)
    local = torch.tensor([sum(x["lm loss"].item() for x in losses), len(losses)], dtype=torch.float64)
    dist.all_reduce(local, group=group)
    return (local[0] / local[1]).item() if local[1] else None  # None: not the last pipeline stage


def _train(ddp, optimizer, steps, first: int = 0):
    """Steps first..first+steps-1; (losses, grad norms)."""
    losses, norms = [], []
    for step in range(first, first + steps):
        losses.append(_backward(ddp, optimizer, step))
        ok, norm, _ = optimizer.step()
        assert ok
        norms.append(norm)
    return losses, norms


def _params(ddp):
    ddp.finish_param_sync()  # with overlap_param_gather the last step's gathers may still be in flight
    return {name: p.detach().float().clone() for name, p in ddp.module.named_parameters()}


def _errors(got, expected):
    return {name: ((got[name] - value).abs().max() / value.abs().max()).item() for name, value in expected.items()}


# ------------------------------------------------------------------ (a) same steps as one rank

def _compare(d: int, tp: int = 1, pp: int = 1, precision: str = "fp32", overlap: bool = False, bucket_size=None,
             overlap_param_gather: bool = False):
    init_parallel(tp=tp, pp=pp)
    created = []
    reference = _wrap(_model(precision), dp_group(1, created), distributed=False)
    reference_losses, reference_norms = _train(reference, _optimizer(reference, precision), 3)

    ddp = _wrap(_model(precision), dp_group(d, created), distributed=True, overlap=overlap, bucket_size=bucket_size,
                overlap_param_gather=overlap_param_gather)
    optimizer = _optimizer(ddp, precision)
    assert isinstance(optimizer, DistributedOptimizer)
    losses, norms = _train(ddp, optimizer, 3)
    result = {"losses": losses, "reference_losses": reference_losses, "norms": norms,
              "reference_norms": reference_norms, "errors": _errors(_params(ddp), _params(reference)),
              "buckets": sum(len(b.buckets) for b in ddp.buffers), "d": dist.get_world_size(ddp.data_parallel_group),
              "group_keys": [sorted(k for k in g if k != "params") for g in optimizer.param_groups]}
    destroy_groups(created)
    return result


CASES = {
    "dp2": dict(d=2),
    "dp4": dict(d=4),
    "dp2-overlap": dict(d=2, overlap=True, bucket_size=6000),
    "dp4-overlap": dict(d=4, overlap=True, bucket_size=6000),
    "dp4-overlap-param-gather": dict(d=4, overlap=True, bucket_size=6000, overlap_param_gather=True),
    "pp2-dp2-overlap-param-gather": dict(d=2, pp=2, overlap=True, bucket_size=6000, overlap_param_gather=True),
    "tp2-dp2": dict(d=2, tp=2),
    # the last stage's copy of the tied embedding is `shared`: left out of the norm, stepped alike
    "pp2-dp2": dict(d=2, pp=2),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_sharded_steps_equal_one_rank(dist_pool, case):
    for rank, result in enumerate(dist_pool.run(_compare, **CASES[case])):
        assert result["d"] == CASES[case]["d"]
        if CASES[case].get("overlap"):
            assert result["buckets"] > 1  # several padded buckets, reduce-scattered as they fill
        if result["losses"][0] is None:  # a first pipeline stage
            assert result["reference_losses"] == [None] * 3
        else:
            assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5), rank
        # the norm is summed over shards of all data-parallel (and TP) ranks: clipping (0.1) is active
        assert result["norms"] == pytest.approx(result["reference_norms"], rel=1e-5), rank
        assert min(result["norms"]) > 0.1
        bad = {name: error for name, error in result["errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
        assert all({"wd_mult", "lr_mult", "lr", "weight_decay"} <= set(keys) for keys in result["group_keys"])


def test_bf16_sharded_steps_match_one_rank_within_bf16_tolerance(dist_pool):
    for rank, result in enumerate(dist_pool.run(_compare, 4, precision="bf16", overlap=True, bucket_size=6000)):
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=2e-2), rank
        bad = {name: error for name, error in result["errors"].items() if error > 2e-2}
        assert not bad, (rank, bad)


def _overflow_on_one_rank():
    """fp16, DP=4: an inf in data-parallel rank 1's grad shard only must skip the step on every rank."""
    init_parallel(tp=1)
    ddp = _wrap(_model("fp16"), parallel_state.get_data_parallel_group(), distributed=True, fp32_grads=False)
    optimizer = _optimizer(ddp, "fp16", initial_loss_scale=1024.0, hysteresis=1)
    _backward(ddp, optimizer, 0)
    if dist.get_rank() == 1:
        start = optimizer.shards()[0].start
        ddp.buffers[0].grad_data[start] = float("inf")  # inside rank 1's own slice
    before = _params(ddp)
    result = optimizer.step()
    unchanged = all(torch.equal(p, before[n]) for n, p in _params(ddp).items())
    return {"result": result, "unchanged": unchanged, "scale": float(optimizer.get_loss_scale())}


def test_overflow_in_one_shard_skips_the_step_everywhere(dist_pool):
    for rank, result in enumerate(dist_pool.run(_overflow_on_one_rank)):
        assert result["result"] == (False, None, None), rank
        assert result["unchanged"] and result["scale"] == 512.0, rank


# ------------------------------------------------------------------ (b) Megatron's memory table

PRECISIONS = {"fp16/fp16": ("fp16", False), "bf16/fp32": ("bf16", True), "fp32/fp32": ("fp32", True)}


def _memory_table():
    init_parallel(tp=1)
    table = {}
    for d in (1, 2, 4):
        created = []
        group = dp_group(d, created)
        for name, (precision, fp32_grads) in PRECISIONS.items():
            for distributed in (False, True):
                ddp = _wrap(_model(precision), group, distributed=distributed, fp32_grads=fp32_grads)
                optimizer = _optimizer(ddp, precision, loss_scale=1024.0 if precision == "fp16" else None)
                _backward(ddp, optimizer, 0)
                assert optimizer.step()[0]  # the inner state exists after a step
                memory = optimizer_memory_per_parameter([ddp], optimizer)
                table[(name, d, distributed)] = {k: v for k, v in memory.items() if k != "bytes"}
        destroy_groups(created)
    return table


def test_memory_per_parameter_is_megatrons_table(dist_pool):
    expected = {"fp16/fp16": (20, lambda d: 4 + 16 / d), "bf16/fp32": (18, lambda d: 6 + 12 / d),
                "fp32/fp32": (16, lambda d: 8 + 8 / d)}
    table = dist_pool.run(_memory_table)[3]  # any rank: every rank holds 1/d
    for (name, d, distributed), memory in table.items():
        plain, sharded = expected[name]
        assert memory["num_parameters"] == 33_920
        assert memory["total"] == (sharded(d) if distributed else plain), (name, d, distributed, memory)
    # where the bytes are: fp16 keeps a separate fp32 main grad (the 4 in Megatron's 20)
    assert table[("fp16/fp16", 4, True)]["main_grads"] == 1.0
    assert table[("bf16/fp32", 4, True)]["main_grads"] == 0.0  # a view of the fp32 grad buffer
    assert table[("fp32/fp32", 4, True)]["main_params"] == 0.0  # a view of the param buffer


# ------------------------------------------------------------------ (c) distrib_optim.pt across DP sizes

def _resume(directory: str):
    """Save at DP=4 after 2 steps; resume at DP=2 and DP=1; compare step 3 with the uninterrupted run."""
    init_parallel(tp=1)
    path = os.path.join(directory, "distrib_optim.pt")
    ddp = _wrap(_model(), parallel_state.get_data_parallel_group(), distributed=True, bucket_size=6000)
    optimizer = _optimizer(ddp)
    _train(ddp, optimizer, 2)
    optimizer.save_parameter_state(path)
    optimizer_state = optimizer.state_dict()
    model_state = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    dist.barrier()  # the file is complete before anyone reads it
    saved = torch.load(path, weights_only=True)
    _train(ddp, optimizer, 1, first=2)
    uninterrupted = _params(ddp)

    result = {"errors": {}, "round_trip": {}}
    key = (torch.float32, torch.float32)
    if dist.get_rank() == 0:
        result["file"] = {"top": sorted(str(k) for k in saved), "dtypes": list(saved[0]),
                          "keys": sorted(saved[0][key]), "numel": saved[0][key]["numel_unpadded"],
                          "step": [g["step"] for g in optimizer_state["optimizer"]["param_groups"]]}
    for d in (2, 1):
        created = []
        ddp = _wrap(_model(), dp_group(d, created), distributed=True, bucket_size=6000 if d == 2 else None)
        optimizer = _optimizer(ddp)
        ddp.module.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        optimizer.load_parameter_state(path)
        again = optimizer.get_parameter_state_dp_zero()  # gathered back: the file's content, bit for bit
        if again is not None:  # data-parallel rank 0
            result["round_trip"][d] = all(torch.equal(again[0][key][k], saved[0][key][k])
                                          for key in saved[0] for k in ("param", "exp_avg", "exp_avg_sq"))
        _train(ddp, optimizer, 1, first=2)
        result["errors"][d] = _errors(_params(ddp), uninterrupted)
        destroy_groups(created)
    result["refusals"] = _refusals(path)
    return result


def _refusals(path: str):
    """Messages of loads into models the file does not fit (DP=4)."""
    messages = []
    for precision, layers in (("fp32", 1), ("bf16", LAYERS)):
        ddp = _wrap(_model(precision, layers), parallel_state.get_data_parallel_group(), distributed=True)
        try:
            _optimizer(ddp, precision).load_parameter_state(path)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_parameter_state_saved_at_dp4_resumes_at_dp2_and_dp1(dist_pool, tmp_path):
    results = dist_pool.run(_resume, str(tmp_path))
    file = results[0]["file"]
    assert file["top"] == ["0", "buckets_coalesced", "per_bucket_numel", "per_bucket_numel_unpadded"]
    assert file["dtypes"] == [(torch.float32, torch.float32)]
    assert file["keys"] == ["exp_avg", "exp_avg_sq", "numel_unpadded", "param"]
    assert file["numel"] == 33_920 and file["step"] == [2.0, 2.0]
    # gathered again by each data-parallel rank 0 (of {0, 1} and {2, 3} at DP=2; every rank at DP=1)
    assert [r["round_trip"] for r in results] == [{2: True, 1: True}, {1: True}, {2: True, 1: True}, {1: True}]
    for rank, result in enumerate(results):
        for d, errors in result["errors"].items():
            bad = {name: error for name, error in errors.items() if error > 1e-5}
            assert not bad, (rank, d, bad)
        fewer_layers, bf16 = result["refusals"]
        assert "holds 33920 parameter elements" in fewer_layers and "this model 21216" in fewer_layers, fewer_layers
        assert "(float32, float32)" in bf16 and "(bfloat16, float32)" in bf16, bf16
        assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []  # written atomically


# ------------------------------------------------------------------ --overlap-param-gather

def _param_gathers_wait_for_the_forward():
    """After step() the all-gathers are in flight; each module's forward waits for its own buckets."""
    init_parallel(tp=1)
    created = []
    ddp = _wrap(_model("fp32"), dp_group(4, created), distributed=True, overlap=True, bucket_size=6000,
                overlap_param_gather=True)
    optimizer = _optimizer(ddp)
    _backward(ddp, optimizer, 0)
    optimizer.step()
    buckets = [b for buffer in ddp.buffers for b in buffer.buckets]
    pending_after_step = sum(b.param_gather is not None for b in buckets)
    first_layer = ddp.module.decoder.layers[0]
    seen = {}
    def record(module, args):  # registered after DDP's hooks on this module: runs after them
        seen.setdefault("pending", sum(b.param_gather is not None for b in buckets))

    first_layer.register_forward_pre_hook(record)
    _backward(ddp, optimizer, 1)
    result = {"buckets": len(buckets), "pending_after_step": pending_after_step,
              "pending_at_layer_0": seen["pending"], "pending_after_forward": sum(b.param_gather is not None
                                                                                for b in buckets)}
    destroy_groups(created)
    return result


def test_overlap_param_gather_leaves_gathers_to_the_next_forward(dist_pool):
    for result in dist_pool.run(_param_gathers_wait_for_the_forward):
        assert result["buckets"] > 2
        assert result["pending_after_step"] == result["buckets"]  # nothing waited inside step()
        # by layer 0 the embedding's bucket (and layer 0's own) had been waited for, later layers' not yet
        assert 0 < result["pending_at_layer_0"] < result["buckets"]
        assert result["pending_after_forward"] == 0


def _threads() -> int:
    import gc

    gc.collect()
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def _train_and_drop_a_wrapper() -> bool:
    """Train a step in a data-parallel group of our own, drop everything: is the wrapper gone?"""
    import gc
    import weakref

    init_parallel()
    created = []
    ddp = _wrap(_model(), dp_group(2, created), distributed=True, overlap=True)
    optimizer = _optimizer(ddp)
    _train(ddp, optimizer, 1)
    wrapper = weakref.ref(ddp)
    del ddp, optimizer
    destroy_groups(created)
    gc.collect()
    return wrapper() is None


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_dropped_wrapper_frees_its_buffers_and_its_groups_threads(dist_pool):
    # a parameter's gradient hook holding the wrapper kept every DDP ever built alive (the hooks are
    # beyond the garbage collector), and with it its group's gloo threads: 150 per worker by the
    # end of a test session
    before = dist_pool.run(_threads)
    assert dist_pool.run(_train_and_drop_a_wrapper) == [True] * WORLD
    assert dist_pool.run(_train_and_drop_a_wrapper) == [True] * WORLD
    assert dist_pool.run(_threads) == before
