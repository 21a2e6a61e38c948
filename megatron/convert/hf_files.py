"""A transformers model directory, read one tensor at a time and written one shard at a time.

    file                              role
    config.json                       the HF config (model_type, shape, RoPE, tying)
    generation_config.json            generation defaults (kept as they are)
    model.safetensors                 all weights, or
    model.safetensors.index.json      {"metadata": {"total_size": bytes}, "weight_map": {name: shard file}}
    model-0000k-of-0000n.safetensors  the shards it names
    pytorch_model.bin[.index.json]    the same as torch pickles (read through checkpoint_safety.load_file only)
    tokenizer.json, vocab.json, ...   tokenizer files (copied, never parsed here)

Reading: safetensors tensors come one at a time through safe_open (a memory map), so a rule of
megatron/convert/huggingface.py (e.g. q, k, v -> linear_qkv) costs only the tensors it names; a
.bin shard is one pickle, held whole while its tensors are used. Writing: tensors gather into one
shard of at most max_shard_size bytes (HF's rule: a tensor that would overflow starts the next
shard; one larger than the limit is a shard alone); shard k is written as soon as it is full
under a temporary name and renamed model-0000k-of-0000n once n is known.

args_from_hf gives the training args (argparse.Namespace, as pretrain_gpt.py would parse them) of
the model an HF config describes, so that the megatron saver, verify.build_serial_model and
pretrain_gpt.py treat it as one of our checkpoints' args. HF's config.json and
generation_config.json ride along in args.hf_config / args.hf_generation_config, so that HF ->
ours -> HF writes the same config back.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron.training.checkpoint_safety import CheckpointError, load_file
from megatron.convert import huggingface, mixtral
from megatron.convert import mamba2 as mamba2_convert
from megatron.convert import nemotron_h as nemotron_h_convert
from megatron.convert import t5 as t5_convert
from megatron.convert.layout_rules import is_vocab_tensor, padded_vocab_size
from megatron.core.atomic_io import atomic_write

CONFIG, GENERATION_CONFIG = "config.json", "generation_config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# chat_template.jinja / chat_template.json: where transformers >= 4.43 saves a tokenizer's chat template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(text: str) -> int:
    """HF's size syntax: 5GB = 5 x 10^9 bytes, 500MB, 10KB, 4GiB = 4 x 2^30, or a plain byte count."""
    match = _SIZE.match(str(text))
    if match is None:
        raise CheckpointError(f"--max-shard-size {text!r}: not a size (examples: 5GB, 500MB, 10KB, 1000000)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


# ----------------------------------------------------------------------------- reading


class HFCheckpoint:
    """A transformers directory: its config and its tensors by HF name, read on demand."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} is not a directory (expected a transformers model directory)")
        self.raw_config = _read_json(os.path.join(path, CONFIG), "the HF config")
        model_type = self.raw_config.get("model_type")
        if model_type not in huggingface.ARCHITECTURES:
            raise CheckpointError(f"{path}: HF model_type {model_type!r} is not supported "
                                  f"(one of {', '.join(huggingface.ARCHITECTURES)})")
        self.config = _hf_config(path)
        try:
            huggingface.config_from_hf(self.config)
        except ValueError as error:
            raise CheckpointError(f"{path}: {error}") from None
        generation = os.path.join(path, GENERATION_CONFIG)
        self.generation_config = _read_json(generation, "the generation config") if os.path.isfile(generation) else None
        self._open: Dict[str, Any] = {}  # safetensors handles by file
        self._bin: Tuple[Optional[str], Dict[str, torch.Tensor]] = (None, {})  # the .bin shard held
        self.weight_map = self._weight_map()  # HF name -> file name

    def _weight_map(self) -> Dict[str, str]:
        """Which file holds each tensor; safetensors preferred over .bin, as transformers does."""
        for index, single in ((SAFETENSORS_INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
            if os.path.isfile(os.path.join(self.path, index)):
                weight_map = _read_json(os.path.join(self.path, index), "the weight index").get("weight_map")
                if not isinstance(weight_map, dict) or not weight_map:
                    raise CheckpointError(f"{os.path.join(self.path, index)} has no weight_map")
                for name in sorted(set(weight_map.values())):
                    if not os.path.isfile(os.path.join(self.path, name)):
                        raise CheckpointError(f"{self.path}: {index} names {name}, which is missing")
                return dict(weight_map)
            if os.path.isfile(os.path.join(self.path, single)):
                return {name: single for name in self._names_in(single)}
        raise CheckpointError(f"{self.path} holds no weights ({SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN} or "
                              f"{BIN_INDEX})")

    def _names_in(self, file: str) -> List[str]:
        if file.endswith(".safetensors"):
            return list(self._handle(file).keys())
        return list(self._bin_shard(file))

    def _handle(self, file: str) -> Any:
        if file not in self._open:
            from safetensors import SafetensorError, safe_open

            try:
                self._open[file] = safe_open(os.path.join(self.path, file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as error:
                raise CheckpointError(f"{os.path.join(self.path, file)} is not a readable safetensors file "
                                      f"({error})") from None
        return self._open[file]

    def _bin_shard(self, file: str) -> Dict[str, torch.Tensor]:
        """The .bin file's state dict (one held at a time), through the allow-listed unpickler."""
        if self._bin[0] != file:
            self._bin = (None, {})  # free the previous shard first
            state = load_file(os.path.join(self.path, file))
            if not isinstance(state, dict) or not all(torch.is_tensor(t) for t in state.values()):
                raise CheckpointError(f"{os.path.join(self.path, file)} is not a state dict of tensors")
            self._bin = (file, state)
        return self._bin[1]

    def tensor(self, name: str) -> torch.Tensor:
        """The HF tensor `name` (its older alias accepted: GPT-NeoX's embed_out)."""
        actual = self._actual_name(name)
        if actual is None:
            raise CheckpointError(f"{self.path}: tensor {name} is missing from the weights")
        view = None if actual == name or actual in huggingface.HF_ALIASES else mixtral.fused_view(name)
        if view is not None:  # one expert of a fused tensor (transformers 5's Mixtral modules)
            _, expert, take = view
            return take(self._read(actual, expert))
        view = None if actual == name else self._nemotron_h_view(name)
        if view is not None:  # NemotronH saved under its module names: model., experts fused
            return self._read(*view)
        return self._read(actual)

    def _read(self, actual: str, index: Optional[int] = None) -> torch.Tensor:
        """The file tensor `actual`, or its slice [index] (read alone from a safetensors file)."""
        file = self.weight_map[actual]
        if file.endswith(".safetensors"):
            handle = self._handle(file)
            return handle.get_tensor(actual) if index is None else handle.get_slice(actual)[index]
        tensor = self._bin_shard(file)[actual]
        return tensor if index is None else tensor[index]

    def _actual_name(self, name: str) -> Optional[str]:
        if name in self.weight_map:
            return name
        for old, new in huggingface.HF_ALIASES.items():
            if new == name and old in self.weight_map:
                return old
        view = mixtral.fused_view(name) or self._nemotron_h_view(name)
        if view is not None and view[0] in self.weight_map:
            return view[0]
        return None

    def _nemotron_h_view(self, name: str) -> Optional[Tuple[str, Optional[int]]]:
        """A NemotronH file name's tensor under transformers 5's module names (nemotron_h.file_view)."""
        return nemotron_h_convert.file_view(name) if self.config.model_type == "nemotron_h" else None

    def rules(self) -> List[huggingface.WeightRule]:
        """weight_rules of the config, after checking that the files hold exactly the tensors they need."""
        rules = huggingface.weight_rules(self.config)
        needed = {name for rule in rules for name in rule.hf}
        missing = sorted(name for name in needed if self._actual_name(name) is None)
        if missing:
            raise CheckpointError(f"{self.path}: the weights lack {len(missing)} tensor(s) the "
                                  f"{self.config.model_type} mapping needs: {', '.join(missing[:4])}")
        present = {huggingface.HF_ALIASES.get(k, k) for k in self.weight_map}
        needed |= {self._actual_name(name) for name in needed}  # a fused tensor stands for its experts'
        extra = sorted(k for k in present - needed
                       if not huggingface.IGNORED_HF_KEYS.search(k) and k not in self._tied_copies())
        if extra:
            family = huggingface.ARCHITECTURES[self.config.model_type].family
            raise CheckpointError(f"{self.path}: {len(extra)} tensor(s) have no counterpart in our "
                                  f"{huggingface.MODEL_CLASSES[family]}: {', '.join(extra[:4])}")
        return rules

    def _tied_copies(self) -> Dict[str, str]:
        return huggingface.ARCHITECTURES[self.config.model_type].tied_copies(self.config)

    def ours(self, rule: huggingface.WeightRule) -> torch.Tensor:
        """Our whole tensor of `rule`, from the HF tensors it names."""
        return rule.to_ours(*(self.tensor(name) for name in rule.hf)).contiguous()

    def check_tied_head(self) -> None:
        """A tied model whose files still hold the tied copy (lm_head.weight): it must equal what it repeats."""
        t5 = huggingface.ARCHITECTURES[self.config.model_type].family == "T5"
        for copy_, repeated in self._tied_copies().items():
            if self._actual_name(copy_) is not None and not torch.equal(self.tensor(copy_), self.tensor(repeated)):
                if t5 and copy_ == "lm_head.weight":
                    raise CheckpointError(f"{self.path}: {t5_convert.UNTIED_HEAD}")
                raise CheckpointError(f"{self.path}: {copy_} is tied to {repeated} but differs from it")

    def stream(self, padded_rows: int) -> Iterator[Tuple[str, torch.Tensor]]:
        """Our whole tensors in canonical order, vocabulary rows zero-padded to padded_rows."""
        rules = self.rules()
        self.check_tied_head()
        for rule in rules:
            tensor = self.ours(rule)
            yield rule.ours, (pad_rows(tensor, padded_rows) if is_vocab_tensor(rule.ours) else tensor)

    def tokenizer_files(self) -> List[str]:
        return [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(self.path, name))]


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """tensor with zero rows appended up to `rows` (Megatron's vocabulary padding)."""
    if tensor.shape[0] > rows:
        raise CheckpointError(f"a vocabulary tensor has {tensor.shape[0]} rows, more than the {rows} padded rows")
    if tensor.shape[0] == rows:
        return tensor
    out = tensor.new_zeros((rows, *tensor.shape[1:]))
    out[:tensor.shape[0]] = tensor
    return out


