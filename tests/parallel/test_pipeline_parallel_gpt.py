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

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules, tracer
from tests.helpers import pp_gpt, tp_gpt
from tests.helpers.pp_gpt import VOCAB
from tests.parallel.harness import init_parallel


def _compare_with_serial(tp: int, pp: int, vpp, m: int, sp: bool = False, untied: bool = False,
                         per_token: bool = False):
    init_parallel(tp=1)
    (serial,), _ = pp_gpt.build_chunks(1, 1, None, untied=untied)
    # no finalize: in this 4-rank world the serial layout has DP = 4, whose token-count reduction
    # would count the replicas' (identical) tokens 4 times; one rank needs no reduction at all
    serial_losses = pp_gpt.run([serial], m, per_token, schedules.forward_backward_no_pipelining, finalize=None)
    serial_params = dict(serial.named_parameters())
    parallel_state.destroy_model_parallel()

    init_parallel(tp=tp, pp=pp, vpp=vpp)
    chunks, offsets = pp_gpt.build_chunks(tp, pp, vpp, sp=sp, untied=untied)
    with tracer.tracing() as trace:
        losses = pp_gpt.run(chunks, m, per_token)
    errors, covered = {}, set()
    for chunk, offset in zip(chunks, offsets):
        for name, param in chunk.named_parameters():
            serial_name = pp_gpt.serial_name(name, offset, untied)
            expected = serial_params[serial_name]
            grad, weight = tp_gpt.gather(param, param.grad), tp_gpt.gather(param, param.detach())
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
