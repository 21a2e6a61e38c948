"""LoRA in each parallel layout against the serial run of the same model and micro-batches: same
losses, same adapter gradients (the base gets none), and after one optimizer step with the
distributed optimizer the same adapters; a GPT (LayerNorm, biases, GeLU, tied embeddings) and a
Llama (RMSNorm, SwiGLU: fc1 is [gate ; up] split with stride 2, grouped-query attention, RoPE).

    layout           what it exercises
    tp2              column base: B split by rows, A replicated (dh all-reduced in backward);
                     row base: A split by columns, B replicated
    tp2-sp           the same under sequence parallelism (the row adapter's B sums over TP in
                     finalize_model_grads)
    pp2              2 pipeline stages, one layer each (1F1B)
    tp2-pp2          both
    tp2-dp2-dist     DDP + distributed optimizer, each replica half the micro-batches, one SGD step
                     clipped below the gradient norm (so the step depends on the norm)
    pp2-dp2-dist     the same without TP

Each adapter's B is set to nonzero values first (tests/helpers/lora.py): with B = 0, A's
gradient would be zero and prove nothing.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, optimizer_memory_per_parameter
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import gather_tensor_parallel
from megatron.model.lora import is_lora_parameter
from tests.helpers import lora as tiny
from tests.parallel.harness import init_parallel

MICROBATCHES = 4
LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "tp2-pp2": dict(tp=2, pp=2),
    "tp2-dp2-dist": dict(tp=2, step=True),
    "pp2-dp2-dist": dict(pp=2, step=True),
}
# SGD with clipping below the norm: the step depends on the gradient norm over the adapters; its
# momentum buffer (4 bytes per parameter) is the optimizer state the distributed optimizer shards.
OPTIMIZER = OptimizerConfig(optimizer="sgd", lr=0.5, clip_grad=0.01, sgd_momentum=0.9)


def _run(model, serial: bool, share: slice = slice(None)) -> list:
    batches = tiny.microbatches(MICROBATCHES)[share]
    func = schedules.forward_backward_no_pipelining if serial else schedules.get_forward_backward_func()
    reported = func(forward_step_func=tiny.forward_step, data_iterator=iter(batches), model=[model],
                    num_microbatches=len(batches), seq_length=tiny.SEQ, micro_batch_size=tiny.MBS,
                    finalize_model_grads_func=None if serial else finalize_model_grads)
    return [entry["lm loss"].item() for entry in reported]


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def _serial(kind: str) -> dict:
    init_parallel(tp=1)
    model = tiny.build(kind)
    losses = _run(model, serial=True)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    _, grad_norm, _ = get_megatron_optimizer(OPTIMIZER, [model]).step()
    weights = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "grads": grads, "weights": weights, "grad_norm": grad_norm}


def _layout(kind: str, layout: dict, serial: dict) -> dict:
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    init_parallel(tp=tp, pp=pp)
    model = tiny.build(kind, tp=tp, pp=pp, sp=layout.get("sp", False))
    offset = tiny.layer_offset(model)
    result = {"frozen_with_grad": [], "grad_errors": {}, "weight_errors": {}}
    if layout.get("step"):
        d, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        half = MICROBATCHES // d
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                      model)
        ddp.zero_grad_buffer()
        optimizer = get_megatron_optimizer(OPTIMIZER, [ddp])
        result["losses"] = _run(ddp, serial=False, share=slice(r * half, (r + 1) * half))
        result["serial_losses"] = serial["losses"][r * half:(r + 1) * half]
        _, result["grad_norm"], _ = optimizer.step()
        state = optimizer_memory_per_parameter([ddp], optimizer)["bytes"]["optimizer_state"]
        buffer = sum(b.numel for b in ddp.buffers)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        result["state"] = (state, buffer, trainable, d)
    else:
        result["losses"] = _run(model, serial=False)
        result["serial_losses"] = serial["losses"]
    for name, param in model.named_parameters():
        key = tiny.global_name(name, offset)
        if not is_lora_parameter(name):
            if param.grad is not None or hasattr(param, "main_grad"):
                result["frozen_with_grad"].append(key)
            continue
        if layout.get("step"):
            weight = gather_tensor_parallel(param, param.detach())
            result["weight_errors"][key] = _relative_error(weight, serial["weights"][key])
        else:
            grad = gather_tensor_parallel(param, param.grad)
            result["grad_errors"][key] = _relative_error(grad, serial["grads"][key])
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, sorted(set(result["grad_errors"]) | set(result["weight_errors"])))
    result["missing"] = sorted(set(serial["grads"]) - set().union(*everything))
    parallel_state.destroy_model_parallel()
    return result


def _compare(kind: str) -> dict:
    serial = _serial(kind)
    results = {name: _layout(kind, layout, serial) for name, layout in LAYOUTS.items()}
    return {"serial_grad_norm": serial["grad_norm"], "count": sum(g.numel() for g in serial["grads"].values()),
            "layouts": results}


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_lora_layouts_equal_the_serial_run(dist_pool, kind):
    results = dist_pool.run(_compare, kind)
    for rank, result in enumerate(results):
        assert result["count"] == tiny.trainable_count(kind)
        for name, layout in result["layouts"].items():
            where = (kind, name, rank)
            assert not layout["missing"], (where, layout["missing"])  # every adapter lives on some rank
            assert not layout["frozen_with_grad"], (where, layout["frozen_with_grad"])
            assert layout["grad_errors"] or layout["weight_errors"], where
            bad = {k: e for k, e in {**layout["grad_errors"], **layout["weight_errors"]}.items() if e > 1e-5}
            assert not bad, (where, bad)
            if layout["losses"]:  # the last pipeline stage reports them
                assert layout["losses"] == pytest.approx(layout["serial_losses"], rel=1e-5), where
            if "grad_norm" in layout:
                assert result["serial_grad_norm"] > OPTIMIZER.clip_grad, where  # the step is clipped
                assert layout["grad_norm"] == pytest.approx(result["serial_grad_norm"], rel=1e-5), where
                state, buffer, trainable, d = layout["state"]
                assert buffer == trainable, where  # DDP's buffer: this rank's adapters alone (no padding here)
                assert state == 4 * trainable // d, where  # the momentum of this replica's shard only


# ------------------------------------------------------------------ pretrain_gpt end to end on 4 ranks

E2E = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
       "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
       "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--seq-length", "16",
       "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "0.5",
       "--optimizer", "sgd",  # (Adam's first steps are +-lr wherever a gradient is tiny: rounding shows)
       "--lr-decay-style", "constant", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
       "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--mock-data", "--tokenizer-type",
       "NullTokenizer", "--vocab-size", "255", "--lora-rank", "4", "--lora-alpha", "8"]
TP2 = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]


def _last_rank(per_rank: list) -> dict:
    return per_rank[-1]


def test_lora_checkpoints_across_layouts(dist_pool, tmp_path):
    """A LoRA run at TP 2 x DP 2 (distributed optimizer, torch format) and at DP 4 (torch_dist) from the same
    base log the same losses and save the same adapters (the TP 2 files merged by the converter's layout
    rules); the DP 4 run's torch_dist checkpoint resumes at TP 2 x DP 2 with the uninterrupted losses."""
    from tests.helpers.checkpoints import pretrain
    from tools.checkpoint.lora_common import read_adapters

    base, tp2, dp4 = tmp_path / "base", tmp_path / "tp2", tmp_path / "dp4"
    no_lora = E2E[:-4]  # the base: no --lora-rank 4 --lora-alpha 8
    dist_pool.run(pretrain, [*no_lora, "--train-iters", "1", "--save", str(base), "--save-interval", "1",
                             "--ckpt-format", "torch_dist"])
    at_tp2 = _last_rank(dist_pool.run(pretrain, [*E2E, *TP2, "--train-iters", "2", "--load", str(base), "--save",
                                                 str(tp2), "--save-interval", "2", "--ckpt-format", "torch",
                                                 "--auto-detect-ckpt-format"]))
    at_dp4 = _last_rank(dist_pool.run(pretrain, [*E2E, "--train-iters", "4", "--pretrained-checkpoint", str(base),
                                                 "--load", str(dp4), "--save", str(dp4), "--save-interval", "2",
                                                 "--ckpt-format", "torch_dist"]))
    assert sorted(at_tp2) == [1, 2] and sorted(at_dp4) == [1, 2, 3, 4]
    for iteration in (1, 2):
        assert at_tp2[iteration] == pytest.approx(at_dp4[iteration], rel=1e-5)
    (dp4 / "latest_checkpointed_iteration.txt").write_text("2")
    whole_tp2, whole_dp4 = read_adapters(str(tp2)), read_adapters(str(dp4))
    assert sorted(whole_tp2.tensors) == sorted(whole_dp4.tensors) and len(whole_tp2.tensors) == 16
    for name, tensor in whole_dp4.tensors.items():
        assert _relative_error(whole_tp2.tensors[name], tensor) <= 1e-5, name
    resumed = _last_rank(dist_pool.run(pretrain, [*E2E, *TP2, "--train-iters", "4", "--load", str(dp4),
                                                  "--ckpt-format", "torch_dist"]))
    assert sorted(resumed) == [3, 4]
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(at_dp4[iteration], rel=1e-5)
