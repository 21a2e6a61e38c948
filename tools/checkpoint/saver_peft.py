"""`--saver peft` (with --loader lora or peft): the adapters as an HF PEFT LoRA adapter directory.

    adapter_config.json          peft_type LORA, r, lora_alpha, lora_dropout, target_modules (q_proj, k_proj,
                                 v_proj, o_proj, gate_proj, up_proj, down_proj as adapted), base_model_name_or_path
    adapter_model.safetensors    base_model.model.model.layers.{i}.<module>.lora_{A,B}.weight
    megatron_lora_base.json      ours: the base the adapters were trained on (loader_peft reads it back)

peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), DIR) loads it; the names are
those of LlamaForCausalLM (Llama, Mistral, Qwen2 bases; megatron/convert/lora.py). The verification reads
the directory back and merges it into the base again.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch

from megatron.convert.lora import from_peft, hf_config_of, merged, to_peft
from megatron.convert.megatron_format import Metadata
from megatron.training.checkpoint_safety import CheckpointError
from tools.checkpoint.lora_common import (
    PEFT_BASE, PEFT_CONFIG, PEFT_WEIGHTS, base_from_pointer, read_peft, write_json,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="PEFT saver")
    group.add_argument("--peft-base-model", type=str, default=None,
                       help="base_model_name_or_path to write (default: the base's transformers directory when "
                            "it is one, else empty).")


def save_checkpoint(meta: Metadata, tensors: Iterator[Tuple[str, torch.Tensor]], args: argparse.Namespace,
                    save_dir: str) -> None:
    import os

    from megatron.core.atomic_io import atomic_write
    from safetensors.torch import save

    if meta.lora is None:
        raise CheckpointError("--saver peft writes adapters: use it with --loader lora or --loader peft")
    base_model = args.peft_base_model if args.peft_base_model is not None else meta.lora.base.get("load_hf", "")
    config, weights = to_peft(meta.lora, hf_config_of(meta.args, meta.true_vocab_size), base_model)
    blob = save(weights, metadata={"format": "pt"})
    atomic_write(os.path.join(save_dir, PEFT_WEIGHTS), lambda f: f.write(blob))
    write_json(os.path.join(save_dir, PEFT_CONFIG), config)
    write_json(os.path.join(save_dir, PEFT_BASE), {"base": meta.lora.base, "lora": meta.lora.settings})
    print(f"wrote {len(weights)} LoRA tensors for {', '.join(config['target_modules'])} (r {config['r']}, "
          f"lora_alpha {config['lora_alpha']})", flush=True)


def read_back(save_dir: str):
    """The base merged with the adapters read back from the PEFT files (for the verification)."""
    config, tensors, recorded = read_peft(save_dir)
    meta, stream = base_from_pointer(recorded, f"the PEFT export {save_dir}")
    adapters = from_peft(config, tensors, hf_config_of(meta.args, meta.true_vocab_size), save_dir)
    return meta.args, merged(stream, adapters)
