"""How each tensor of a GPTModel is split over tensor-parallel ranks, from the run's args alone.

The checkpoint converter merges a checkpoint's TP shards into whole tensors and cuts them again
for another TP size. It reads no model: the split of every key follows from its name and the
saved args (np heads, ng query groups, hn head dim, t ranks; L. = decoder.layers.{i}.):

    key                                       layout (megatron/core/tensor_parallel/layout.py)
    embedding.word_embeddings.weight          rows, contiguous: vocab/t rows per rank
    output_layer.weight                       rows, contiguous (the padded vocabulary)
    L.self_attention.linear_qkv.{weight,bias} explicit rows (attention.qkv_partition_rows): per
                                              query group [np/ng q heads, k, v]; with t > ng a
                                              group's K/V rows are replicated on t/ng ranks
    L.self_attention.linear_proj.weight       columns, contiguous (row parallel)
    L.mlp.linear_fc1.{weight,bias}            rows, stride 2 with --swiglu ([gate_r ; up_r]), else 1
    L.mlp.linear_fc2.weight                   columns, contiguous (row parallel)
    L.mlp.router.{weight,bias,expert_bias}    replicated (every rank routes all its tokens)
    L.mlp.experts.local_experts.{e}.linear_fc1 / linear_fc2, L.mlp.shared_experts.linear_fc1 / fc2:
                                              as the dense MLP's, t the expert-tensor-parallel size
                                              for the experts (classic files: = TP; expert_key below)
    L.<linear>.adapter.linear_{in,out}.weight LoRA (megatron/core/tensor_parallel/lora.py): B of linear_qkv /
                                              linear_fc1 and A of linear_proj / linear_fc2 split as their
                                              base weight; the other piece replicated
    L.mixer.in_proj.weight                    explicit rows (mixer.MambaDims.in_proj_rows): each rank's
                                              [z_r, x_r, B_r, C_r, dt_r] of the heads and groups it owns
    L.mixer.conv1d.{weight,bias}              explicit rows: [x_r, B_r, C_r]
    L.mixer.{dt_bias,A_log,D,norm.weight}     rows, contiguous (per head; the gated norm per channel)
    L.mixer.out_proj.weight                   columns, contiguous (row parallel)
    everything else                           replicated: norms, linear_proj / linear_fc2 biases,
                                              q/k layernorms, position embeddings
    BertModel (L. = encoder.layers.{i}.)      the same layers; output_layer.bias rows, contiguous
                                              (the padded vocabulary); tokentype embeddings,
                                              lm_head.dense / layer_norm, pooler.*, binary_head.* replicated
    T5Model (L. = encoder.layers.{i}. and     the same layers (fc1 stride 2 with t5_gated_linear_unit);
      decoder.layers.{i}.)                    D.cross_attention.linear_q / linear_kv rows, contiguous
                                              (whole heads: linear_kv's rows are per head [k, v]);
                                              D.cross_attention.linear_proj columns; lm_head.output_layer.*
                                              rows, contiguous (the padded vocabulary);
                                              *_relative_pos_emb.* replicated (every rank holds all heads)

A name this table does not know is refused (UnknownTensorError) rather than guessed: a new layer
must say how it is split before a checkpoint of it converts.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Dict, Optional, Tuple

from megatron.model.attention import qkv_partition_rows

_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.+\.mlp\.experts\.local_experts\.)(\d+)\.(.+)$")
_REPLICATED = re.compile(r"(layernorm|norm)\.(weight|bias)$|^embedding\.(position|tokentype)_embeddings\.weight$"
                         r"|linear_(proj|fc2)\.bias$|^(lm_head\.(dense|layer_norm)|pooler\.dense|binary_head)\."
                         r"|^(encoder|decoder)_relative_pos_emb\.relative_attention_bias\.weight$"
                         r"|\.mlp\.router\.(weight|bias|expert_bias)$")
_ADAPTER = re.compile(r"\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)\.adapter\.linear_(in|out)\.weight$")
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias",
                 "lm_head.output_layer.weight", "lm_head.output_layer.bias")  # the last two: T5Model's


class UnknownTensorError(ValueError):
    """A state-dict key the layout table has no rule for."""


def query_groups(args: argparse.Namespace) -> int:
    """ng; Megatron's rule: without --group-query-attention there is one group per head."""
    if getattr(args, "group_query_attention", False) and getattr(args, "num_query_groups", None):
        return int(args.num_query_groups)
    return int(args.num_attention_heads)


