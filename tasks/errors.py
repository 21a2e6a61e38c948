"""The tasks' user-input error: its message names the flag, or the FILE:LINE of a bad record.

tasks/main.py (through megatron.training.cli.run_cli, whose USER_INPUT_ERRORS lists it) prints it as one
line and exits with status 1.
"""


class TaskError(ValueError):
    """Bad task input: an unknown --task, a missing or malformed --train-data / --valid-data file."""
