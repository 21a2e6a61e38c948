"""A tiny Llama (RMSNorm, no biases, SwiGLU, RoPE, grouped-query attention, untied output layer) in
each parallel layout against the serial run of the same model on the same micro-batches: same
losses, same gradients after finalize_model_grads, and (replicated K/V) the same grad norm and
the same weights after one optimizer step (TP = 2 x DP = 2, plain and distributed optimizer).

    layout         what it exercises
    tp2-g2         TP = 2, 2 query groups: one whole group per rank (contiguous rows)
    tp2-g4         TP = 2, 4 groups: two per rank
    tp2-mqa        TP = 2, 1 group (multi-query): K/V replicated on both ranks, explicit
                   partition_rows, their gradients summed in finalize_model_grads
    tp2-mqa-sp     the same under sequence parallelism
    tp2-mqa-qk     MQA with q/k layer norms and a QKV bias (Qwen-style): the replicated K/V bias
                   rows, and the norms' partial gradients summed over TP
    pp2            2 pipeline stages (1F1B)
    tp2-pp2        both (2 groups)
    pp2-v2         interleaved: 2 stages x 2 virtual chunks of one layer each

Every rank runs the serial model first (TP = PP = 1, forward_backward_no_pipelining), then its
piece of the layout; split gradients are gathered into the serial layout with
tensor_parallel.gather_tensor_parallel, which also checks that replicated rows agree. The
vocabulary (300) is not a multiple of 128 x t: padding rows must get no gradient. Each task runs
several layouts (the world has 4 ranks; TP = 2 alone leaves 2 identical data-parallel replicas).
"fused" runs the config's fused paths (fused_kernels.rotary_pos_emb and bias_swiglu, the fused
softmax and bias-dropout-add, the CPU fast path), "plain" the reference PyTorch ops.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import gather_tensor_parallel
from megatron.model import GPTModel, TransformerConfig
from megatron.model.layer_specs import get_llama_layer_spec
from megatron.model.transformer_layer import get_layer_offset
from megatron.core.optimizer.optimizer import params_norm
from megatron.model.utils import get_num_parameters_across_model_parallel
from tests.parallel.harness import init_parallel

VOCAB, SEQ, MBS, HIDDEN, HEADS, FFN, LAYERS, SEED, MICROBATCHES = 300, 8, 2, 32, 8, 48, 4, 1234, 4
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")

LAYOUTS = {
    "tp2-g2": dict(tp=2, groups=2),
    "tp2-g4": dict(tp=2, groups=4),
    "tp2-mqa": dict(tp=2, groups=1),
    "tp2-mqa-sp": dict(tp=2, groups=1, sp=True),
    "tp2-mqa-qk": dict(tp=2, groups=1, qk=True),
    "pp2": dict(pp=2, groups=2),
    "tp2-pp2": dict(tp=2, pp=2, groups=2),
    "pp2-v2": dict(pp=2, vpp=2, groups=4),
    "tp2-g4-sp-alibi": dict(tp=2, groups=4, sp=True, position="alibi"),  # each rank its own heads' slopes
}


def _padded(tp: int) -> int:
    multiple = 128 * tp
    return -(-VOCAB // multiple) * multiple


def _config(groups: int, fused: bool, tp: int = 1, pp: int = 1, vpp=None, sp: bool = False,
            qk: bool = False) -> TransformerConfig:
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=groups,
        ffn_hidden_size=FFN, normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sp, qk_layernorm=qk, add_qkv_bias=qk, apply_rope_fusion=fused,
        bias_swiglu_fusion=fused, masked_softmax_fusion=fused, bias_dropout_fusion=fused,
        fused_kernels_cpu_impl="native" if fused else "reference")


def build_chunks(groups: int, fused: bool, tp: int = 1, pp: int = 1, vpp=None, sp: bool = False, qk: bool = False,
                 position: str = "rope"):
    """This rank's Llama chunks (its stage, its TP shard) and each chunk's first global layer."""
    config = _config(groups, fused, tp, pp, vpp, sp, qk)
    chunks, offsets = [], []
    for chunk_id in range(vpp or 1):
        if vpp is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id)
        torch.manual_seed(SEED)
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        chunks.append(GPTModel(config, vocab_size=_padded(tp), num_tokens=VOCAB, max_sequence_length=SEQ,
                               share_embeddings_and_output_weights=False, position_embedding_type=position,
                               transformer_layer_spec=get_llama_layer_spec(qk_layernorm=qk),
                               pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage()))
        offsets.append(get_layer_offset(config))
    if vpp is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks, offsets


def microbatches(seed: int = 7):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        labels[0, 0] = VOCAB - 1  # the last real id sits next to the padding rows
        loss_mask = (torch.rand(MBS, SEQ, generator=generator) > 0.2).float()
        batches.append((tokens, labels, loss_mask, torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)))
    return batches


def _forward_step(data_iterator, model):
    tokens, labels, loss_mask, position_ids = next(data_iterator)
    losses = model(tokens, position_ids, None, labels=labels)  # [b, s]

    def loss_func(output):
        loss = (output.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach()}

    return losses, loss_func


def run_schedule(chunks, serial: bool = False, share: slice = slice(None)):
    """Forward and backward over the micro-batches (this data-parallel replica's `share` of them);
    the last stage's losses (others: [])."""
    batches = microbatches()[share]
    iterators = [iter(batches) for _ in chunks]
    func = schedules.forward_backward_no_pipelining if serial else schedules.get_forward_backward_func()
    # No finalize for the serial run: its one rank has nothing to reduce.
    reported = func(forward_step_func=_forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
                    model=chunks, num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MBS,
                    finalize_model_grads_func=None if serial else finalize_model_grads)
    return [entry["lm loss"].item() for entry in reported]


def serial_name(name: str, offset: int) -> str:
    """A chunk's parameter name in the serial model: its layers numbered from the chunk's offset."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def _serial_run(groups: int, fused: bool, qk: bool = False, position: str = "rope"):
    """The serial model's losses and parameters (with their gradients)."""
    init_parallel(tp=1)
    (serial,), _ = build_chunks(groups, fused, qk=qk, position=position)
    losses = run_schedule([serial], serial=True)
    parallel_state.destroy_model_parallel()
    return losses, dict(serial.named_parameters())


def _compare_layout(layout: dict, fused: bool, serial_losses: list, serial_params: dict) -> dict:
    groups = layout["groups"]
    tp, pp, vpp, sp = layout.get("tp", 1), layout.get("pp", 1), layout.get("vpp"), layout.get("sp", False)
    init_parallel(tp=tp, pp=pp, vpp=vpp)
    chunks, offsets = build_chunks(groups, fused, tp, pp, vpp, sp, layout.get("qk", False),
                                   layout.get("position", "rope"))
    losses = run_schedule(chunks)
    grad_errors, weight_errors, padding_grad, covered = {}, {}, 0.0, set()
    for chunk, offset in zip(chunks, offsets):
        for name, param in chunk.named_parameters():
            expected = serial_params[serial_name(name, offset)]
            grad = gather_tensor_parallel(param, param.grad)  # replicated K/V rows must agree
            weight = gather_tensor_parallel(param, param.detach())
            rows = slice(0, VOCAB) if name in VOCAB_PARAMS else slice(None)
            if name in VOCAB_PARAMS:
                padding_grad = max(padding_grad, grad[VOCAB:].abs().max().item())
            assert grad[rows].shape == expected[rows].shape, (name, grad.shape, expected.shape)
            weight_errors[name + f"@{offset}"] = relative_error(weight[rows], expected.detach()[rows])
            grad_errors[name + f"@{offset}"] = relative_error(grad[rows], expected.grad[rows])
            covered.add(serial_name(name, offset))
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, sorted(covered))
    parallel_state.destroy_model_parallel()
    return {"serial_losses": serial_losses, "losses": losses, "grad_errors": grad_errors,
            "weight_errors": weight_errors, "padding_grad": padding_grad,
            "missing": sorted(set(serial_params) - set().union(*everything))}


