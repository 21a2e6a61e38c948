"""The log line's prefix and throughput field, the progress line's single write, and loader workers
under --exit-signal-handler.

End to end under torchrun: tests/functional/test_torchrun_logs_and_signals.py.
"""

import re
import signal

import torch
from torch.utils.data import Dataset

from megatron.core import utils
from megatron.data.data_samplers import build_pretraining_data_loader
from megatron.training.training_log import Progress, format_log_line

FIELDS = dict(iteration=10, train_iters=100, consumed_samples=80, ms_per_iteration=12.5, tflops_per_gpu=0.0,
              learning_rate=1e-3, global_batch_size=8, losses={"lm loss": 5.0}, loss_scale=1.0, grad_norm=1.5,
              num_zeros_in_grad=None, params_norm=None, skipped=0, nan=0)


class Writes:
    """A stream that records each write call."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        pass


def test_log_line_starts_with_megatron_s_local_time_prefix():
    line = format_log_line(**FIELDS, now="2025-06-01 12:34:56")
    assert line.startswith(" [2025-06-01 12:34:56] iteration       10/     100 | consumed samples:           80 |")
    assert re.match(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration       10/", format_log_line(**FIELDS))


def test_progress_is_one_write_of_one_whole_line_on_the_last_rank_only(monkeypatch):
    stream = Writes()
    progress = Progress(0, 100, stream=stream)
    progress.report(10)  # one process: the last rank
    assert len(stream.writes) == 1 and stream.writes[0].endswith(" it/s\n") and stream.writes[0].count("\n") == 1
    assert stream.writes[0].startswith("progress: 10/100 iterations (10.0%) | elapsed ")
    monkeypatch.setattr(utils, "get_world_size_safe", lambda: 4)  # now rank 0 of 4
    progress.report(20)
    assert len(stream.writes) == 1


def test_print_helpers_write_text_and_newline_at_once(monkeypatch):
    writes = Writes()
    monkeypatch.setattr("sys.stdout", writes)
    utils.print_rank_last("a log line")
    utils.print_rank_0("a start-up line")
    assert writes.writes == ["a log line\n", "a start-up line\n"]


class Dispositions(Dataset):
    """Each sample: 1 when this process ignores SIGTERM."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.tensor(int(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN))


def test_loader_workers_ignore_sigterm_only_under_the_exit_signal_handler():
    for ignore in (True, False):
        loader = build_pretraining_data_loader(Dispositions(), 0, micro_batch_size=2, data_parallel_rank=0,
                                               data_parallel_size=1, num_workers=1, workers_ignore_sigterm=ignore)
        assert next(iter(loader)).tolist() == [int(ignore)] * 2, ignore
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_IGN  # the training process keeps its handler


def test_throughput_shows_three_significant_digits_below_one_tflops():
    """Megatron's '{:.1f}' read 0.0 for every CPU run; below 1 TFLOP/s the field now has three
    significant digits, as a plain decimal that float() and a '[\\d.]+' pattern both read."""
    def field(tflops):
        line = format_log_line(**{**FIELDS, "tflops_per_gpu": tflops}, now="2025-06-01 12:34:56")
        return re.search(r"\| throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \| learning rate", line).group(1)

    assert field(123.456) == "123.5" and field(1.0) == "1.0"  # Megatron's format, unchanged
    assert field(0.5) == "0.500" and field(0.0123456) == "0.0123"
    assert field(0.000123456) == "0.000123" and float(field(0.000123456)) == 0.000123
    assert field(4.5e-9) == "0.00000000450"
    assert field(0.0) == "0.0"
