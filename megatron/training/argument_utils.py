"""The error class and flag spelling shared by the argument modules (arguments, arguments_validation,
arguments_model, arguments_megatron). A leaf module: each of them imports it at the top, so none
of them needs to import another one's error class from inside a function."""


class ArgsError(ValueError):
    """A bad command line: the message names the flag(s) involved and what to do."""


def flag(dest: str) -> str:
    """'micro_batch_size' -> '--micro-batch-size'."""
    return "--" + dest.replace("_", "-")
