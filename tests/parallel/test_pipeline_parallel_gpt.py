"""An 8-layer GPT split over pipeline stages (1F1B and interleaved, alone and with TP=2) against
the same GPT on one rank: same initial weights, same losses, same gradients.

Every rank first runs the serial model (one stage, TP = 1) over the global batch of m
micro-batches with the no-pipelining schedule, then builds its own stage (its model chunks,
with virtual stages) from the same seed and runs the pipelined schedule over the same
micro-batches. A stage's parameter `decoder.layers.{i}.*` is the serial model's
`decoder.layers.{offset + i}.*`; the last stage's copy of the tied embedding must carry the
serial embedding's weight and gradient (the embedding-group reduction). Tensor-parallel shards
are gathered before comparing. With 4 ranks, PP = 2 alone leaves 2 data-parallel replicas,
which run the same batch.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import schedules, tracer
from megatron.model import GPTModel, TransformerConfig
from megatron.model.transformer_layer import get_layer_offset
from tests.parallel.harness import init_parallel
from tests.parallel.test_tensor_parallel_gpt import _gather

VOCAB, SEQ, MBS, HIDDEN, LAYERS, SEED = 300, 8, 2, 32, 8, 1234


def _padded(tp: int) -> int:
    multiple = 128 * tp
    return -(-VOCAB // multiple) * multiple


def _build_chunks(tp: int, pp: int, vpp, sp: bool = False, untied: bool = False):
    """This rank's model chunks and each chunk's global offset of its first layer."""
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp,
                               hidden_dropout=0.0, attention_dropout=0.0)
    chunks, offsets = [], []
    for chunk_id in range(vpp or 1):
        if vpp is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id)
        torch.manual_seed(SEED)
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        chunks.append(GPTModel(config, vocab_size=_padded(tp), num_tokens=VOCAB, max_sequence_length=SEQ,
                               share_embeddings_and_output_weights=not untied,
                               pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage()))
        offsets.append(get_layer_offset(config))
    if vpp is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks, offsets


def _microbatches(num_microbatches: int):
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        loss_mask = (torch.rand(MBS, SEQ, generator=generator) > 0.2).float()
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
        batches.append((tokens, labels, loss_mask, position_ids))
    return batches


def _forward_step(per_token: bool):
    def forward_step(data_iterator, model):
        tokens, labels, loss_mask, position_ids = next(data_iterator)
        output = model(tokens, position_ids, None, labels=labels)

        def loss_func(losses):
            total = (losses.float() * loss_mask).sum()
            count = loss_mask.sum().to(torch.int64)
            if per_token:
                return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}
            loss = total / loss_mask.sum()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    return forward_step


def _run(chunks, num_microbatches: int, per_token: bool, func=None, finalize=finalize_model_grads):
    batches = _microbatches(num_microbatches)
    func = func or schedules.get_forward_backward_func()
    iterators = [iter(batches) for _ in chunks]
    losses = func(forward_step_func=_forward_step(per_token), data_iterator=iterators if len(chunks) > 1 else iterators[0],
                  model=chunks, num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
                  calculate_per_token_loss=per_token, finalize_model_grads_func=finalize)
    return [{k: v.tolist() for k, v in entry.items()} for entry in losses]


def _serial_name(name: str, offset: int, untied: bool) -> str:
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
        return ".".join(parts)
    if name == "output_layer.weight" and not untied:
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
    return name


def _compare_with_serial(tp: int, pp: int, vpp, m: int, sp: bool = False, untied: bool = False,
                         per_token: bool = False):
    init_parallel(tp=1)
    (serial,), _ = _build_chunks(1, 1, None, untied=untied)
    # no finalize: in this 4-rank world the serial layout has DP = 4, whose token-count reduction
    # would count the replicas' (identical) tokens 4 times; one rank needs no reduction at all
    serial_losses = _run([serial], m, per_token, schedules.forward_backward_no_pipelining, finalize=None)
    serial_params = dict(serial.named_parameters())
    parallel_state.destroy_model_parallel()

    init_parallel(tp=tp, pp=pp, vpp=vpp)
    chunks, offsets = _build_chunks(tp, pp, vpp, sp=sp, untied=untied)
    with tracer.tracing() as trace:
        losses = _run(chunks, m, per_token)
    errors, covered = {}, set()
    for chunk, offset in zip(chunks, offsets):
        for name, param in chunk.named_parameters():
            serial_name = _serial_name(name, offset, untied)
            expected = serial_params[serial_name]
            grad, weight = _gather(param, param.grad), _gather(param, param.detach())
            rows = slice(0, VOCAB) if name.endswith(("word_embeddings.weight", "output_layer.weight")) else slice(None)
            assert torch.equal(weight[rows], expected.detach()[rows]), f"{name}: initial weights differ"
            error = ((grad[rows] - expected.grad[rows]).abs().max() / expected.grad[rows].abs().max()).item()
            errors[f"chunk{offset}:{name}"] = error
            covered.add(serial_name)
    covered_all = dist.all_gather_object
    everything = [None] * dist.get_world_size()
    covered_all(everything, sorted(covered))
    union = set().union(*everything)
    return {"serial_losses": serial_losses, "losses": losses, "errors": errors,
            "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            "missing": sorted(set(serial_params) - union), "order": trace.order(),
            "max_in_flight": trace.max_in_flight}


CASES = {
    "pp2": dict(tp=1, pp=2, vpp=None, m=4),
    "pp4": dict(tp=1, pp=4, vpp=None, m=8),
    "pp4-fewer-microbatches-than-stages": dict(tp=1, pp=4, vpp=None, m=3),
    "pp2-tp2": dict(tp=2, pp=2, vpp=None, m=4),
    "pp2-tp2-sp-untied": dict(tp=2, pp=2, vpp=None, m=4, sp=True, untied=True),
    "pp2-v2": dict(tp=1, pp=2, vpp=2, m=4),
    "pp4-v2": dict(tp=1, pp=4, vpp=2, m=8),
    "pp4-v2-all-warmup": dict(tp=1, pp=4, vpp=2, m=4),
    "pp2-v4-tp2": dict(tp=2, pp=2, vpp=4, m=4),
    "pp2-tp2-per-token": dict(tp=2, pp=2, vpp=None, m=4, per_token=True),  # DP = 1: no DDP here
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_loss_and_gradients_equal_the_serial_model(dist_pool, case):
    results = dist_pool.run(_compare_with_serial, **CASES[case])
    for rank, result in enumerate(results):
        assert not result["missing"], (rank, result["missing"])  # every serial parameter lives on some stage
        bad = {name: error for name, error in result["errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
        if result["last_stage"]:
            assert len(result["losses"]) == CASES[case]["m"]
            for got, expected in zip(result["losses"], result["serial_losses"]):
                assert got["lm loss"] == pytest.approx(expected["lm loss"], rel=1e-5), rank
        else:
            assert result["losses"] == [], rank  # only the last stage computes losses
