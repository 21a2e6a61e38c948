"""Process-wide state of a training run: args, tokenizer, timers, writers, micro-batch calculator.

Only the training framework (training.py, the entry points, checkpointing) reads these;
megatron/core and megatron/model take explicit configs. set_global_variables() is called once
by initialize_megatron(); unset_global_variables() lets one process run several trainings
(tests, notebooks).
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from megatron.core.num_microbatches_calculator import (  # noqa: F401  (the calculator is core's)
    get_current_global_batch_size,
    get_num_microbatches,
    init_num_microbatches_calculator,
    unset_num_microbatches_calculator,
    update_num_microbatches,
)
from megatron.core.timers import Timers
from megatron.core.utils import print_line

_ARGS: Optional[argparse.Namespace] = None
_TOKENIZER: Any = None
_TIMERS: Optional[Timers] = None
_TENSORBOARD_WRITER: Any = None
_WANDB_WRITER: Any = None
_SIGNAL_HANDLER: Any = None


def _ensure(value: Any, name: str) -> Any:
    if value is None:
        raise RuntimeError(f"{name} is not initialized; call megatron.training.initialize.initialize_megatron() first")
    return value


def get_args() -> argparse.Namespace:
    return _ensure(_ARGS, "args")


def get_tokenizer() -> Any:
    return _ensure(_TOKENIZER, "tokenizer")


_TOKENIZERS_OF_ARGS: dict = {}


def get_tokenizer_or_build() -> Any:
    """The global tokenizer; when none was built (Accelerate 1.16 initializes Megatron with
    build_tokenizer=False, yet its GPTTrainStep, megatron_generate and indexed datasets need one),
    the one the global args describe, built once, on a copy of the args (building one sets
    padded_vocab_size, which Accelerate computes itself). Raises ArgsError (a one-line message)
    when the args name no vocabulary."""
    if _TOKENIZER is not None:
        return _TOKENIZER
    args = get_args()
    key = tuple(str(getattr(args, name)) for name in
                ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size"))
    if key not in _TOKENIZERS_OF_ARGS:
        import copy

        from megatron.training.tokenizer import build_tokenizer

        _TOKENIZERS_OF_ARGS[key] = build_tokenizer(copy.copy(args))
    return _TOKENIZERS_OF_ARGS[key]


def get_timers() -> Timers:
    return _ensure(_TIMERS, "timers")


def get_tensorboard_writer() -> Any:
    """The SummaryWriter on the last rank when --tensorboard-dir is set, else None."""
    return _TENSORBOARD_WRITER


def get_wandb_writer() -> Any:
    """The wandb module (after wandb.init) on the last rank when --wandb-project is set, else None."""
    return _WANDB_WRITER


def get_signal_handler() -> Any:
    return _SIGNAL_HANDLER


def set_args(args: argparse.Namespace) -> None:
    global _ARGS
    _ARGS = args


def set_global_variables(args: argparse.Namespace, build_tokenizer: bool = True) -> None:
    """Set args, the micro-batch calculator, tokenizer, timers and the writers from args. Without
    build_tokenizer (Accelerate's initialize) there is no tokenizer afterwards: one built for earlier
    args (a previous run in the same process) would not describe these."""
    global _TOKENIZER, _TIMERS
    set_args(args)
    init_num_microbatches_calculator(
        args.rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
        args.data_parallel_size)
    if build_tokenizer:
        from megatron.training.tokenizer import build_tokenizer as _build

        _TOKENIZER = _build(args)
    else:
        _TOKENIZER = None
    _TIMERS = Timers(args.timing_log_level)
    _set_tensorboard_writer(args)
    _set_wandb_writer(args)
    _set_signal_handler(args)


def _set_tensorboard_writer(args: argparse.Namespace) -> None:
    global _TENSORBOARD_WRITER
    if not args.tensorboard_dir or args.rank != args.world_size - 1:
        return
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise RuntimeError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from exc
    print_line("> setting tensorboard ...")
    _TENSORBOARD_WRITER = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)


def _set_wandb_writer(args: argparse.Namespace) -> None:
    global _WANDB_WRITER
    if not args.wandb_project or args.rank != args.world_size - 1:
        return
    try:
        import wandb
    except ImportError as exc:
        raise RuntimeError("--wandb-project needs the wandb package: pip install wandb") from exc
    save_dir = args.wandb_save_dir or (f"{args.save}/wandb" if args.save else None)
    wandb.init(dir=save_dir, name=args.wandb_exp_name, project=args.wandb_project, config=vars(args))
    _WANDB_WRITER = wandb


def _set_signal_handler(args: argparse.Namespace) -> None:
    global _SIGNAL_HANDLER
    if args.exit_signal_handler:
        from megatron.training.dist_signal_handler import DistributedSignalHandler

        _SIGNAL_HANDLER = DistributedSignalHandler().__enter__()


def unset_global_variables() -> None:
    """Forget every global (closing the writers and restoring the signal handler)."""
    global _ARGS, _TOKENIZER, _TIMERS, _TENSORBOARD_WRITER, _WANDB_WRITER, _SIGNAL_HANDLER
    if _TENSORBOARD_WRITER is not None:
        _TENSORBOARD_WRITER.close()
    if _WANDB_WRITER is not None:
        _WANDB_WRITER.finish()
    if _SIGNAL_HANDLER is not None:
        _SIGNAL_HANDLER.__exit__(None, None, None)
    unset_num_microbatches_calculator()
    _ARGS = _TOKENIZER = _TIMERS = _TENSORBOARD_WRITER = _WANDB_WRITER = _SIGNAL_HANDLER = None
    _TOKENIZERS_OF_ARGS.clear()