def _read_json(path: str, what: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing ({what}): not a transformers model directory")
    try:
        with open(path, "r", encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not JSON ({error})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return value


def _hf_config(path: str) -> Any:
    try:
        from transformers import AutoConfig
    except ImportError:
        raise CheckpointError("reading a HuggingFace config needs the transformers package") from None
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path}/{CONFIG}: transformers cannot read it ({error})") from None


# ----------------------------------------------------------------------------- our args


# Architecture args taken from the HF config (dest -> flag as the user writes it); --load-hf
# refuses a command line that gives one of them another value.
ARCHITECTURE_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "ffn_hidden_size": "--ffn-hidden-size", "kv_channels": "--kv-channels",
    "group_query_attention": "--group-query-attention", "num_query_groups": "--num-query-groups",
    "max_position_embeddings": "--max-position-embeddings", "position_embedding_type": "--position-embedding-type",
    "rotary_base": "--rotary-base", "rotary_percent": "--rotary-percent", "rotary_interleaved": "--rotary-interleaved",
    "use_rope_scaling": "--use-rope-scaling", "rope_scaling_factor": "--rope-scaling-factor",
    "normalization": "--normalization", "norm_epsilon": "--norm-epsilon", "openai_gelu": "--openai-gelu",
    "swiglu": "--swiglu", "squared_relu": "--squared-relu", "apply_layernorm_1p": "--apply-layernorm-1p",
    "qk_layernorm": "--qk-layernorm", "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "add_bias_linear": "--disable-bias-linear", "add_qkv_bias": "--add-qkv-bias",
    "num_experts": "--num-experts", "moe_router_topk": "--moe-router-topk",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size", "moe_router_pre_softmax": "--moe-router-pre-softmax",
    "is_hybrid_model": "--is-hybrid-model", "hybrid_override_pattern": "--hybrid-override-pattern",
    "mamba_state_dim": "--mamba-state-dim", "mamba_head_dim": "--mamba-head-dim",
    "mamba_num_groups": "--mamba-num-groups", "mamba_num_heads": "--mamba-num-heads",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_router_score_function": "--moe-router-score-function",
    "moe_router_topk_scaling_factor": "--moe-router-topk-scaling-factor",
    "moe_router_num_groups": "--moe-router-num-groups", "moe_router_group_topk": "--moe-router-group-topk",
    "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
}
# Settings of training, not of the model: taken from the HF config only when not given.
TRAINING_FLAGS = {"hidden_dropout": "--hidden-dropout", "attention_dropout": "--attention-dropout",
                  "init_method_std": "--init-method-std", "bias_gelu_fusion": "--no-bias-gelu-fusion",
                  "moe_aux_loss_coeff": "--moe-aux-loss-coeff",
                  "moe_router_load_balancing_type": "--moe-router-load-balancing-type",
                  "moe_router_dtype": "--moe-router-dtype"}


