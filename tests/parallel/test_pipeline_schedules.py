"""The pipeline schedules' order, memory bound, output deallocation, evaluation, timeout and selection.

The expected step orders are written out by hand from Narayanan et al. 2021 ("Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), Figure 4, with
micro-batches numbered from 0 (the paper's micro-batch 1 is 0 here) and model chunks from 0
(the paper's dark cells are chunk 0, light cells chunk 1). Each task builds the 8-layer GPT of
test_pipeline_parallel_gpt.py over 4 gloo ranks (PP = 4: global rank r is pipeline stage r) and
records its steps with the schedule tracer.
"""

import time

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import p2p_communication, schedules, tracer
from megatron.core.pipeline_parallel.p2p_communication import PipelineTimeoutError
from tests.helpers import pp_gpt
from tests.helpers.pp_gpt import VOCAB
from tests.parallel.harness import DistributedPool, init_parallel

PP, M = 4, 8

# ---------------------------------------------------------------------------- expected orders

# Figure 4 (top), 1F1B with p = 4, m = 8. Device 1: F1 F2 F3 F4 B1 F5 B2 F6 B3 F7 B4 F8 B5 B6 B7 B8;
# device d runs p - d + 1 forwards before its first backward, then alternates, then drains.
# (kind, micro-batch), 0-based micro-batches; every step is on virtual stage 0.
PAPER_1F1B = [
    [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("F", 5),
     ("B", 2), ("F", 6), ("B", 3), ("F", 7), ("B", 4), ("B", 5), ("B", 6), ("B", 7)],
    [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2),
     ("F", 5), ("B", 3), ("F", 6), ("B", 4), ("F", 7), ("B", 5), ("B", 6), ("B", 7)],
    [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("F", 4),
     ("B", 3), ("F", 5), ("B", 4), ("F", 6), ("B", 5), ("F", 7), ("B", 6), ("B", 7)],
    [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3),
     ("F", 4), ("B", 4), ("F", 5), ("B", 5), ("F", 6), ("B", 6), ("F", 7), ("B", 7)],
]

