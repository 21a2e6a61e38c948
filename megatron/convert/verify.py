"""Does a converted checkpoint compute what its source did? Logits of both, on CPU, at TP = 1.

Each side's stream of whole tensors (megatron_format.read_tensors) fills a TP = 1, PP = 1 GPTModel
built from that side's args in fp32 without dropout; both run on the same fixed token sequences
(drawn from a seeded generator over the true vocabulary) and their logits over the true vocabulary
are compared: max |difference| <= tolerance x max(1, max |source logit|). A conversion only
reorders rows, so the logits agree to rounding; a wrong mapping (Q and K rows swapped, gate and up
exchanged, layers out of order) moves them by far more than the tolerance.

BERT (args.model_family "BERT"): the models are BertModels, run with a padding mask (the second
sequence ends early) and both token types; the MLM logits are compared at the real positions and
the binary-head logits as they are (model_logits returns the two concatenated per sequence).

T5 (args.model_family "T5"): T5Models built by megatron/convert/t5.py's t5_transformer_config_kwargs
and t5_model_kwargs from the args; the encoder reads the sequences (the second ends early: padding
after), the decoder the same tokens reversed; the decoder's logits are compared.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from dataclasses import dataclass
from typing import Iterable, Tuple

import torch

from megatron.training.checkpoint_safety import CheckpointError

TOLERANCE = 1e-5
NUM_SEQUENCES, SEQUENCE_LENGTH, SEED = 2, 16, 1234


@dataclass(frozen=True)
class Comparison:
    max_difference: float
    scale: float
    tolerance: float
    shape: Tuple[int, ...]  # the logits compared
    tokens: int  # per sequence
    what: str = "logits"  # BERT: "MLM + binary-head logits"

    @property
    def ok(self) -> bool:
        return self.max_difference <= self.tolerance * self.scale

    def describe(self) -> str:
        verdict = "OK" if self.ok else "MISMATCH"
        return (f"verification: {NUM_SEQUENCES} sequences of {self.tokens} tokens, {self.what} over "
                f"{self.shape[-1]} ids: max |difference| {self.max_difference:.3g}, tolerance "
                f"{self.tolerance:g} x {self.scale:.3g} -> {verdict}")


def build_serial_model(args: argparse.Namespace, tensors: Iterable[Tuple[str, torch.Tensor]]) -> torch.nn.Module:
    """A TP = 1, PP = 1 fp32 GPTModel of `args`' shape holding the streamed whole tensors (strict)."""
    from megatron.training.arguments import core_transformer_config_from_args, gpt_model_kwargs
    from megatron.model import GPTModel

    serial = copy.deepcopy(args)
    serial.tensor_model_parallel_size = serial.pipeline_model_parallel_size = 1
    serial.expert_model_parallel_size, serial.expert_tensor_parallel_size = 1, None  # experts numbered globally
    serial.virtual_pipeline_model_parallel_size = None
    serial.sequence_parallel = False
    serial.hidden_dropout = serial.attention_dropout = 0.0
    serial.fp16 = serial.bf16 = False
    serial.params_dtype = torch.float32
    serial.perform_initialization = False
    serial.recompute_granularity = serial.recompute_method = serial.recompute_num_layers = None
    config = core_transformer_config_from_args(serial)
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    if is_t5(args):
        from megatron.convert.t5 import t5_model_kwargs, t5_transformer_config_kwargs
        from megatron.model.t5_model import T5Model

        config = dataclasses.replace(config, **t5_transformer_config_kwargs(args))
        model = T5Model(config, vocab_size=int(args.padded_vocab_size), **t5_model_kwargs(args))
        _fill(model, tensors)
        return model.eval()
    if is_bert(args):
        from megatron.model import BertModel

        binary_head = bool(getattr(args, "bert_binary_head", True))
        model = BertModel(config, vocab_size=int(args.padded_vocab_size),
                          max_sequence_length=int(args.max_position_embeddings),
                          num_tokentypes=2 if binary_head else 0, add_binary_head=binary_head,
                          share_embeddings_and_output_weights=tied,
                          post_layernorm=bool(getattr(args, "bert_post_layernorm", False)))
        _fill(model, tensors)
        return model.eval()
    if getattr(args, "is_hybrid_model", False):  # pretrain_mamba.py's MambaModel
        from megatron.model.mamba import MambaModel
        from megatron.training.config_builders import mamba_model_kwargs

        model = MambaModel(config, vocab_size=int(args.padded_vocab_size),
                           max_sequence_length=int(args.max_position_embeddings),
                           share_embeddings_and_output_weights=tied, **mamba_model_kwargs(serial))
        _fill(model, tensors)
        return model.eval()
    model = GPTModel(config, vocab_size=int(args.padded_vocab_size),
                     max_sequence_length=int(args.max_position_embeddings),
                     share_embeddings_and_output_weights=tied, **gpt_model_kwargs(serial))
    _fill(model, tensors)
    return model.eval()