def hf_arg_values(hf_config: Any) -> Dict[str, Any]:
    """Our args (dest -> value) of the model hf_config describes (ARCHITECTURE_FLAGS and TRAINING_FLAGS;
    for T5 also t5.T5_ARGS)."""
    try:
        if hf_config.model_type == "nemotron_h":
            return nemotron_h_convert.nemotron_h_arg_values(hf_config)
        if huggingface.ARCHITECTURES[hf_config.model_type].family == "MAMBA":
            return mamba2_convert.mamba2_arg_values(hf_config)
        config, model = huggingface.config_from_hf(hf_config)
        if huggingface.ARCHITECTURES[hf_config.model_type].family == "T5":
            return dict(t5_convert.t5_arg_values(hf_config), init_method_std=float(config.get("init_method_std", 0.02)))
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    heads = config["num_attention_heads"]
    groups = config.get("num_query_groups") or heads
    glu = bool(config.get("gated_linear_unit"))
    values = dict(
        num_layers=config["num_layers"], hidden_size=config["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=config["ffn_hidden_size"],
        kv_channels=config.get("kv_channels") or config["hidden_size"] // heads,
        group_query_attention=groups != heads, num_query_groups=groups,
        max_position_embeddings=model["max_sequence_length"],
        position_embedding_type=model["position_embedding_type"],
        rotary_base=_integral(model.get("rotary_base", 10000)), rotary_percent=float(model.get("rotary_percent", 1.0)),
        rotary_interleaved=bool(config.get("rotary_interleaved", False)),
        use_rope_scaling=bool(model.get("rope_scaling", False)),
        rope_scaling_factor=float(model.get("rope_scaling_factor", 8.0)),
        normalization=config["normalization"], norm_epsilon=float(config["layernorm_epsilon"]),
        openai_gelu=bool(config.get("openai_gelu", False)), swiglu=glu, squared_relu=False,
        apply_layernorm_1p=False, qk_layernorm=False,
        untie_embeddings_and_output_weights=not model["share_embeddings_and_output_weights"],
        add_bias_linear=bool(config["add_bias_linear"]), add_qkv_bias=bool(config.get("add_qkv_bias", False)),
        hidden_dropout=float(config["hidden_dropout"]), attention_dropout=float(config["attention_dropout"]),
        init_method_std=float(config["init_method_std"]),
    )
    if config.get("bias_gelu_fusion") is False:  # the erf GeLU: the fused bias-GeLU is the tanh one
        values["bias_gelu_fusion"] = False
    if config.get("num_moe_experts"):  # Mixtral: Megatron's --num-experts etc. (dest names)
        values.update(num_experts=config["num_moe_experts"], moe_router_topk=config["moe_router_topk"],
                      moe_ffn_hidden_size=config["moe_ffn_hidden_size"],
                      moe_router_pre_softmax=config["moe_router_pre_softmax"],
                      moe_router_load_balancing_type=config["moe_router_load_balancing_type"],
                      moe_aux_loss_coeff=config["moe_aux_loss_coeff"])
    return values


def _integral(value: float) -> Any:
    """--rotary-base is an int flag; keep an integral base an int (a fractional one stays a float)."""
    return int(value) if float(value).is_integer() else float(value)


def hf_seq_length(hf_config: Any) -> int:
    """The longest sequence both models agree on: max_position_embeddings, or a shorter sliding window."""
    window = huggingface._sliding_window(hf_config) if hf_config.model_type != "gpt2" else None
    length = huggingface.config_from_hf(hf_config)[1]["max_sequence_length"]
    return min(length, window) if window else length


def args_from_hf(checkpoint: HFCheckpoint) -> argparse.Namespace:
    """Validated training args (TP = 1, PP = 1) of the checkpoint's model, its vocabulary padded."""
    from megatron.training.arguments import args_from_config, validate_args
    from megatron.training.config import ConfigError, MegatronConfig

    values = hf_arg_values(checkpoint.config)
    family = huggingface.ARCHITECTURES[checkpoint.config.model_type].family
    # T5's relative positions are refused by validate_args (a GPT run's check): set after it. Only
    # T5's: a GPT's position_embedding_type (rope) must be there when --use-rope-scaling is checked.
    t5_values = {dest: values.pop(dest) for dest in t5_convert.T5_ARGS if dest in values} if family == "T5" else {}
    fixed = dict(micro_batch_size=1, train_iters=1, lr=1e-4, mock_data=True, seq_length=hf_seq_length(checkpoint.config))
    if "tokenizer.json" in checkpoint.tokenizer_files():
        fixed.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=os.path.abspath(checkpoint.path))
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints the whole argument block
        try:
            args = args_from_config(MegatronConfig.from_values({**values, **fixed}, where=""))
            args.rank, args.world_size = 0, 1
            validate_args(args)
        except (ValueError, ConfigError) as error:
            raise CheckpointError(f"{checkpoint.path}: the HF config gives args that do not validate: {error}") \
                from None
    args.padded_vocab_size = padded_vocab_size(int(checkpoint.config.vocab_size),
                                               int(args.make_vocab_size_divisible_by), 1)
    if family in ("BERT", "T5"):
        args.model_family = family  # which model the converter and verify build (tools/checkpoint/convert.py)
    if family == "BERT":
        args.bert_binary_head = True  # (Megatron)BertForPreTraining always has the pooler and binary head
        args.bert_post_layernorm = huggingface.config_from_hf(checkpoint.config)[1]["post_layernorm"]
    for dest, value in t5_values.items():
        setattr(args, dest, value)
    args.hf_config = dict(checkpoint.raw_config)
    args.hf_generation_config = None if checkpoint.generation_config is None else dict(checkpoint.generation_config)
    return args


