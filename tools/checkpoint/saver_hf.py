"""`--saver hf`: write a transformers model directory that AutoModelForCausalLM.from_pretrained loads
(MegatronBertForPreTraining.from_pretrained for --model-type BERT, T5ForConditionalGeneration for T5).

    config.json                   the source's HF config when it came from HF (args.hf_config), else
                                  built from our args (huggingface.hf_config_from_args)
    generation_config.json        the source's, else transformers' defaults for the config (none for BERT)
    model.safetensors             the weights, or shards model-0000k-of-0000n.safetensors of at most
                                  --max-shard-size bytes each and model.safetensors.index.json
    tokenizer files               copied from --tokenizer-dir (default with --loader hf: --load-dir)

The vocabulary padding rows are dropped (HF's vocab_size rows are written); a tied model has no
lm_head.weight (as save_pretrained writes it). One shard is held in memory at a time.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from megatron.training.checkpoint_safety import CheckpointError
from megatron.convert import huggingface
from megatron.convert.hf_files import (
    ARCHITECTURE_FLAGS, CONFIG, DEFAULT_MAX_SHARD_SIZE, GENERATION_CONFIG, HFCheckpoint, ShardWriter, _hf_config,
    args_from_hf, copy_tokenizer, hf_arg_values, parse_size, write_json,
)
from megatron.convert.layout_rules import is_vocab_tensor
from megatron.convert.megatron_format import Metadata
from megatron.convert.t5 import T5_ARGS


# Names in the files that differ from the model's: transformers (4 and 5) writes GPT-NeoX's output
# layer under its original name, embed_out.weight (version 5 renames it lm_head.weight on load).
FILE_NAMES = {"gpt_neox": {"lm_head.weight": "embed_out.weight"}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="HuggingFace saver")
    group.add_argument("--max-shard-size", type=str, default=DEFAULT_MAX_SHARD_SIZE,
                       help="Largest safetensors shard, in HF's syntax (5GB, 500MB, 10KB; default 5GB as "
                            "transformers): more than one shard writes model.safetensors.index.json.")
    group.add_argument("--tokenizer-dir", type=str, default=None,
                       help="Copy the tokenizer files of this folder (tokenizer.json, tokenizer_config.json, "
                            "special_tokens_map.json, vocab.json, merges.txt, tokenizer.model); default with "
                            "--loader hf: the --load-dir's.")


def _hf_config_dict(meta: Metadata) -> Tuple[Dict[str, Any], bool]:
    """(config.json fields, whether they are the source's own file)."""
    kept = getattr(meta.args, "hf_config", None)
    if isinstance(kept, dict):
        return dict(kept), True
    vocab = meta.true_vocab_size
    if vocab is None:
        raise CheckpointError("the true vocabulary size is unknown (the checkpoint's padded vocabulary has "
                              f"{meta.args.padded_vocab_size} rows): pass --true-vocab-size or --vocab-file")
    try:
        return huggingface.hf_config_from_args(meta.args, vocab), False
    except ValueError as error:
        raise CheckpointError(str(error)) from None


def _write_config(fields: Dict[str, Any], kept: bool, save_dir: str) -> Any:
    """config.json under save_dir (the source's fields as they were, or transformers' own file), read back."""
    if kept:
        write_json(os.path.join(save_dir, CONFIG), fields)
    else:
        from transformers import AutoConfig

        fields = dict(fields)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        config.save_pretrained(save_dir)
    return _hf_config(save_dir)


def _check_config(config: Any, args: argparse.Namespace) -> None:
    """The HF config must describe the model of our args (a kept config.json from another model would not)."""
    derived = hf_arg_values(config)
    problems = [f"{flag} {getattr(args, dest, None)} in the checkpoint, {derived[dest]} in the HF config"
                for dest, flag in ARCHITECTURE_FLAGS.items()
                if dest in derived and getattr(args, dest, None) is not None and derived[dest] != getattr(args, dest)
                and not (dest.startswith("rotary_") and args.position_embedding_type != "rope")
                and not (dest == "num_query_groups" and not derived["group_query_attention"])
                # an MoE model with an MoE MLP in every layer (Mixtral) never uses the dense ffn size
                and not (dest == "ffn_hidden_size" and derived.get("num_experts"))
                # a router without the expert bias: HF's (NemotronH's) is written as zeros
                and not (dest == "moe_router_enable_expert_bias" and not getattr(args, dest))
                # groups that keep every group: HF's n_group = topk_group = 1, the same routing
                and not (dest in ("moe_router_num_groups", "moe_router_group_topk") and derived[dest] is None
                         and (getattr(args, "moe_router_group_topk", None) or 0)
                         >= (getattr(args, "moe_router_num_groups", None) or 0))
                and dest != "openai_gelu"]  # compared as the GeLU computed, below
    if derived.get("t5_activation") is not None:  # T5: its own args (megatron/convert/t5.py)
        problems += [f"{dest} {getattr(args, dest, None)} in the checkpoint, {derived[dest]} in the HF config"
                     for dest in T5_ARGS if getattr(args, dest, None) != derived[dest]]
    ours, theirs = huggingface.computes_tanh_gelu(vars(args)), huggingface.computes_tanh_gelu(derived)
    if not getattr(args, "swiglu", False) and derived.get("t5_activation") is None and ours != theirs:
        names = {True: "the tanh GeLU", False: "the erf GeLU"}
        problems.append(f"the checkpoint's model computes {names[ours]} (--openai-gelu "
                        f"{getattr(args, 'openai_gelu', False)}, --bias-gelu-fusion "
                        f"{getattr(args, 'bias_gelu_fusion', True)}), the HF config {names[theirs]}")
    if problems:
        raise CheckpointError("the HF config does not describe the checkpoint's model: " + "; ".join(problems))


def _generation_config(meta: Metadata, config: Any) -> Optional[Dict[str, Any]]:
    """The source's generation config, else transformers' defaults; None for BERT (it generates nothing)."""
    kept = getattr(meta.args, "hf_generation_config", None)
    if isinstance(kept, dict):
        return dict(kept)
    if huggingface.ARCHITECTURES[config.model_type].family == "BERT":
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(config).to_diff_dict()


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor with its own storage (safetensors refuses tensors that share memory)."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def save_checkpoint(meta: Metadata, tensors: Iterator[Tuple[str, torch.Tensor]], args: argparse.Namespace,
                    save_dir: str) -> None:
    """Write the stream as a transformers directory under save_dir (a new, empty folder)."""
    max_bytes = parse_size(args.max_shard_size)
    tokenizer_dir = args.tokenizer_dir
    if tokenizer_dir is None and getattr(args, "loader", None) == "hf":
        tokenizer_dir = args.load_dir if HFCheckpoint(args.load_dir).tokenizer_files() else None
    fields, kept = _hf_config_dict(meta)
    config = _write_config(fields, kept, save_dir)
    _check_config(config, meta.args)
    vocab = int(config.vocab_size)
    if meta.true_vocab_size is not None and meta.true_vocab_size != vocab:
        raise CheckpointError(f"the true vocabulary size is {meta.true_vocab_size} but the HF config's "
                              f"vocab_size is {vocab}")
    if tokenizer_dir is not None:
        copied = copy_tokenizer(tokenizer_dir, save_dir)
        print(f"copied the tokenizer files {', '.join(copied)} from {tokenizer_dir}", flush=True)
    generation_config = _generation_config(meta, config)
    if generation_config is not None:
        write_json(os.path.join(save_dir, GENERATION_CONFIG), generation_config)
    rules = {rule.ours: rule for rule in huggingface.weight_rules(config)}
    print(f"saving a {config.model_type} model ({huggingface.ARCHITECTURES[config.model_type].name}) to "
          f"{save_dir}, shards of at most {max_bytes} bytes", flush=True)
    writer, seen = ShardWriter(save_dir, max_bytes), set()
    file_names = FILE_NAMES.get(config.model_type, {})
    for name, tensor in tensors:
        rule = rules.get(name)
        if rule is None:
            raise CheckpointError(f"{name} has no counterpart in the {config.model_type} HF model")
        if name in seen:
            raise CheckpointError(f"the loader sent {name} twice")
        seen.add(name)
        if is_vocab_tensor(name):
            if tensor.shape[0] < vocab:
                raise CheckpointError(f"{name} has {tensor.shape[0]} rows, fewer than vocab_size {vocab}")
            tensor = tensor[:vocab]  # the padding rows are Megatron's, not the model's
        for hf_name, hf_tensor in zip(rule.hf, rule.to_hf(tensor)):
            writer.add(file_names.get(hf_name, hf_name), _own(hf_tensor))
    for name in sorted(set(rules) - seen):
        rule = rules[name]
        if rule.absent is not None:  # a feature the model was trained without: HF's constant (a zero bias)
            seen.add(name)
            for hf_name, hf_tensor in zip(rule.hf, rule.absent()):
                writer.add(file_names.get(hf_name, hf_name), _own(hf_tensor))
    missing = sorted(set(rules) - seen)
    if missing:
        raise CheckpointError(f"the loader sent no {', '.join(missing[:4])} ({len(missing)} tensors missing)")
    files = writer.finish()
    print(f"wrote {len(files)} weight file(s): {', '.join(files[:3])}{' ...' if len(files) > 3 else ''}", flush=True)


def read_back(save_dir: str) -> Tuple[argparse.Namespace, Iterator[Tuple[str, torch.Tensor]]]:
    """What was saved, as our args and whole tensors (for the verification)."""
    checkpoint = HFCheckpoint(save_dir)
    model_args = args_from_hf(checkpoint)
    return model_args, checkpoint.stream(int(model_args.padded_vocab_size))