def _fill(model: torch.nn.Module, tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
    """Copy each streamed tensor into its parameter or buffer as it arrives (strict: every key once,
    same shapes), so that only one streamed tensor is held besides the model."""
    slots = model.state_dict(keep_vars=True)
    missing = dict(slots)
    unexpected, wrong = [], []
    with torch.no_grad():
        for name, tensor in tensors:
            slot = missing.pop(name, None)
            if slot is None:
                unexpected.append(name)
            elif slot.shape != tensor.shape:
                wrong.append(f"{name}: {tuple(tensor.shape)} for {tuple(slot.shape)}")
            else:
                slot.copy_(tensor)
            del tensor
    problems = [f"missing {sorted(missing)[:4]}" if missing else "",
                f"unexpected {unexpected[:4]}" if unexpected else "", f"shapes {wrong[:4]}" if wrong else ""]
    if any(problems):
        raise CheckpointError("the tensors do not fit the model of the checkpoint's args: "
                              + "; ".join(p for p in problems if p))


def serial_logits(args: argparse.Namespace, tensors: Iterable[Tuple[str, torch.Tensor]],
                  tokens: torch.Tensor) -> torch.Tensor:
    """The logits of the TP = 1 model of `args` holding the streamed tensors; the model is freed after."""
    model = build_serial_model(args, tensors)
    logits = logits_of(model, tokens)
    del model
    return logits


def sample_tokens(vocab: int, max_length: int) -> torch.Tensor:
    """The fixed token sequences [b, s] both models see."""
    generator = torch.Generator().manual_seed(SEED)
    length = min(SEQUENCE_LENGTH, max_length)
    return torch.randint(0, vocab, (NUM_SEQUENCES, length), generator=generator)


def is_bert(args: argparse.Namespace) -> bool:
    return getattr(args, "model_family", "GPT") == "BERT"


def is_t5(args: argparse.Namespace) -> bool:
    return getattr(args, "model_family", "GPT") == "T5"


def bert_inputs(tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(padding_mask, tokentype_ids) [b, s] for the fixed sequences: the last one ends at 3/4 of
    its length (padding after), each sequence's second half is token type 1."""
    b, s = tokens.shape
    padding_mask = torch.ones(b, s, dtype=torch.long)
    padding_mask[-1, (3 * s) // 4:] = 0
    types = (torch.arange(s) >= s // 2).long().unsqueeze(0).expand(b, s) * padding_mask
    return padding_mask, types


@torch.no_grad()
def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    from megatron.model import BertModel, T5Model

    if isinstance(model, T5Model):
        from megatron.model.t5_model import t5_attention_masks

        padding_mask, _ = bert_inputs(tokens)  # [b, s]: the last sequence padded after 3/4
        decoder_tokens = tokens.flip(1)  # [b, s]
        masks = t5_attention_masks(padding_mask, torch.ones_like(decoder_tokens))
        return model(tokens * padding_mask, decoder_tokens, *masks).float()  # [b, s, v]
    if isinstance(model, BertModel):
        padding_mask, types = bert_inputs(tokens)
        lm_logits, binary_logits = model(tokens, padding_mask, tokentype_ids=types)  # [b, s, v], [b, 2] or None
        lm_logits = lm_logits.float() * padding_mask.unsqueeze(-1)  # padding queries: not the model's output
        if binary_logits is None:
            return lm_logits
        # [b, s + 1, v]: the binary logits as one more "position" (zeros past its 2 columns).
        extra = lm_logits.new_zeros(lm_logits.shape[0], 1, lm_logits.shape[-1])
        extra[:, 0, :2] = binary_logits.float()
        return torch.cat([lm_logits, extra], dim=1)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)  # [b, s]
    return model(tokens, positions).float()


def compare(source: torch.nn.Module, target: torch.nn.Module, vocab: int, max_length: int,
            tolerance: float = TOLERANCE) -> Comparison:
    """Logits of both models on the fixed sequences, over the first `vocab` ids (the true vocabulary)."""
    tokens = sample_tokens(vocab, max_length)
    return compare_logits(logits_of(source, tokens), logits_of(target, tokens), vocab, tolerance)


def compare_logits(source: torch.Tensor, target: torch.Tensor, vocab: int,
                   tolerance: float = TOLERANCE) -> Comparison:
    """Compare two models' logits [b, s, >= vocab] on the fixed sequences over the first `vocab` ids."""
    a, b = source[..., :vocab], target[..., :vocab]
    if a.shape != b.shape:
        return Comparison(float("inf"), 1.0, tolerance, tuple(a.shape), a.shape[1])
    scale = max(1.0, a.abs().max().item())
    return Comparison((a - b).abs().max().item(), scale, tolerance, tuple(a.shape), a.shape[1])
