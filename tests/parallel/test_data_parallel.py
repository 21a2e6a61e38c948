"""Data parallelism through DistributedDataParallel: DP=2 and DP=4 (with and without overlapped
gradient reduction) take the same 3 optimizer steps as one rank on the same global batch.

Every rank first trains the reference (no data parallelism) on the whole global batch of
GLOBAL micro-batches, then the data-parallel model on its share (GLOBAL / d consecutive
micro-batches, as Megatron's sampler deals them). The model is a 4-layer GPT; losses are
per-micro-batch means, so the global loss is the mean over all micro-batches whatever d is.

The optimizer is SGD with momentum: Adam divides each gradient by its own magnitude, so a
gradient that is zero up to rounding (the attention key bias's: softmax ignores a shift shared
by all keys) becomes a full +-lr step whose sign is the rounding noise's, and fp32 summation
order alone would then decide the parameters.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import communication, parallel_state, tensor_parallel  # noqa: F401
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import schedules
from megatron.model import Float16Module, GPTModel, TransformerConfig
from tests.helpers import dp_gpt
from tests.helpers.dp_gpt import GLOBAL, HIDDEN, LAYERS, SEED, SEQ, VOCAB
from tests.parallel.harness import init_parallel


def _model(bf16: bool = False):
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, bf16=bf16,
                               tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                               params_dtype=torch.bfloat16 if bf16 else torch.float32)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ)
    return Float16Module(config, model) if bf16 else model


def _compare(tp: int, ddp_config: DistributedDataParallelConfig, bf16: bool = False):
    """tp = 1: DP = 4; tp = 2: DP = 2 of a TP=2 model. The reference is the same TP layout, unwrapped."""
    init_parallel(tp=tp)
    reference = _model(bf16)
    reference_losses = dp_gpt.train(reference, dp_gpt.make_optimizer(reference, bf16), slice(None))
    expected = {name: p.detach().float().clone() for name, p in reference.named_parameters()}

    d = parallel_state.get_data_parallel_world_size()
    r = parallel_state.get_data_parallel_rank()
    per_rank = GLOBAL // d
    model = _model(bf16)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    ddp.broadcast_params()
    losses = dp_gpt.train(ddp, dp_gpt.make_optimizer(ddp, bf16), slice(r * per_rank, (r + 1) * per_rank))
    errors = {name: ((p.detach().float() - expected[name]).abs().max() / expected[name].abs().max()).item()
              for name, p in ddp.module.named_parameters()}
    buckets = sum(len(buffer.buckets) for buffer in ddp.buffers)
    return {"d": d, "reference_losses": reference_losses, "losses": losses, "errors": errors, "buckets": buckets}


@pytest.mark.parametrize("tp, overlap, bucket_size", [(1, False, None), (1, True, 2000), (2, False, None),
                                                   (2, True, 5000)],
                         ids=["dp4", "dp4-overlap", "dp2-tp2", "dp2-tp2-overlap"])
def test_data_parallel_steps_equal_one_rank(dist_pool, tp, overlap, bucket_size):
    config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=bucket_size)
    for rank, result in enumerate(dist_pool.run(_compare, tp, config)):
        assert result["d"] == 4 // tp
        if overlap:
            assert result["buckets"] > 1, result["buckets"]  # several buckets, reduced as they fill
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5), rank
        bad = {name: error for name, error in result["errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)


def test_bf16_data_parallel_matches_one_rank_within_bf16_tolerance(dist_pool):
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=5000)
    for rank, result in enumerate(dist_pool.run(_compare, 1, config, bf16=True)):
        assert result["losses"] == pytest.approx(result["reference_losses"], rel=2e-2), rank
        bad = {name: error for name, error in result["errors"].items() if error > 2e-2}
        assert not bad, (rank, bad)


def _reductions_before_first_layer_gradient(overlap: bool):
    """How many bucket reductions had been launched when layer 0's weight gradient arrived."""
    init_parallel(tp=1)
    model = _model()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(overlap_grad_reduce=overlap,
                                                                            bucket_size=3000), model)
    seen = []
    first_layer = model.decoder.layers[0].self_attention.linear_qkv.weight
    with communication.count_communication() as counter:
        # registered after DDP's hook: runs once that hook has accumulated (and maybe launched)
        first_layer.register_post_accumulate_grad_hook(
            lambda _: seen.append(sum(e.op == "all_reduce" and e.group.startswith("dp") for e in counter.events)))
        batches = dp_gpt.microbatches(0)[:2]
        ddp.zero_grad_buffer()
        schedules.forward_backward_no_pipelining(
            forward_step_func=dp_gpt.forward_step, data_iterator=iter(batches), model=[ddp], num_microbatches=2,
            finalize_model_grads_func=finalize_model_grads)
        total = sum(e.op == "all_reduce" and e.group.startswith("dp") for e in counter.events)
    return {"seen": seen, "total": total, "buckets": len(ddp.buffers[0].buckets)}


def test_overlap_launches_bucket_reductions_during_backward(dist_pool):
    with_overlap = dist_pool.run(_reductions_before_first_layer_gradient, True)[0]
    without = dist_pool.run(_reductions_before_first_layer_gradient, False)[0]
    assert with_overlap["buckets"] >= 3 and with_overlap["total"] == with_overlap["buckets"]
    # micro-batch 0 runs under no_sync (nothing launched); in the last micro-batch the buckets of
    # the later layers were already reducing when backward reached layer 0
    assert with_overlap["seen"][0] == 0 and 0 < with_overlap["seen"][1] < with_overlap["total"]
    # without overlap every reduction waits for finalize_model_grads
    assert without["seen"] == [0, 0] and without["total"] == without["buckets"]


def _replicas_start_equal():
    from megatron.training.training import check_weights_equal_across_data_parallel_replicas

    init_parallel(tp=1)
    torch.manual_seed(dist.get_rank())  # a different draw on every rank ...
    model = GPTModel(TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    try:
        check_weights_equal_across_data_parallel_replicas([ddp], 0)
        before = "equal"
    except RuntimeError as error:
        before = str(error)
    ddp.broadcast_params()  # ... until data-parallel rank 0's weights are broadcast
    check_weights_equal_across_data_parallel_replicas([ddp], 0)
    return before


def test_replicas_start_from_data_parallel_rank_0_weights(dist_pool):
    for before in dist_pool.run(_replicas_start_equal):
        assert "iteration 0: the weights differ across data-parallel replicas (global ranks [0, 1, 2, 3]" in before
