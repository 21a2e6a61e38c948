"""LoRA adapters in the converter: our adapter-only checkpoints, merging, and HF PEFT's format.

    ours (megatron/core/tensor_parallel/lora.py)         PEFT, LlamaForCausalLM (Llama, Mistral, Qwen2)
    L.self_attention.linear_qkv.adapter.linear_in  A     model.layers.i.self_attn.{q,k,v}_proj.lora_A: A each
    L.self_attention.linear_qkv.adapter.linear_out B     ...{q,k,v}_proj.lora_B: B's rows of the q, k, v heads
                                                         (the grouped [ng, np/ng q + k + v, hn] rows split)
    L.self_attention.linear_proj.adapter.*               ...self_attn.o_proj.lora_{A,B}
    L.mlp.linear_fc1.adapter.linear_in / linear_out      ...mlp.{gate,up}_proj.lora_A: A each; lora_B: B's
                                                         [gate ; up] halves
    L.mlp.linear_fc2.adapter.*                           ...mlp.down_proj.lora_{A,B}
    file keys                                            base_model.model.<module>.lora_{A,B}.weight
    adapter_config.json                                  r = rank, lora_alpha = alpha (scaling alpha / r in
                                                         both), lora_dropout, target_modules, peft_type LORA

A fused layer's one A feeds all its pieces, so the export is exact. On import the q/k/v (gate/up)
adapters must share one lora_A (as an export does) to become our rank-r adapter; independently trained
ones make one rank-k r adapter of the fused layer (A stacked, B block-diagonal: the same product), which
merges exactly (--loader peft with a full-model saver) but is refused as adapters (--saver lora / peft).
rsLoRA, DoRA, per-module ranks or alphas and adapted biases are refused.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Tuple

import torch

from megatron.training.checkpoint_safety import CheckpointError

IN, OUT = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
PEFT_PREFIX = "base_model.model."
PEFT_FAMILIES = ("llama", "mistral", "qwen2")
_BASE_OF = re.compile(r"^(.*\.(linear_qkv|linear_proj|linear_fc1|linear_fc2))\.adapter\.linear_(in|out)\.weight$")


@dataclass
class Adapters:
    """Whole adapter tensors under our names, the LoRA settings, and the base they were trained on."""

    settings: Dict[str, Any]  # rank, alpha, dropout, target_modules (lora_base.json's "lora")
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    base: Dict[str, Any] = field(default_factory=dict)  # lora_base.json's "base"

    @property
    def scaling(self) -> float:
        return float(self.settings["alpha"]) / int(self.settings["rank"])

    def layers(self) -> List[str]:
        """The adapted base layers (prefixes such as decoder.layers.0.self_attention.linear_qkv)."""
        return sorted({name[: -len(IN)] for name in self.tensors if name.endswith(IN)})


def merged(tensors: Iterator[Tuple[str, torch.Tensor]], adapters: Adapters) -> Iterator[Tuple[str, torch.Tensor]]:
    """The base's whole tensors with W + (alpha / r) B A folded into each adapted weight (in fp32, cast back)."""
    pending = set(adapters.layers())
    for name, tensor in tensors:
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix in pending:
            a, b = adapters.tensors[prefix + IN].float(), adapters.tensors[prefix + OUT].float()  # [r, in], [out, r]
            if tuple(tensor.shape) != (b.shape[0], a.shape[1]):
                raise CheckpointError(f"the adapter of {prefix} is [{b.shape[0]}, r] x [r, {a.shape[1]}], its base "
                                      f"weight {list(tensor.shape)}")
            tensor = (tensor.float() + adapters.scaling * (b @ a)).to(tensor.dtype)  # [out, in]
            pending.discard(prefix)
        yield name, tensor
    if pending:
        raise CheckpointError(f"the base has no weight for the adapters of {', '.join(sorted(pending)[:3])}")


def check_rank(adapters: Adapters, what: str) -> None:
    """Every adapter of rank r (a PEFT import whose fused pieces had different lora_A is not)."""
    rank = int(adapters.settings["rank"])
    for prefix in adapters.layers():
        if adapters.tensors[prefix + IN].shape[0] != rank:
            raise CheckpointError(f"{what}: the PEFT adapter's pieces of {prefix} have different lora_A: they cannot be "
                                  f"one rank-{rank} adapter of the fused layer (merge them into the base instead: "
                                  "a full-model saver)")


def check_complete(adapters: Adapters) -> None:
    for prefix in adapters.layers():
        if prefix + OUT not in adapters.tensors:
            raise CheckpointError(f"{prefix} has an adapter A but no B")
    stray = [n for n in adapters.tensors if not _BASE_OF.match(n)]
    if stray:
        raise CheckpointError(f"not an adapter tensor: {stray[0]}")


# ------------------------------------------------------------------------------------ PEFT


def _rules(hf_config: Any) -> Dict[str, Any]:
    from megatron.convert import huggingface

    if hf_config.model_type not in PEFT_FAMILIES:
        raise CheckpointError(f"PEFT adapters are written for {', '.join(PEFT_FAMILIES)} models; this base is a "
                              f"{hf_config.model_type} model (merge the adapters into it instead)")
    return {rule.ours: rule for rule in huggingface.weight_rules(hf_config)}