def head_dim(args: argparse.Namespace) -> int:
    """hn: --kv-channels, or h / np."""
    return int(getattr(args, "kv_channels", None) or args.hidden_size // args.num_attention_heads)


def tensor_layout(name: str, args: argparse.Namespace, tp: int, rank: int) -> Dict[str, Any]:
    """The attributes shard_for_rank / merge_shards take for key `name` on rank `rank` of `tp`."""
    replicated: Dict[str, Any] = {"tensor_model_parallel": False}
    adapter = _ADAPTER.search(name)
    if adapter is not None:  # LoRA: the piece that follows the base layer's split is split as its weight
        base, piece = adapter.group(1), adapter.group(2)
        column = base in ("linear_qkv", "linear_fc1")
        if (piece == "out") == column:
            return tensor_layout(name[:adapter.start()] + f".{base}.weight", args, tp, rank)
        return replicated
    if _REPLICATED.search(name) and ".mixer." not in name:
        return replicated
    if name in VOCAB_TENSORS:
        return _split(0)
    if ".mixer." in name:  # a Mamba layer's (megatron/model/mamba/mixer.py)
        return _mamba_layout(name, args, tp, rank)
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        rows = qkv_partition_rows(int(args.num_attention_heads), query_groups(args), head_dim(args), tp, rank)
        return {**_split(0), "partition_rows": rows}
    if name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias"):
        gated = getattr(args, "swiglu", False) or getattr(args, "t5_gated_linear_unit", False)
        return _split(0, stride=2 if gated else 1)
    if re.search(r"\.cross_attention\.linear_(q|kv)\.(weight|bias)$", name):
        return _split(0)
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return _split(1)
    raise UnknownTensorError(f"no tensor-parallel layout rule for {name!r}: the converter does not know "
                             "how this tensor is split over TP ranks")


def mamba_dims(args: argparse.Namespace, tp: int) -> Any:
    """The Mamba mixer's sizes (megatron.model.mamba.mixer.MambaDims) of a run's args at TP size tp."""
    from megatron.model.mamba.mixer import MambaDims

    hidden, head_dim = int(args.hidden_size), int(args.mamba_head_dim)
    heads = int(getattr(args, "mamba_num_heads", None) or 2 * hidden // head_dim)
    return MambaDims(hidden, heads * head_dim, heads, head_dim, int(args.mamba_num_groups), int(args.mamba_state_dim),
                     4, tp)


def _mamba_layout(name: str, args: argparse.Namespace, tp: int, rank: int) -> Dict[str, Any]:
    dims = mamba_dims(args, tp)
    if name.endswith(".mixer.in_proj.weight"):
        return {**_split(0), "partition_rows": dims.in_proj_rows(rank)}
    if re.search(r"\.mixer\.conv1d\.(weight|bias)$", name):
        return {**_split(0), "partition_rows": dims.conv_rows(rank)}
    if re.search(r"\.mixer\.(dt_bias|A_log|D|norm\.weight)$", name):
        return _split(0)
    if name.endswith(".mixer.out_proj.weight"):
        return _split(1)
    raise UnknownTensorError(f"no tensor-parallel layout rule for {name!r}: the converter does not know "
                             "how this tensor is split over TP ranks")


def _split(dim: int, stride: int = 1) -> Dict[str, Any]:
    return {"tensor_model_parallel": True, "partition_dim": dim, "partition_stride": stride}


def is_vocab_tensor(name: str) -> bool:
    """Whether the rows of `name` are the (padded) vocabulary."""
    return name in VOCAB_TENSORS


def layer_index(name: str) -> Optional[int]:
    """i of decoder.layers.{i}.* (encoder.layers.{i}.* for BERT), else None."""
    match = _LAYER.match(name)
    return int(match.group(2)) if match else None


def renumber(name: str, offset: int) -> str:
    """decoder.layers.{i}.rest -> decoder.layers.{i + offset}.rest (encoder. alike; other names unchanged)."""
    match = _LAYER.match(name)
    if match is None:
        return name
    return f"{match.group(1)}.layers.{int(match.group(2)) + offset}.{match.group(3)}"


def padded_vocab_size(true_vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round up to a multiple of make_vocab_size_divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-true_vocab_size // multiple) * multiple


def expert_key(name: str) -> Optional[Tuple[str, int, str]]:
    """(prefix, expert index, rest) of ...mlp.experts.local_experts.{e}.rest, else None."""
    match = _EXPERT.match(name)
    return (match.group(1), int(match.group(2)), match.group(3)) if match else None


def renumber_expert(name: str, index: int) -> str:
    """name with its expert index replaced (local <-> global: global = ep_rank * E / EP + local)."""
    prefix, _, rest = expert_key(name)
    return f"{prefix}{index}.{rest}"
