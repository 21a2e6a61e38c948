"""`--loader hf`: a transformers model directory (GPT-2, Llama, Mistral, Qwen2, GPT-NeoX causal LMs;
MegatronBertForPreTraining with --model-type BERT, T5ForConditionalGeneration with --model-type T5).

config.json gives the model (megatron/convert/hf_files.args_from_hf: our training args at TP = 1,
PP = 1, the vocabulary padded as Megatron pads it); the weights come from model.safetensors, its
sharded form with model.safetensors.index.json, or pytorch_model.bin (sharded or not, read through
the allow-listed unpickler only). Tensors are mapped by megatron/convert/huggingface.weight_rules
and streamed one at a time in our canonical order, each read from the files only when it is sent.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch

from megatron.convert.hf_files import HFCheckpoint, args_from_hf
from megatron.convert.megatron_format import Metadata


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group(title="HuggingFace loader (--load-dir: a transformers model directory)")


def load_checkpoint(args: argparse.Namespace) -> Tuple[Metadata, Iterator[Tuple[str, torch.Tensor]]]:
    """(metadata, our whole tensors one at a time) of the transformers directory args.load_dir."""
    checkpoint = HFCheckpoint(args.load_dir)
    checkpoint.rules()  # refuse missing or unknown tensors before anything is written
    model_args = args_from_hf(checkpoint)
    meta = Metadata(model_args, iteration=0, release=True, true_vocab_size=int(checkpoint.config.vocab_size))
    return meta, checkpoint.stream(int(model_args.padded_vocab_size))
