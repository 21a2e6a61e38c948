"""--calculate-per-token-loss reaches the model config that DistributedDataParallel reads; the
combinations that would normalise gradients twice (or not at all) are refused; library code
reads typed config fields, never getattr(config, name, default) (which hid the missing field).

The numbers at DP=2 and DP=2 x TP=2 are in tests/parallel/test_per_token_loss.py.
"""

import ast
from pathlib import Path

import pytest
import torch

from megatron.training.arguments import ArgsError, core_transformer_config_from_args, parse_and_validate_args
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.model import GPTModel, TransformerConfig

ROOT = Path(__file__).resolve().parents[2]
TINY_RUN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --max-position-embeddings 8 --seq-length 8 "
            "--micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 100").split()


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_the_flag_reaches_the_model_config():
    assert core_transformer_config_from_args(parse_and_validate_args(argv=TINY_RUN)).calculate_per_token_loss is False
    args = parse_and_validate_args(argv=TINY_RUN + ["--calculate-per-token-loss"])
    assert core_transformer_config_from_args(args).calculate_per_token_loss is True


def test_averaging_in_the_collective_is_refused_with_per_token_loss():
    with pytest.raises(ArgsError, match="--ddp-average-in-collective cannot be used with --calculate-per-token-loss"):
        parse_and_validate_args(argv=TINY_RUN + ["--calculate-per-token-loss", "--ddp-average-in-collective"])
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, calculate_per_token_loss=True)
    with pytest.raises(ValueError, match="--ddp-average-in-collective cannot be used"):
        DistributedDataParallel(config, DistributedDataParallelConfig(average_in_collective=True),
                                torch.nn.Linear(2, 2))


@pytest.mark.parametrize("per_token_config", [False, True])
def test_finalize_refuses_a_normalisation_the_ddp_was_not_built_for(per_token_config):
    """DDP pre-scales by 1/DP unless its config says per-token; the schedule's flag must agree."""
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               calculate_per_token_loss=per_token_config)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(),
                                  GPTModel(config, vocab_size=16, max_sequence_length=4))
    num_tokens = None if per_token_config else torch.tensor(5)  # the schedule's flag, the other way round
    with pytest.raises(ValueError, match=f"calculate_per_token_loss={not per_token_config} but "
                                         f"DistributedDataParallel was built with config.calculate_per_token_loss="
                                         f"{per_token_config}"):
        finalize_model_grads([ddp], num_tokens)
    finalize_model_grads([ddp], torch.tensor(5) if per_token_config else None)  # agreeing: fine


def _config_getattrs_with_default(path: Path):
    """getattr(<...config...>, name, default) calls in one source file: (line, source)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) == 3 and "config" in ast.unparse(node.args[0])):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_library_code_reads_typed_config_fields():
    found = {str(path.relative_to(ROOT)): hits
             for package in ("megatron/core", "megatron/model") for path in sorted((ROOT / package).rglob("*.py"))
             if (hits := _config_getattrs_with_default(path))}
    assert not found
