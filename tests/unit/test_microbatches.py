"""Micro-batch calculators: constant and ramp-up global batch sizes, train iters for samples."""

import itertools

import pytest

from megatron.core.num_microbatches_calculator import (
    ConstantNumMicroBatches,
    RampupBatchsizeNumMicroBatches,
    build_num_microbatches_calculator,
    get_train_iters_for_samples,
)


def test_constant():
    calc = ConstantNumMicroBatches(global_batch_size=16, micro_batch_size=2, data_parallel_size=2)
    assert calc.get() == 4 and calc.get_current_global_batch_size() == 16
    calc.update(10_000, consistency_check=True)
    assert calc.get() == 4


def test_constant_rejects_indivisible_batch():
    with pytest.raises(ValueError, match=r"global batch size \(6\).*micro batch size \(4\)"):
        ConstantNumMicroBatches(6, 4, 1)


def _closed_form_gbs(consumed: int, start: int, incr: int, ramp: int, gbs: int) -> int:
    if consumed > ramp or ramp == 0:
        return gbs
    samples_per_increment = ramp / ((gbs - start) // incr)
    return start + incr * int(consumed // samples_per_increment)


def test_rampup_sequence_matches_closed_form():
    # 4 -> 12 in steps of 2 over 120 samples: one increment every 30 samples.
    calc = RampupBatchsizeNumMicroBatches(4, 2, 120, 12, micro_batch_size=2, data_parallel_size=1)
    consumed, seen = 0, []
    for _ in range(40):
        calc.update(consumed, consistency_check=True)
        gbs = calc.get_current_global_batch_size()
        assert gbs == _closed_form_gbs(consumed, 4, 2, 120, 12)
        assert calc.get() == gbs // 2
        seen.append(gbs)
        consumed += gbs
    # Hand-checked prefix: 0,4,...,28 -> 4; 32,38,44,50,56 -> 6; 62,70,78,86 -> 8; 94,... -> 10
    assert seen[:8] == [4] * 8
    assert seen[8:13] == [6] * 5
    assert seen[13:17] == [8] * 4
    assert seen[17] == 10
    assert seen[-1] == 12


def test_rampup_megatron_example():
    # --rampup-batch-size 16 8 300000 --global-batch-size 1024: 126 increments.
    calc = RampupBatchsizeNumMicroBatches(16, 8, 300_000, 1024, 1, 1)
    assert calc.get_current_global_batch_size() == 16
    calc.update(150_000, False)
    assert calc.get_current_global_batch_size() == 16 + 8 * int(150_000 / (300_000 / 126))
    calc.update(300_001, False)
    assert calc.get_current_global_batch_size() == 1024


def test_rampup_consistency_check():
    calc = RampupBatchsizeNumMicroBatches(4, 2, 120, 12, micro_batch_size=4, data_parallel_size=1)
    calc.update(30, consistency_check=False)  # gbs 6 is not a multiple of 4: allowed unchecked
    assert calc.get_current_global_batch_size() == 6 and calc.get() == 1
    with pytest.raises(ValueError, match=r"current global batch size \(6\)"):
        calc.update(30, consistency_check=True)


@pytest.mark.parametrize("rampup,match", [
    ([4, 5, 100], "divisible by global batch size increment"),
    ([20, 4, 100], "exceeds global batch size"),
    ([4, 4], "expected the following format"),
])
def test_bad_rampup_arguments(rampup, match):
    with pytest.raises(ValueError, match=match):
        build_num_microbatches_calculator(0, rampup, 16, 1, 1)


def test_build_prints_on_rank_zero_only(capsys):
    calc = build_num_microbatches_calculator(0, None, 8, 2, 2)
    assert isinstance(calc, ConstantNumMicroBatches) and calc.get() == 2
    assert "setting number of micro-batches to constant 2" in capsys.readouterr().out
    calc = build_num_microbatches_calculator(1, ["4", "4", "16"], 12, 1, 1)
    assert isinstance(calc, RampupBatchsizeNumMicroBatches)
    assert capsys.readouterr().out == ""


def _iters_brute_force(train_samples: int, rampup: list, gbs: int) -> int:
    """Run the loop one iteration at a time, counting only whole batches that fit."""
    start, incr, ramp = rampup
    consumed = iterations = 0
    while True:
        batch = _closed_form_gbs(consumed, start, incr, ramp, gbs)
        if consumed + batch > train_samples:
            return iterations
        consumed += batch
        iterations += 1


_VALID_RAMPS = [(start, incr, ramp, gbs)
                for start, incr, ramp, gbs in itertools.product([2, 4], [2, 6], [0, 24, 250], [14, 26])
                if (gbs - start) % incr == 0]


@pytest.mark.parametrize("start,incr,ramp,gbs", _VALID_RAMPS)
def test_train_iters_for_samples_vs_brute_force(start, incr, ramp, gbs):
    for train_samples in (ramp + 3 * gbs, ramp + 3 * gbs + 5, 5 * ramp + 100):
        expected = _iters_brute_force(train_samples, [start, incr, ramp], gbs)
        assert get_train_iters_for_samples(train_samples, [start, incr, ramp], gbs) == expected


def test_train_iters_inside_the_ramp_keeps_megatron_overshoot():
    # 4 -> 12 by 4 over 16 samples; batches 4, 4, 8 reach 16 <= 16, so Megatron starts one more
    # (of 12) although 20 train samples only leave room for 4: 4 iterations, not 3.
    assert get_train_iters_for_samples(20, [4, 4, 16], 12) == 4
    assert _iters_brute_force(20, [4, 4, 16], 12) == 3


def test_train_iters_without_rampup():
    assert get_train_iters_for_samples(1000, None, 64) == 15