# Figure 4 (bottom), interleaved 1F1B with p = 4, v = 2, m = 8: micro-batches go through in groups
# of p, each device running chunk 0 for micro-batches 0-3, then chunk 1 for 0-3, then chunk 0 for
# 4-7, chunk 1 for 4-7; backwards visit the chunks in reverse (chunk 1 first). Device r first runs
# (p - r - 1) * 2 + (v - 1) * p warm-up forwards (10, 8, 6, 4), then alternates one forward and one
# backward, then drains the backwards. The warm-up count is the one the paper's author gives for
# the figure (NVIDIA/Megatron-LM issue #169). (kind, micro-batch, virtual stage).
PAPER_INTERLEAVED = [
    [  # rank 0: 10 warm-up forwards, 6 forward/backward pairs, 10 cool-down backwards
     ("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 1), ("F", 3, 1),
     ("F", 4, 0), ("F", 5, 0),
     ("F", 6, 0), ("B", 0, 1), ("F", 7, 0), ("B", 1, 1), ("F", 4, 1), ("B", 2, 1), ("F", 5, 1), ("B", 3, 1),
     ("F", 6, 1), ("B", 0, 0), ("F", 7, 1), ("B", 1, 0),
     ("B", 2, 0), ("B", 3, 0), ("B", 4, 1), ("B", 5, 1), ("B", 6, 1), ("B", 7, 1),
     ("B", 4, 0), ("B", 5, 0), ("B", 6, 0), ("B", 7, 0)],
    [  # rank 1: 8 warm-up forwards, 8 pairs, 8 cool-down backwards
     ("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 1), ("F", 3, 1),
     ("F", 4, 0), ("B", 0, 1), ("F", 5, 0), ("B", 1, 1), ("F", 6, 0), ("B", 2, 1), ("F", 7, 0), ("B", 3, 1),
     ("F", 4, 1), ("B", 0, 0), ("F", 5, 1), ("B", 1, 0), ("F", 6, 1), ("B", 2, 0), ("F", 7, 1), ("B", 3, 0),
     ("B", 4, 1), ("B", 5, 1), ("B", 6, 1), ("B", 7, 1), ("B", 4, 0), ("B", 5, 0), ("B", 6, 0), ("B", 7, 0)],
    [  # rank 2: 6 warm-up forwards, 10 pairs, 6 cool-down backwards
     ("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("F", 0, 1), ("F", 1, 1),
     ("F", 2, 1), ("B", 0, 1), ("F", 3, 1), ("B", 1, 1), ("F", 4, 0), ("B", 2, 1), ("F", 5, 0), ("B", 3, 1),
     ("F", 6, 0), ("B", 0, 0), ("F", 7, 0), ("B", 1, 0), ("F", 4, 1), ("B", 2, 0), ("F", 5, 1), ("B", 3, 0),
     ("F", 6, 1), ("B", 4, 1), ("F", 7, 1), ("B", 5, 1),
     ("B", 6, 1), ("B", 7, 1), ("B", 4, 0), ("B", 5, 0), ("B", 6, 0), ("B", 7, 0)],
    [  # rank 3: 4 warm-up forwards, 12 pairs, 4 cool-down backwards
     ("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0),
     ("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1), ("F", 2, 1), ("B", 2, 1), ("F", 3, 1), ("B", 3, 1),
     ("F", 4, 0), ("B", 0, 0), ("F", 5, 0), ("B", 1, 0), ("F", 6, 0), ("B", 2, 0), ("F", 7, 0), ("B", 3, 0),
     ("F", 4, 1), ("B", 4, 1), ("F", 5, 1), ("B", 5, 1), ("F", 6, 1), ("B", 6, 1), ("F", 7, 1), ("B", 7, 1),
     ("B", 4, 0), ("B", 5, 0), ("B", 6, 0), ("B", 7, 0)],
]


# ---------------------------------------------------------------------------- tasks (every rank)

def _trace_schedule(pp: int, vpp, m: int):
    """Train one global batch of m micro-batches with the tracer on; this rank's steps."""
    init_parallel(pp=pp, vpp=vpp)
    chunks, _ = pp_gpt.build_chunks(1, pp, vpp)
    with tracer.tracing() as trace:
        pp_gpt.run(chunks, m, per_token=False)
    return {"stage": parallel_state.get_pipeline_model_parallel_rank(), "order": trace.order(),
            "max_in_flight": trace.max_in_flight}


def _serial(m: int):
    """The one-stage model over the same micro-batches: (reported losses, {name: grad})."""
    init_parallel(tp=1)
    (serial,), _ = pp_gpt.build_chunks(1, 1, None)
    losses = pp_gpt.run([serial], m, False, schedules.forward_backward_no_pipelining)
    grads = {name: param.grad for name, param in serial.named_parameters()}
    parallel_state.destroy_model_parallel()
    return losses, grads


def _relative_errors(chunks, offsets, serial_grads):
    """Max |grad - serial grad| / max |serial grad| per parameter of this rank's chunks."""
    errors = {}
    for chunk, offset in zip(chunks, offsets):
        for name, param in chunk.named_parameters():
            expected = serial_grads[pp_gpt.serial_name(name, offset, untied=False)]
            rows = slice(0, VOCAB) if name.endswith(("word_embeddings.weight", "output_layer.weight")) else slice(None)
            difference = (param.grad[rows] - expected[rows]).abs().max() / expected[rows].abs().max()
            errors[f"chunk{offset}:{name}"] = difference.item()
    return errors


def _recording(outputs: list, forward_only: bool = False):
    """A schedule that runs get_forward_backward_func()'s schedule with a forward step that keeps
    every stage output it returns, with whether the schedule sends it on (not the model's last stage)."""
    def schedule(**kwargs):
        inner = kwargs.pop("forward_step_func")

        def forward_step(data_iterator, model):
            output, loss_func = inner(data_iterator, model)
            outputs.append((not parallel_state.is_pipeline_last_stage(), output))
            return output, loss_func

        return schedules.get_forward_backward_func()(forward_step_func=forward_step, forward_only=forward_only,
                                                     **kwargs)
    return schedule


def _deallocation(vpp, m: int):
    """Train PP = 4 (vpp chunks) keeping the outputs; their sizes afterwards and the gradient errors."""
    serial_losses, serial_grads = _serial(m)
    init_parallel(pp=PP, vpp=vpp)
    chunks, offsets = pp_gpt.build_chunks(1, PP, vpp)
    outputs = []
    losses = pp_gpt.run(chunks, m, False, func=_recording(outputs))
    return {"outputs": [(sent, output.numel()) for sent, output in outputs],
            "errors": _relative_errors(chunks, offsets, serial_grads),
            "losses": losses, "serial_losses": serial_losses,
            "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True)}


def _evaluate(vpp, m: int):
    """forward_only over PP = 4 (vpp chunks): losses, gradients left, outputs kept, steps traced."""
    serial_losses, _ = _serial(m)
    init_parallel(pp=PP, vpp=vpp)
    chunks, _ = pp_gpt.build_chunks(1, PP, vpp)
    outputs = []
    with tracer.tracing() as trace:
        losses = pp_gpt.run(chunks, m, False, func=_recording(outputs, forward_only=True))
    return {"losses": losses, "serial_losses": serial_losses,
            "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            "with_grad": [name for chunk in chunks for name, p in chunk.named_parameters() if p.grad is not None],
            "outputs_kept": all(output.numel() > 1 for _, output in outputs),
            "order": trace.order(), "in_flight_after": trace.in_flight}


def _stall_or_run(timeout_s: float, stall_s: float, m: int):
    """PP = 2: stage 1 sleeps instead of running the schedule; stage 0 runs 1F1B and times out."""
    init_parallel(pp=2)
    p2p_communication.set_p2p_timeout(timeout_s)
    try:
        chunks, _ = pp_gpt.build_chunks(1, 2, None)  # both stages: building syncs the tied embedding
        if parallel_state.get_pipeline_model_parallel_rank() == 1:
            time.sleep(stall_s)
            return None
        start = time.monotonic()
        try:
            pp_gpt.run(chunks, m, False)
        except PipelineTimeoutError as error:
            return {"message": str(error), "elapsed": time.monotonic() - start}
        return {"message": None, "elapsed": time.monotonic() - start}
    finally:
        p2p_communication.set_p2p_timeout(None)


def _schedule_names():
    """get_forward_backward_func() from parallel_state for PP = 1, PP = 4 and PP = 4 with 2 chunks."""
    names = []
    for pp, vpp in [(1, None), (4, None), (4, 2)]:
        init_parallel(pp=pp, vpp=vpp)
        names.append(schedules.get_forward_backward_func().__name__)
        parallel_state.destroy_model_parallel()
    return names


def _interleaved_refusal(m: int):
    """The interleaved schedule's error for m micro-batches at PP = 4, v = 2 (None: no error)."""
    init_parallel(pp=PP, vpp=2)
    try:
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=pp_gpt.make_forward_step(False), data_iterator=[iter([]), iter([])],
            model=[torch.nn.Identity(), torch.nn.Identity()], num_microbatches=m, seq_length=8, micro_batch_size=2)
    except ValueError as error:
        return str(error)
    return None


# ---------------------------------------------------------------------------- tests (parent)

_TRACES = {}


def _traces(dist_pool, pp: int, vpp, m: int):
    """Per-rank traces of one configuration, run once per session and shared by the tests."""
    if (pp, vpp, m) not in _TRACES:
        _TRACES[(pp, vpp, m)] = dist_pool.run(_trace_schedule, pp, vpp, m)
    return _TRACES[(pp, vpp, m)]


def test_1f1b_order_is_the_papers(dist_pool):
    for rank, result in enumerate(_traces(dist_pool, PP, None, M)):
        assert result["stage"] == rank
        assert {stage for _, _, stage in result["order"]} == {0}, rank
        assert [(kind, mb) for kind, mb, _ in result["order"]] == PAPER_1F1B[rank], f"rank {rank}"


def test_interleaved_order_is_the_papers(dist_pool):
    for rank, result in enumerate(_traces(dist_pool, PP, 2, M)):
        assert result["stage"] == rank
        assert result["order"] == PAPER_INTERLEAVED[rank], f"rank {rank}"


@pytest.mark.parametrize("pp, vpp, m, bounds", [
    (PP, None, M, [4, 3, 2, 1]),                     # 1F1B: min(p - rank, m)
    (PP, None, 3, [3, 3, 2, 1]),                     # 1F1B, fewer micro-batches than stages
    (PP, 2, M, [11, 9, 7, 5]),                       # interleaved: (p - rank - 1) * 2 + (v - 1) * p + 1
    (PP, 2, PP, [8, 8, 8, 8]),                       # interleaved, m == p: all v * m steps are warm-up
], ids=["1f1b", "1f1b-m3", "interleaved", "interleaved-m4"])
def test_in_flight_micro_batches_reach_the_bound(dist_pool, pp, vpp, m, bounds):
    """Micro-batches (micro-batch x chunk steps, interleaved) forwarded but not yet back-propagated."""
    for rank, result in enumerate(_traces(dist_pool, pp, vpp, m)):
        # Computed here from the schedule's formula, and also written out above.
        v = vpp or 1
        warmup = v * m if (vpp and m == pp) else min((pp - rank - 1) * (2 if vpp else 1) + (v - 1) * pp, v * m)
        assert bounds[rank] == min(warmup + 1, v * m)
        assert result["max_in_flight"] == bounds[rank], f"rank {rank}"


@pytest.mark.parametrize("vpp", [None, 2], ids=["1f1b", "interleaved"])
def test_sent_outputs_are_deallocated_and_gradients_still_match(dist_pool, vpp):
    results = dist_pool.run(_deallocation, vpp, M)
    for rank, result in enumerate(results):
        sent = [numel for is_sent, numel in result["outputs"] if is_sent]
        kept = [numel for is_sent, numel in result["outputs"] if not is_sent]
        assert len(sent) + len(kept) == M * (vpp or 1), rank
        assert sent == [1] * len(sent), f"rank {rank}: sent outputs not released: {sent}"
        # The model's last stage sends nothing: its outputs (per-token losses) keep their storage.
        assert all(numel > 1 for numel in kept), rank
        assert bool(kept) == result["last_stage"], rank
        bad = {name: error for name, error in result["errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
        if result["last_stage"]:
            for got, expected in zip(result["losses"], result["serial_losses"]):
                assert got["lm loss"] == pytest.approx(expected["lm loss"], rel=1e-5), rank


@pytest.mark.parametrize("vpp", [None, 2], ids=["1f1b", "interleaved"])
def test_forward_only_gives_the_serial_losses_and_no_gradients(dist_pool, vpp):
    results = dist_pool.run(_evaluate, vpp, M)
    for rank, result in enumerate(results):
        assert result["with_grad"] == [], rank
        assert result["outputs_kept"], rank  # nothing to back-propagate: nothing is released
        assert {kind for kind, _, _ in result["order"]} == {"F"}, rank
        assert len(result["order"]) == M * (vpp or 1), rank
        assert result["in_flight_after"] == 0, rank
        if result["last_stage"]:
            assert len(result["losses"]) == M, rank
            for got, expected in zip(result["losses"], result["serial_losses"]):
                assert got["lm loss"] == pytest.approx(expected["lm loss"], rel=1e-5), rank
        else:
            assert result["losses"] == [], rank


def test_stalled_stage_raises_a_timeout_naming_rank_stage_microbatch_and_operation():
    timeout_s, stall_s = 2.0, 5.0
    pool = DistributedPool(2, timeout_s=60)
    try:
        first, second = pool.run(_stall_or_run, timeout_s, stall_s, 4)
    finally:
        pool.close()
    assert second is None
    message, elapsed = first["message"], first["elapsed"]
    assert message is not None, "stage 0 finished the schedule while stage 1 was asleep"
    # raised by the timeout, not by stage 1 waking up: the bound is the stall, not a speed (a loaded
    # machine delays the raise by a second or more past the timeout)
    assert timeout_s <= elapsed < stall_s, elapsed
    assert "global rank 0" in message, message
    assert "pipeline stage 0" in message, message
    # gloo completes a send only once the receiver has posted its receive, so stage 0 is stuck on
    # its first one: the warm-up send of micro-batch 0's activations.
    assert "micro-batch 0" in message, message
    assert "send_forward" in message and "rank 1 (stage 1)" in message, message


def test_get_forward_backward_func_picks_the_schedule(dist_pool):
    assert schedules.get_forward_backward_func(1) is schedules.forward_backward_no_pipelining
    assert schedules.get_forward_backward_func(4) is schedules.forward_backward_pipelining_without_interleaving
    assert schedules.get_forward_backward_func(4, 2) is schedules.forward_backward_pipelining_with_interleaving
    for names in dist_pool.run(_schedule_names):
        assert names == ["forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                         "forward_backward_pipelining_with_interleaving"]


@pytest.mark.parametrize("m", [6, 2])
def test_interleaved_schedule_refuses_microbatches_not_a_multiple_of_pp(dist_pool, m):
    for message in dist_pool.run(_interleaved_refusal, m):
        assert message is not None
        assert f"({m})" in message and f"({PP})" in message, message
