"""Run args for unit tests: what a validated Namespace holds, without a command line.

run_args(**values)      the parser's defaults (every flag's dest, rank 0 of 1, RUN_STATE) with
                        `values` over them
architecture_defaults() the parser's defaults of the fields ModelArchitecture reads (and
                        --group-query-attention), to complete a hand-made Namespace
"""

import argparse
import dataclasses
import functools

from megatron.training.arguments import build_parser
from megatron.training.config.container import RUN_STATE
from megatron.training.config.architecture import ModelArchitecture


@functools.lru_cache(maxsize=1)
def _defaults() -> dict:
    return dict(vars(build_parser().parse_args([])), rank=0, world_size=1, **RUN_STATE)


def run_args(**values) -> argparse.Namespace:
    return argparse.Namespace(**{**_defaults(), **values})


def architecture_defaults() -> dict:
    names = [f.name for f in dataclasses.fields(ModelArchitecture)] + ["group_query_attention"]
    return {name: _defaults()[name] for name in names}
