"""Checkpoint tests' stand-ins and runs.

TinyGPT, TinyOptimizer, TinyScheduler, make_args, build: a tiny model, optimizer and scheduler with
Megatron's state-dict key names and the methods checkpointing uses, so that legacy-checkpoint tests
do not depend on megatron.model or megatron.core.optimizer (tests/unit/test_checkpointing.py).
pretrain, pretrain_error: DistributedPool tasks running pretrain_gpt.main on every rank.
"""

import argparse
from pathlib import Path

import torch
from torch import nn

from megatron.training.checkpoint_safety import CheckpointError
from tests.helpers.args import run_args


class _Layer(nn.Module):
    def __init__(self, hidden: int, ffn: int, bias: bool):
        super().__init__()
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(hidden, ffn, bias=bias)


class TinyGPT(nn.Module):
    """Megatron-like key names: embedding.word_embeddings.weight, decoder.layers.0..., ..."""

    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(args.padded_vocab_size, args.hidden_size)
        self.embedding.position_embeddings = nn.Embedding(args.max_position_embeddings,
                                                          args.hidden_size)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(
            [_Layer(args.hidden_size, args.ffn_hidden_size, args.add_bias_linear)
             for _ in range(args.num_layers)])
        self.decoder.final_layernorm = nn.LayerNorm(args.hidden_size)
        if args.untie_embeddings_and_output_weights:
            self.output_layer = nn.Linear(args.hidden_size, args.padded_vocab_size, bias=False)


class TinyOptimizer:
    def __init__(self, model: nn.Module):
        self.inner = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(self) -> None:
        self.inner.step()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)


class TinyScheduler:
    def __init__(self, max_lr: float = 1e-2):
        self.max_lr, self.num_steps = max_lr, 0

    def step(self, increment: int) -> None:
        self.num_steps += increment

    def state_dict(self):
        return {"max_lr": self.max_lr, "num_steps": self.num_steps}

    def load_state_dict(self, state_dict) -> None:
        self.max_lr, self.num_steps = state_dict["max_lr"], state_dict["num_steps"]


def make_args(directory: Path, **overrides) -> argparse.Namespace:
    """This run's args: the parser's defaults (tests.helpers.args.run_args) under a tiny GPT's shape and
    the checkpoint flags, the legacy format (--ckpt-format torch) unless overridden."""
    values = dict(ckpt_format="torch", virtual_pipeline_model_parallel_size=None,  # (validate_args sets it)
        save=str(directory), load=str(directory), no_save_optim=False, no_save_rng=False,
        no_load_optim=False, no_load_rng=False, finetune=False, use_checkpoint_args=False,
        exit_on_missing_checkpoint=False, consumed_train_samples=0, consumed_valid_samples=0,
        skipped_train_samples=0, num_layers=1, hidden_size=16, num_attention_heads=2,
        ffn_hidden_size=32, kv_channels=8, max_position_embeddings=8, padded_vocab_size=32,
        untie_embeddings_and_output_weights=False, add_bias_linear=True, seq_length=8,
        position_embedding_type="learned_absolute", openai_gelu=False, vocab_file=None,
        fp16=False, bf16=False,
    )
    values.update(overrides)
    return run_args(**values)


def build(args: argparse.Namespace, seed: int, train_steps: int = 1):
    """A model, optimizer (with Adam state after `train_steps` steps) and scheduler."""
    torch.manual_seed(seed)
    model = TinyGPT(args)
    optimizer = TinyOptimizer(model)
    scheduler = TinyScheduler()
    for _ in range(train_steps):
        loss = sum((p ** 2).sum() for p in model.parameters())
        loss.backward()
        optimizer.step()
        scheduler.step(increment=4)
    return model, optimizer, scheduler


def model_file(directory: Path, iteration: int) -> Path:
    """The legacy checkpoint file of rank 0 at `iteration` under directory."""
    return directory / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0)


def pretrain(argv):
    """Every rank: train with argv; the losses by iteration as the last rank logs them."""
    import pretrain_gpt

    try:
        result = pretrain_gpt.main(list(argv), record_history=True)
    finally:
        from megatron.training.initialize import reset_megatron

        reset_megatron()
    return {record.iteration: record.losses.get("lm loss") for record in result.history}


def pretrain_error(argv):
    """Every rank: the CheckpointError message pretrain raises (None when it trained)."""
    try:
        pretrain(argv)
    except CheckpointError as error:
        return str(error)
    return None