# ----------------------------------------------------------------------------- writing


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ShardWriter:
    """safetensors shards of at most max_bytes each, one held in memory, then the index."""

    def __init__(self, save_dir: str, max_bytes: int) -> None:
        self.save_dir, self.max_bytes = save_dir, max_bytes
        self.held: Dict[str, torch.Tensor] = {}
        self.held_bytes = 0
        self.shards: List[List[str]] = []  # the names of each shard written
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = _tensor_bytes(tensor)
        if self.held and self.held_bytes + size > self.max_bytes:
            self._flush()
        self.held[name] = tensor.contiguous()
        self.held_bytes += size
        self.total_bytes += size

    def _temporary(self, k: int) -> str:
        return os.path.join(self.save_dir, f".model-{k + 1:05d}.safetensors.partial")

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self._temporary(len(self.shards))
        save_file(self.held, path, metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(path, 0o666 & ~umask)  # as an ordinary file (safetensors may create it private)
        self.shards.append(list(self.held))
        self.held, self.held_bytes = {}, 0

    def finish(self) -> List[str]:
        """Write the last shard, name them all, and the index when there is more than one; the file names."""
        if self.held or not self.shards:
            self._flush()
        n = len(self.shards)
        if n == 1:
            os.replace(self._temporary(0), os.path.join(self.save_dir, SAFETENSORS))
            return [SAFETENSORS]
        files = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        weight_map = {}
        for k, (file, names) in enumerate(zip(files, self.shards)):
            os.replace(self._temporary(k), os.path.join(self.save_dir, file))
            weight_map.update({name: file for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(os.path.join(self.save_dir, SAFETENSORS_INDEX), index)
        return files + [SAFETENSORS_INDEX]


def write_json(path: str, value: Dict[str, Any]) -> None:
    text = json.dumps(value, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def copy_tokenizer(source_dir: str, save_dir: str) -> List[str]:
    """Copy the tokenizer files source_dir has (CheckpointError when it has none)."""
    if not os.path.isdir(source_dir):
        raise CheckpointError(f"--tokenizer-dir {source_dir} is not a directory")
    names = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source_dir, name))]
    if not names:
        raise CheckpointError(f"--tokenizer-dir {source_dir} holds none of {', '.join(TOKENIZER_FILES)}")
    for name in names:
        shutil.copyfile(os.path.join(source_dir, name), os.path.join(save_dir, name))
    return names
