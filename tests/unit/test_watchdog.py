"""The hang watchdog's pieces that need no process group: the stall spec, where the schedule is,
and that it stays off in one process (tests/functional/test_watchdog_stalls.py runs it for real)."""

import pytest

from megatron.core import watchdog


def test_stall_spec():
    stall = watchdog._parse_stall("rank=1,op=all_reduce,group=tp,after=3")
    assert (stall.rank, stall.op, stall.group, stall.after, stall.seconds) == (1, "all_reduce", "tp", 3, 600.0)
    assert watchdog._parse_stall("rank=0,op=p2p").group is None
    assert watchdog._parse_stall("") is None
    for bad in ("rank=1", "op=all_reduce", "rank=1,op=x,when=3"):
        with pytest.raises(ValueError, match="MEGATRON_TEST_STALL"):
            watchdog._parse_stall(bad)


def test_where_the_schedule_is():
    schedule = watchdog._Schedule(iteration=5, num_microbatches=8, microbatch=3)
    assert schedule.describe() == "micro-batch 3 of 8, iteration 5"
    assert schedule.describe(microbatch=1, virtual_stage=1) == "micro-batch 1 of 8, model chunk 1, iteration 5"
    schedule.microbatch = None
    assert schedule.describe() == "after the micro-batches, iteration 5"
    assert watchdog._Schedule(evaluating=True, num_microbatches=2, microbatch=0).describe() == \
        "micro-batch 0 of 2, evaluation"
    assert watchdog._Schedule().describe() == ""


def test_off_in_one_process():
    with pytest.raises(ValueError, match="--watchdog-seconds must be positive"):
        watchdog.start(0)
    watchdog.start(5)  # no process group: nothing can hang
    assert watchdog.deadline() is None
    with watchdog.watch("all_reduce"):
        pass
    assert watchdog.watched_work(None, "all_reduce", None) is None


def test_watchdog_seconds_flag():
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.arguments_validation import ArgsError

    argv = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
            "--max-position-embeddings", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    assert parse_args(argv=argv).watchdog_seconds is None  # initialize then uses --distributed-timeout-minutes
    assert validate_args(parse_args(argv=[*argv, "--watchdog-seconds", "2.5"])).watchdog_seconds == 2.5
    with pytest.raises(ArgsError, match="--watchdog-seconds must be > 0"):
        validate_args(parse_args(argv=[*argv, "--watchdog-seconds", "0"]))
    with pytest.raises(ArgsError, match="longer than --distributed-timeout-minutes"):
        validate_args(parse_args(argv=[*argv, "--watchdog-seconds", "61", "--distributed-timeout-minutes", "1"]))
