"""Tiny GPT and Llama models with LoRA adapters for the LoRA tests (serial and multi-rank).

Fresh adapters have B = 0, which makes dA = 0 and hides any error in A's gradient; `randomize_b`
gives every B a nonzero value drawn whole from a generator seeded by its name, then keeps this
rank's piece (shard_for_rank), so serial and parallel models hold the same adapters.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import shard_for_rank
from megatron.core.tensor_parallel.lora import LoRAConfig
from megatron.model import GPTModel, TransformerConfig
from megatron.model.layer_specs import get_llama_layer_spec
from megatron.model.lora import apply_lora

VOCAB, SEQ, MBS, HIDDEN, HEADS, FFN, LAYERS, SEED = 300, 8, 2, 32, 8, 48, 2, 1234
LORA = LoRAConfig(rank=4, alpha=8.0)


def padded(tp: int) -> int:
    multiple = 128 * tp
    return -(-VOCAB // multiple) * multiple


def config(kind: str, tp: int = 1, pp: int = 1, sp: bool = False, **overrides) -> TransformerConfig:
    """"gpt": LayerNorm, biases, GeLU, 8 heads. "llama": RMSNorm, no biases, SwiGLU, 2 query groups."""
    kwargs = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                  hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                  pipeline_model_parallel_size=pp, sequence_parallel=sp)
    if kind == "llama":
        kwargs.update(num_query_groups=2, normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
                      activation_func=F.silu)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build(kind: str, tp: int = 1, pp: int = 1, sp: bool = False, lora: LoRAConfig | None = LORA,
          randomize: bool = True, **overrides) -> GPTModel:
    """This rank's model (its TP shard, its pipeline stage) with adapters (lora None: none)."""
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    llama = kind == "llama"
    model = GPTModel(config(kind, tp, pp, sp, **overrides), vocab_size=padded(tp), num_tokens=VOCAB,
                     max_sequence_length=SEQ, share_embeddings_and_output_weights=not llama,
                     position_embedding_type="rope" if llama else "learned_absolute",
                     transformer_layer_spec=get_llama_layer_spec() if llama else None,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    if lora is not None:
        apply_lora(model, lora, SEED)
        if randomize:
            randomize_b(model)
    return model


def layer_offset(model: GPTModel) -> int:
    """The global number of this chunk's first layer, less one."""
    layers = getattr(model.decoder, "layers", [])
    return layers[0].layer_number - 1 if len(layers) else 0


def global_name(name: str, offset: int) -> str:
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def randomize_b(model: GPTModel) -> None:
    """Every adapter's B set to N(0, 0.05) values, drawn whole by global name, this rank's piece kept."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    offset = layer_offset(model)
    for name, param in model.named_parameters():
        if not name.endswith(".adapter.linear_out.weight"):
            continue
        full_shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            full_shape[param.partition_dim] *= tp
        generator = torch.Generator().manual_seed(zlib.crc32(global_name(name, offset).encode()))
        full = torch.randn(full_shape, generator=generator) * 0.05
        with torch.no_grad():
            param.copy_(shard_for_rank(full, param, tp, rank))


def microbatches(count: int, seed: int = 7) -> list:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)
        loss_mask = (torch.rand(MBS, SEQ, generator=generator) > 0.2).float()
        batches.append((tokens, labels, loss_mask, torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)))
    return batches


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, position_ids = next(data_iterator)
    losses = model(tokens, position_ids, None, labels=labels)  # [b, s]

    def loss_func(output):
        loss = (output.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach()}

    return losses, loss_func


def trainable_count(kind: str, rank: int = LORA.rank) -> int:
    """LoRA's trainable parameters in the whole model: r (in + out) per adapted linear layer."""
    hn = HIDDEN // HEADS
    groups = 2 if kind == "llama" else HEADS
    qkv_out = (HEADS + 2 * groups) * hn
    fc1_out = 2 * FFN if kind == "llama" else FFN
    per_layer = (HIDDEN + qkv_out) + (HEADS * hn + HIDDEN) + (HIDDEN + fc1_out) + (FFN + HIDDEN)
    return LAYERS * rank * per_layer
