"""Activation recompute under tensor, sequence and pipeline parallelism: each rank's losses and
gradients with recompute equal, bit for bit, those of the same layout without it, dropout on.

Every rank builds its stage (its model chunks) from one seed twice -- without recompute, then with
each recompute mode -- and runs the same micro-batches through the layout's schedule from the
same dropout seeds. Under TP the attention (and, with SP, the hidden) dropout draws from the RNG
tracker's per-rank stream, so these cases check that the recompute restores the tracker too; a
control disables that restore and sees the gradients change. With
--distribute-saved-activations the saved layer inputs (on a pipeline stage after the first, the
received tensor too) are split over the TP ranks and gathered back before the recompute.
"""

import pytest
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import random as tp_random
from megatron.model import GPTModel, TransformerConfig
from tests.parallel.harness import init_parallel

VOCAB, SEQ, MBS, HIDDEN, SEED, DROPOUT_SEED = 256, 8, 2, 32, 1234, 99

MODES = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
}


def _build(layers: int, tp: int, pp: int, vpp, sp: bool, mode: str, distribute: bool) -> list:
    recompute = dict(MODES[mode], distribute_saved_activations=distribute and mode not in ("none", "selective"))
    config = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp,
                               hidden_dropout=0.2, attention_dropout=0.2, **recompute)
    chunks = []
    for chunk_id in range(vpp or 1):
        if vpp is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id)
        torch.manual_seed(SEED)
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        chunks.append(GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                               pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage()))
    if vpp is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks


def _forward_step(data_iterator, model):
    tokens, labels, position_ids = next(data_iterator)
    output = model(tokens, position_ids, None, labels=labels)
    return output, lambda losses: (losses.float().mean(), {"lm loss": losses.float().mean().detach()})


def _run(chunks: list, num_microbatches: int) -> tuple:
    """Losses (last stage) and {chunk.name: grad} of one forward-backward over the micro-batches."""
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=generator)
        batches.append((tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).expand(MBS, SEQ)))
    torch.manual_seed(DROPOUT_SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(DROPOUT_SEED)
    iterators = [iter(batches) for _ in chunks]
    losses = schedules.get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks, num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS)
    grads = {f"{i}.{name}": param.grad.clone() for i, chunk in enumerate(chunks)
             for name, param in chunk.named_parameters()}
    return [entry["lm loss"] for entry in losses], grads


def _differences(reference: tuple, result: tuple) -> dict:
    losses_equal = len(reference[0]) == len(result[0]) and all(
        torch.equal(a, b) for a, b in zip(reference[0], result[0]))
    return {"losses_equal": losses_equal, "num_losses": len(result[0]),
            "grads_differ": sorted(n for n, g in reference[1].items() if not torch.equal(g, result[1][n]))}


def _compare_modes(layers: int, tp: int, pp: int, vpp, sp: bool, m: int, modes: list, distribute: bool = False,
                   control: bool = False) -> dict:
    init_parallel(tp=tp, pp=pp, vpp=vpp)
    reference = _run(_build(layers, tp, pp, vpp, sp, "none", False), m)
    out = {mode: _differences(reference, _run(_build(layers, tp, pp, vpp, sp, mode, distribute), m))
           for mode in modes}
    if control:  # recompute without restoring the tracker's streams: the TP-split dropouts change
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.set_states = lambda states: None
        try:
            out["control"] = _differences(reference, _run(_build(layers, tp, pp, vpp, sp, modes[0], distribute), m))
        finally:
            del tracker.set_states
    return out


CASES = {
    "tp2-sp": dict(layers=4, tp=2, pp=1, vpp=None, sp=True, m=2,
                   modes=["selective", "uniform-1", "uniform-2", "block-1"], control=True),
    "tp2-distribute-saved-activations": dict(layers=4, tp=2, pp=1, vpp=None, sp=False, m=2,
                                             modes=["uniform-1", "uniform-2", "block-1"], distribute=True),
    "pp2": dict(layers=4, tp=1, pp=2, vpp=None, sp=False, m=4, modes=["selective", "uniform-2", "block-1"]),
    "pp2-tp2-sp": dict(layers=4, tp=2, pp=2, vpp=None, sp=True, m=4, modes=["selective", "uniform-1", "block-1"]),
    "pp2-tp2-distribute-saved-activations": dict(layers=4, tp=2, pp=2, vpp=None, sp=False, m=4,
                                                 modes=["uniform-1", "block-1"], distribute=True),
    "pp2-v2-tp2-sp": dict(layers=8, tp=2, pp=2, vpp=2, sp=True, m=4, modes=["selective", "uniform-2", "block-1"]),
}


def _distributed_saved_input() -> dict:
    """tensor_parallel.checkpoint(fn, True, x) at TP = 2: between forward and backward the caller's x
    holds half its elements; backward restores it; a view's base is never touched; the gradients
    are those of fn without recompute, bit for bit (the gathered input gets the view's strides)."""
    init_parallel(tp=2)
    weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))

    def fn(hidden):
        return (hidden @ weight).tanh()  # [s, b, h]

    leaf = torch.randn(6, 2, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x = leaf * 1.0  # a non-view [s, b, h] activation
    out = tensor_parallel.checkpoint(fn, True, x)
    numel_between = x.numel()
    out.sum().backward()
    recomputed = leaf.grad.clone()
    leaf.grad = None
    fn(leaf * 1.0).sum().backward()
    grads_equal = [torch.equal(recomputed, leaf.grad)]

    base = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(2), requires_grad=True)  # [b, s, h]
    view = base.transpose(0, 1).contiguous()  # [s, b, h]: with b = 1 contiguous() returns the view itself
    out = tensor_parallel.checkpoint(fn, True, view)
    base_intact = view._base is base and base.shape == (1, 6, 4) and view.shape == (6, 1, 4)
    out.sum().backward()
    recomputed = base.grad.clone()
    base.grad = None
    fn(base.transpose(0, 1)).sum().backward()
    grads_equal.append(torch.equal(recomputed, base.grad))
    return {"numel_between": numel_between, "shape_after": tuple(x.shape), "grads_equal": grads_equal,
            "base_intact": base_intact}


def test_checkpoint_keeps_a_tensor_parallel_slice_of_the_saved_input(dist_pool):
    for result in dist_pool.run(_distributed_saved_input):
        assert result == {"numel_between": 24, "shape_after": (6, 2, 4), "grads_equal": [True, True],
                          "base_intact": True}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_recompute_equals_no_recompute_per_rank(dist_pool, case):
    spec = CASES[case]
    results = dist_pool.run(_compare_modes, **spec)
    for rank, per_mode in enumerate(results):
        for mode in spec["modes"]:
            assert per_mode[mode]["losses_equal"] and not per_mode[mode]["grads_differ"], (rank, mode, per_mode[mode])
        if spec.get("control"):
            assert per_mode["control"]["grads_differ"], rank
    last_stage_ranks = [rank for rank, per_mode in enumerate(results) if per_mode[spec["modes"][0]]["num_losses"]]
    assert last_stage_ranks and all(results[r][spec["modes"][0]]["num_losses"] == spec["m"] for r in last_stage_ranks)

