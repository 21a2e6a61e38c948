"""The framework layer, as Megatron-LM names it: flags and their validation, global state,
initialization, the training loop, checkpointing, tokenizers and the rank-aware print helpers.
The only layer that knows argv; megatron/core, megatron/model and megatron/data never import it.

The names Megatron-LM's megatron/training/__init__.py gives its scripts (and Accelerate):
`from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0, ...`.
"""

from megatron.training.global_vars import (  # noqa: F401
    get_args,
    get_signal_handler,
    get_tensorboard_writer,
    get_timers,
    get_tokenizer,
    get_wandb_writer,
)
from megatron.training.initialize import initialize_megatron  # noqa: F401
from megatron.training.training import get_model, pretrain  # noqa: F401
from megatron.training.utils import is_last_rank, print_rank_0, print_rank_last  # noqa: F401
