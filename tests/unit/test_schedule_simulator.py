"""The pipeline schedule simulator: valid 1F1B and interleaved layouts replay to the end; a schedule
whose stages post in an order that cannot match is reported with who waits on whom."""

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.arguments_validation import ArgsError
from megatron.core.pipeline_parallel import p2p_communication, schedules, simulator


@pytest.mark.parametrize("pp, vpp, m", [(2, None, 1), (2, None, 4), (4, None, 3), (4, None, 8), (2, 2, 2),
                                        (2, 2, 6), (4, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_the_schedules_layouts_replay_without_deadlock(pp, vpp, m):
    simulator.check_schedule(pp, vpp, m)
    per_rank = simulator.record(pp, vpp, m)
    sends = sum(op.kind == "send" for exchanges in per_rank for e in exchanges for op in e.ops)
    recvs = sum(op.kind == "recv" for exchanges in per_rank for e in exchanges for op in e.ops)
    # each micro-batch crosses each of the pp*v - 1 chunk boundaries forward and backward once
    assert sends == recvs == 2 * m * (pp * (vpp or 1) - 1)


def test_1f1b_order_is_the_schedules():
    first, last = simulator.record(2, None, 3)
    assert [e.name for e in first] == ["send_forward", "send_forward_recv_backward",
                                       "send_forward_recv_backward", "recv_backward"]
    assert [e.name for e in last] == ["recv_forward", "send_backward_recv_forward",
                                      "send_backward_recv_forward", "send_backward"]


def _recv_first(**kwargs):
    """A broken schedule: stage 0 waits for a gradient before sending its activations, and stage 1
    waits for those activations before it would send the gradient."""
    shape, dtype = (1, 1, 1), None
    if p2p_communication.parallel_state.get_pipeline_model_parallel_rank() == 0:
        p2p_communication.recv_backward(shape, dtype, p2p_communication.Where(0))
        p2p_communication.send_forward(object(), shape, dtype, p2p_communication.Where(0))
    else:
        p2p_communication.recv_forward(shape, dtype, p2p_communication.Where(0))
        p2p_communication.send_backward(object(), shape, dtype, p2p_communication.Where(0))
    return []


def test_a_mismatched_order_is_reported_with_who_waits_on_whom():
    with pytest.raises(simulator.ScheduleDeadlockError) as error:
        simulator.check_schedule(2, None, 1, schedule=_recv_first)
    message = str(error.value)
    assert "training pipeline schedule deadlocks for --pipeline-model-parallel-size 2" in message
    assert ("rank 0 waits in recv_backward #0 (micro-batch 0): receive gradients from rank 1, matched by its "
            "send_backward #1 (micro-batch 0), while rank 1 is blocked in recv_forward #0 (micro-batch 0)") in message
    assert "rank 1 waits in recv_forward #0 (micro-batch 0): receive activations from rank 0" in message


def _one_forward_short(**kwargs):
    """Stage 1 receives one micro-batch fewer than stage 0 sends."""
    rank = p2p_communication.parallel_state.get_pipeline_model_parallel_rank()
    for i in range(kwargs["num_microbatches"] - rank):
        (p2p_communication.send_forward(object(), (1,), None) if rank == 0
         else p2p_communication.recv_forward((1,), None))
    return []


def test_a_send_nobody_receives_is_reported():
    deadlock = simulator.find_deadlock(simulator.record(2, None, 3, schedule=_one_forward_short))
    assert list(deadlock.blocked) == [0] and deadlock.done == [1]
    assert "send activations to rank 1: rank 1 posts no matching receive" in deadlock.describe()


def test_validation_runs_the_simulator_for_pipelined_layouts(monkeypatch):
    argv = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
            "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--lr", "1e-3", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64", "--pipeline-model-parallel-size", "2"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    validate_args(parse_args(argv=argv))  # the real schedule: passes
    monkeypatch.setattr(schedules, "get_forward_backward_func", lambda *layout: _recv_first)
    with pytest.raises(ArgsError, match="the training pipeline schedule deadlocks"):
        validate_args(parse_args(argv=argv))


def test_the_replay_touches_no_device(monkeypatch):
    """validate_args runs before set_device: the replay must not allocate on an accelerator."""
    from megatron.core import device

    def no_device():
        raise AssertionError("the simulator asked for the real device")

    monkeypatch.setattr(device, "get_device", no_device)
    simulator.check_schedule(2, 2, 4)