def _compare_layouts(names: list, fused: bool) -> dict:
    models = {name: (LAYOUTS[name]["groups"], LAYOUTS[name].get("qk", False), LAYOUTS[name].get("position", "rope"))
              for name in names}
    serial = {key: _serial_run(*key[:1], fused, *key[1:]) for key in sorted(set(models.values()))}
    return {name: _compare_layout(LAYOUTS[name], fused, *serial[models[name]]) for name in names}


FUSED = [pytest.param(False, id="plain"), pytest.param(True, id="fused")]


@pytest.mark.parametrize("fused", FUSED)
def test_llama_layouts_equal_the_serial_model(dist_pool, fused):
    results = dist_pool.run(_compare_layouts, list(LAYOUTS), fused)
    for rank, per_layout in enumerate(results):
        for name, result in per_layout.items():
            where = (name, rank)
            assert not result["missing"], (where, result["missing"])  # every parameter lives somewhere
            assert max(result["weight_errors"].values()) == 0.0, (where, result["weight_errors"])  # same init
            bad = {key: error for key, error in result["grad_errors"].items() if error > 1e-5}
            assert not bad, (where, bad)
            assert result["padding_grad"] == 0.0, where
            if result["losses"]:  # the last pipeline stage reports them
                assert result["losses"] == pytest.approx(result["serial_losses"], rel=1e-5), where
    for name in LAYOUTS:  # the last stages (every rank without PP) reported all micro-batches
        reported = [per_layout[name]["losses"] for per_layout in results if per_layout[name]["losses"]]
        assert len(reported) == dist_pool.world_size // LAYOUTS[name].get("pp", 1), name
        assert all(len(losses) == MICROBATCHES for losses in reported), name


