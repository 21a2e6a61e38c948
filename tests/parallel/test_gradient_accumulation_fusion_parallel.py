"""Gradient-accumulation fusion across ranks: with overlapped data-parallel reduction (DP=4, with
and without the distributed optimizer) the fused model takes the same steps as the unfused one
and still launches bucket reductions during backward; at TP=2 with sequence parallelism its
main_grads equal the serial model's gradients.
"""

import pytest
import torch

from megatron.core import communication, parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import schedules
from megatron.model import GPTModel, TransformerConfig
from tests.helpers import dp_gpt, tp_gpt
from tests.parallel.harness import init_parallel


def _dp_model(fusion: bool) -> GPTModel:
    torch.manual_seed(dp_gpt.SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(dp_gpt.SEED)
    config = TransformerConfig(num_layers=dp_gpt.LAYERS, hidden_size=dp_gpt.HIDDEN, num_attention_heads=4,
                               hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=fusion)
    return GPTModel(config, vocab_size=dp_gpt.VOCAB, max_sequence_length=dp_gpt.SEQ)


def _overlapped_steps(fusion: bool, distributed: bool):
    """STEPS data-parallel steps with overlapped reduction; the logged losses and final weights."""
    init_parallel(tp=1)
    d, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = dp_gpt.GLOBAL // d
    model = _dp_model(fusion)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=2000,
                                               use_distributed_optimizer=distributed)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    ddp.broadcast_params()
    losses = dp_gpt.train(ddp, dp_gpt.make_optimizer(ddp, False), slice(r * per_rank, (r + 1) * per_rank))
    ddp.finish_param_sync()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _fused_against_unfused(distributed: bool):
    fused_losses, fused = _overlapped_steps(True, distributed)
    parallel_state.destroy_model_parallel()
    losses, weights = _overlapped_steps(False, distributed)
    errors = {name: tp_gpt.relative_error(fused[name], weights[name]) for name in weights}
    return {"fused_losses": fused_losses, "losses": losses, "errors": errors}


@pytest.mark.parametrize("distributed", [False, True], ids=["ddp", "distributed-optimizer"])
def test_overlapped_data_parallel_steps_equal_unfused(dist_pool, distributed):
    for rank, result in enumerate(dist_pool.run(_fused_against_unfused, distributed)):
        assert result["fused_losses"] == pytest.approx(result["losses"], rel=1e-6), rank
        bad = {name: error for name, error in result["errors"].items() if error > 1e-6}
        assert not bad, (rank, bad)


def _reductions_before_first_layer_gradient():
    """As test_data_parallel's, with fusion: launches seen when layer 0's qkv weight is reported."""
    init_parallel(tp=1)
    model = _dp_model(True)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                            bucket_size=3000), model)
    seen, flags = [], []
    first_layer = model.decoder.layers[0].self_attention.linear_qkv.weight
    first_layer.register_hook(lambda grad: flags.append(first_layer.grad_added_to_main_grad))
    with communication.count_communication() as counter:
        first_layer.register_post_accumulate_grad_hook(
            lambda _: seen.append(sum(e.op == "all_reduce" and e.group.startswith("dp") for e in counter.events)))
        ddp.zero_grad_buffer()
        schedules.forward_backward_no_pipelining(
            forward_step_func=dp_gpt.forward_step, data_iterator=iter(dp_gpt.microbatches(0)[:2]), model=[ddp],
            num_microbatches=2, finalize_model_grads_func=finalize_model_grads)
        total = sum(e.op == "all_reduce" and e.group.startswith("dp") for e in counter.events)
    return {"seen": seen, "total": total, "buckets": len(ddp.buffers[0].buckets), "flags": flags}


def test_fused_overlap_still_launches_buckets_during_backward(dist_pool):
    result = dist_pool.run(_reductions_before_first_layer_gradient)[0]
    assert result["flags"] == [True, True]  # the weight gradient went straight into main_grad
    assert result["buckets"] >= 3 and result["total"] == result["buckets"]
    assert result["seen"][0] == 0 and 0 < result["seen"][1] < result["total"]


def _tp_sp_against_serial():
    init_parallel(tp=1)
    serial_loss, serial_grads, _ = tp_gpt.loss_and_grads(tp_gpt.build(1, False, untied=True))
    parallel_state.destroy_model_parallel()

    init_parallel(tp=2)  # and DP = 2: both replicas see the same batch, so the mean changes nothing
    torch.manual_seed(tp_gpt.SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(tp_gpt.SEED)
    config = TransformerConfig(num_layers=2, hidden_size=tp_gpt.HIDDEN, num_attention_heads=4,
                               tensor_model_parallel_size=2, sequence_parallel=True, hidden_dropout=0.0,
                               attention_dropout=0.0, gradient_accumulation_fusion=True)
    model = GPTModel(config, vocab_size=tp_gpt.padded(2), num_tokens=tp_gpt.VOCAB,
                     max_sequence_length=tp_gpt.SEQ, share_embeddings_and_output_weights=False)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    tokens, labels, loss_mask, position_ids = tp_gpt.batch()
    losses = ddp(tokens, position_ids, None, labels=labels)  # [b, s]
    loss = (losses * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    finalize_model_grads([ddp])
    errors, leftover = {}, []
    for name, param in model.named_parameters():
        grad, serial = tp_gpt.gather(param, param.main_grad), serial_grads[name]
        if name in tp_gpt.VOCAB_PARAMS:
            grad, serial = grad[:tp_gpt.VOCAB], serial[:tp_gpt.VOCAB]
        errors[name] = tp_gpt.relative_error(grad, serial)
        if param.grad is not None:
            leftover.append(name)
    return {"serial_loss": serial_loss, "loss": loss.item(), "errors": errors, "leftover": leftover}


def test_tp2_sequence_parallel_fused_main_grads_equal_the_serial_model(dist_pool):
    for rank, result in enumerate(dist_pool.run(_tp_sp_against_serial)):
        assert result["loss"] == pytest.approx(result["serial_loss"], rel=1e-5), rank
        bad = {name: error for name, error in result["errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
        assert result["leftover"] == [], rank