def _module(hf_weight: str) -> str:
    return hf_weight[: -len(".weight")]


def to_peft(adapters: Adapters, hf_config: Any, base_model: str = "") -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """(adapter_config.json fields, adapter_model.safetensors tensors) of our adapters."""
    check_rank(adapters, "--saver peft")
    rules = _rules(hf_config)
    out: Dict[str, torch.Tensor] = {}
    targets = set()
    for prefix in adapters.layers():
        rule = rules.get(prefix + ".weight")
        if rule is None:
            raise CheckpointError(f"{prefix}.weight has no counterpart in the {hf_config.model_type} HF model")
        a, b = adapters.tensors[prefix + IN], adapters.tensors[prefix + OUT]
        for hf_name, b_piece in zip(rule.hf, rule.to_hf(b)):  # B's rows as the base weight's rows split
            module = _module(hf_name)
            targets.add(module.rsplit(".", 1)[-1])
            out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous().clone()
            out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_piece.contiguous().clone()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": int(adapters.settings["rank"]), "lora_alpha": float(adapters.settings["alpha"]),
              "lora_dropout": float(adapters.settings.get("dropout", 0.0)), "target_modules": sorted(targets),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True, "modules_to_save": None}
    return config, out


_REFUSED_CONFIG = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none"}


def from_peft(config: Dict[str, Any], tensors: Dict[str, torch.Tensor], hf_config: Any,
              where: str) -> Adapters:
    """Our adapters from a PEFT LoRA adapter (see the module docstring for what is refused)."""
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{where}: peft_type {config.get('peft_type')!r}, only LORA adapters are read")
    for key, wanted in _REFUSED_CONFIG.items():
        if config.get(key, wanted) != wanted:
            raise CheckpointError(f"{where}: {key} = {config[key]!r} is not supported (only {wanted!r})")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise CheckpointError(f"{where}: {key} (per-module ranks or alphas) is not supported")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    rules = _rules(hf_config)
    pieces = {key[len(PEFT_PREFIX):]: value for key, value in tensors.items()}
    unknown = [k for k in pieces if not re.search(r"\.lora_[AB]\.weight$", k)]
    if unknown:
        raise CheckpointError(f"{where}: {unknown[0]} is not a LoRA A/B weight")
    adapters = Adapters({"rank": rank, "alpha": alpha, "dropout": float(config.get("lora_dropout", 0.0))})
    used = set()
    targets = set()
    for ours, rule in rules.items():
        if not ours.endswith(".weight") or not _BASE_OF.match(ours[: -len(".weight")] + IN):
            continue
        modules = [_module(h) for h in rule.hf]
        present = [f"{m}.lora_A.weight" in pieces for m in modules]
        if not any(present):
            continue
        if not all(present):
            missing = [m for m, p in zip(modules, present) if not p]
            raise CheckpointError(f"{where}: {ours[:-len('.weight')]} is one fused layer here; the adapter has "
                                  f"{', '.join(m for m, p in zip(modules, present) if p)} but not {', '.join(missing)}")
        a_pieces = [pieces[f"{m}.lora_A.weight"] for m in modules]
        b_pieces = [pieces[f"{m}.lora_B.weight"] for m in modules]
        for m, a, b in zip(modules, a_pieces, b_pieces):
            if a.shape[0] != rank or b.shape[1] != rank:
                raise CheckpointError(f"{where}: {m} has rank {a.shape[0]}, adapter_config.json r {rank}")
        prefix = ours[: -len(".weight")]
        if all(torch.equal(a_pieces[0], a) for a in a_pieces[1:]):  # one A feeds the fused layer: rank r
            a, b = a_pieces[0], rule.to_ours(*b_pieces)
        else:
            # Independent A's: one adapter of rank k r with A = [A_1; ...; A_k] and B block-diagonal
            # (piece i's rows read only A_i's r outputs), the same product B A; it merges exactly, but is
            # no rank-r adapter of ours (refused by the adapter savers).
            k = len(a_pieces)
            a = torch.cat(a_pieces)  # [k r, in]
            padded = [torch.cat([b if j == i else b.new_zeros(b.shape) for j in range(k)], dim=1)
                      for i, b in enumerate(b_pieces)]  # piece i: [rows_i, k r]
            b = rule.to_ours(*padded)
        adapters.tensors[prefix + IN] = a.contiguous().clone()
        adapters.tensors[prefix + OUT] = b.contiguous().clone()
        targets.add(prefix.rsplit(".", 1)[-1])
        used.update(f"{m}.lora_{x}.weight" for m in modules for x in "AB")
    left = sorted(set(pieces) - used)
    if left:
        raise CheckpointError(f"{where}: {left[0]} adapts no layer that has a LoRA target here")
    adapters.settings["target_modules"] = [t for t in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
                                           if t in targets]
    return adapters


def hf_config_of(args: argparse.Namespace, true_vocab_size: Any) -> Any:
    """The transformers config of a checkpoint's model (its kept HF config, else built from its args)."""
    from transformers import AutoConfig

    from megatron.convert import huggingface

    kept = getattr(args, "hf_config", None)
    fields = dict(kept) if isinstance(kept, dict) else huggingface.hf_config_from_args(args, true_vocab_size)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