# SGD (Adam's first step is lr * sign(g): blind to the norm); clip_grad below the norm, so the step
# depends on the norm, which must count the replicated K/V rows once.
OPTIMIZER = OptimizerConfig(optimizer="sgd", lr=0.1, clip_grad=0.5, log_num_zeros_in_grad=True)


def _one_step(chunks, share: slice = slice(None), ddp_config=None):
    """One global batch and one optimizer step; (losses, grad_norm, num_zeros, optimizer)."""
    if ddp_config is not None:
        chunks = [DistributedDataParallel(chunk.config, ddp_config, chunk) for chunk in chunks]
        for chunk in chunks:
            chunk.zero_grad_buffer()
    optimizer = get_megatron_optimizer(OPTIMIZER, chunks)
    optimizer.zero_grad()
    losses = run_schedule(chunks, serial=ddp_config is None, share=share)
    _, grad_norm, num_zeros = optimizer.step()
    return losses, grad_norm, num_zeros, optimizer


def _offset_duplicate_shards(optimizer) -> int:
    """Distributed optimizer: main shards that start inside a param with duplicate rows and hold some
    of them (the shard's duplicate range is then offset from the param's)."""
    count = 0
    for shard in getattr(optimizer, "shards", lambda: [])():
        param_start = optimizer.buffers[shard.buffer_index].param_index_map[shard.model_param][0]
        count += shard.start > param_start and hasattr(shard.main, "tensor_parallel_duplicate_rows")
    return count


def _mqa_optimizer_step(use_distributed_optimizer: bool, bucket_size) -> dict:
    init_parallel(tp=1)
    (serial,), _ = build_chunks(1, fused=False)
    serial_count = get_num_parameters_across_model_parallel(serial)
    serial_losses, serial_norm, serial_zeros, _ = _one_step([serial])
    expected = {name: p.detach().clone() for name, p in serial.named_parameters()}
    parallel_state.destroy_model_parallel()

    init_parallel(tp=2)  # 4 ranks: DP = 2, each replica half the micro-batches
    (model,), _ = build_chunks(1, fused=False, tp=2)
    count = get_num_parameters_across_model_parallel(model)  # the K/V replicas counted once
    d, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    half = MICROBATCHES // d
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                               bucket_size=bucket_size)
    losses, grad_norm, num_zeros, optimizer = _one_step([model], slice(r * half, (r + 1) * half), ddp_config)
    errors = {}
    whole = {name: gather_tensor_parallel(param, param.detach()) for name, param in model.named_parameters()}
    # --log-params-norm: the norm of the whole (gathered) model, each replicated K/V row once
    errors["params_norm"] = relative_error(torch.tensor(params_norm([model])),
                                           torch.stack([w.double().pow(2).sum() for w in whole.values()]).sum().sqrt())
    for name, param in model.named_parameters():
        rows = slice(0, VOCAB) if name in VOCAB_PARAMS else slice(None)
        weight = gather_tensor_parallel(param, param.detach())  # replicated K/V rows must agree
        errors[name] = relative_error(weight[rows], expected[name][rows])
    return {"serial_losses": serial_losses[r * half:(r + 1) * half], "losses": losses, "errors": errors,
            "serial_norm": serial_norm, "grad_norm": grad_norm, "serial_zeros": serial_zeros,
            "num_zeros": num_zeros, "offset_duplicate_shards": _offset_duplicate_shards(optimizer),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(), "count": count,
            "serial_count": serial_count}


@pytest.mark.parametrize("use_distributed_optimizer, bucket_size",
                         [(False, None), (True, 5000)], ids=["optimizer", "distributed-optimizer"])
def test_mqa_grad_norm_and_step_equal_the_serial_model(dist_pool, use_distributed_optimizer, bucket_size):
    results = dist_pool.run(_mqa_optimizer_step, use_distributed_optimizer, bucket_size)
    # TP = 2 pads the vocabulary to 512 rows, serial to 384: the extra rows of the embedding and the
    # untied output layer have zero gradients
    padding_zeros = 2 * (_padded(2) - _padded(1)) * HIDDEN
    for rank, result in enumerate(results):
        assert result["serial_norm"] > OPTIMIZER.clip_grad, rank  # the step is clipped
        assert result["grad_norm"] == pytest.approx(result["serial_norm"], rel=1e-5), rank
        assert result["num_zeros"] == result["serial_zeros"] + padding_zeros, rank
        assert result["count"] == result["serial_count"] + padding_zeros, rank  # the padding rows are parameters
        assert result["losses"] == pytest.approx(result["serial_losses"], rel=1e-5), rank
        bad = {name: error for name, error in result["errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
    if use_distributed_optimizer:  # a shard starts inside a param with replicated K/V rows (the offsets)
        assert sum(r["offset_duplicate_shards"] for r in results if r["tp_rank"] == 1) > 0
