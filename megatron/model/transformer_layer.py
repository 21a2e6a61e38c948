"""TransformerLayer (one pre-LN block) and TransformerBlock (the stack + final layer norm).

Read as nanoGPT's Block, with activations [s, b, h]:
    x = x + dropout(attn(ln_1(x)))
    x = x + dropout(mlp(ln_2(x)))
The "x + dropout(out + bias)" of each branch is Megatron's bias-dropout-add: with
bias_dropout_fusion (the default) one fused_kernels.bias_dropout_add, given the branch's output
and the bias its last linear skipped; otherwise PyTorch ops. Both draw the dropout mask from the
same stream (tensor_parallel_dropout_context), and on CPU the same mask: the same bits either way.
apply_residual_connection_post_layernorm takes the residual from ln(x) instead of x (as in
BERT-era Megatron); fp32_residual_connection keeps x in fp32 while the layers run in half.

Under sequence parallelism (config.sequence_parallel) everything outside the attention and MLP
linears -- layer norms, dropout, residual adds -- runs on this rank's s/t tokens: the block's
input and output are [s/t, b, h], and the column-parallel linears gather the sequence.

Full recompute (config.recompute_granularity "full", Megatron's): while training, the block keeps
only the inputs of checkpointed units and reruns them in backward (tensor_parallel.checkpoint):
    uniform  this stage's (chunk's) layers in consecutive groups of recompute_num_layers, each one unit
    block    each of the first recompute_num_layers layers of the stage (chunk) its own unit; the
             rest run normally
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron import fused_kernels
from megatron.core import parallel_state, tensor_parallel
from megatron.model.layers import Dropout, Norm, fused_impl, tensor_parallel_dropout_context
from megatron.model.module import MegatronModule
from megatron.model.spec import ModuleSpec, build_module
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import get_causal_attention_mask, init_rng


@dataclass
class TransformerLayerSubmodules:
    """The slots of a transformer layer (Megatron-Core's names: each is its state-dict prefix).

    A slot holds a ModuleSpec, a class, or None (empty). The norms are built as
    slot(hidden_size, config), the attentions as slot(config, layer_number=...), the MLP as
    slot(config); cross-attention (and its norm) run only when the layer is given a `context`.
    """

    input_layernorm: ModuleSpec | type | None = Norm
    self_attention: ModuleSpec | type | None = None
    pre_cross_attn_layernorm: ModuleSpec | type | None = None
    cross_attention: ModuleSpec | type | None = None
    pre_mlp_layernorm: ModuleSpec | type | None = Norm
    mlp: ModuleSpec | type | None = None


class TransformerLayer(MegatronModule):
    """[s, b, h] -> [s, b, h], one pre-LN block built from its spec (TransformerLayerSubmodules).

    layer_number is 1-based (it is the query-key layer-scaling coefficient). forward keywords:
    rotary_pos_emb (RoPE angles), attention_bias (ALiBi), context / context_mask (the encoder
    output the cross-attention reads); a slot that is None is skipped (an empty norm is the identity).
    """

    def __init__(self, config: TransformerConfig, submodules: TransformerLayerSubmodules | None = None,
                 layer_number: int = 1) -> None:
        super().__init__(config)
        if submodules is None:  # the GPT layer the config describes
            from megatron.model.layer_specs import layer_spec_from_config

            submodules = layer_spec_from_config(config).submodules
        self.layer_number = layer_number
        h = config.hidden_size
        self.input_layernorm = build_module(submodules.input_layernorm, h, config)
        self.self_attention = build_module(submodules.self_attention, config, layer_number=layer_number)
        self.pre_cross_attn_layernorm = build_module(submodules.pre_cross_attn_layernorm, h, config)
        self.cross_attention = build_module(submodules.cross_attention, config, layer_number=layer_number)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, h, config)
        self.mlp = build_module(submodules.mlp, config)
        if hasattr(self.mlp, "set_layer_number"):  # an MoE layer records its balancing losses by layer
            self.mlp.set_layer_number(layer_number)
        # Applied to each branch's output before the residual add (Megatron's bias-dropout-add).
        self.hidden_dropout = Dropout(config.hidden_dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, is_causal: bool = False,
                rotary_pos_emb: torch.Tensor | None = None, attention_bias: torch.Tensor | None = None,
                context: torch.Tensor | None = None, context_mask: torch.Tensor | None = None,
                inference_context=None) -> torch.Tensor:
        """is_causal: attention_mask is the causal mask (a hint for the fused attention);
        inference_context: the key/value cache the self-attention appends to (InferenceContext)."""
        if self.self_attention is not None:
            kv_cache = {} if inference_context is None else {"inference_context": inference_context}
            hidden_states = self._residual_branch(
                self.input_layernorm, hidden_states,
                lambda x: self.self_attention(x, attention_mask, is_causal, rotary_pos_emb=rotary_pos_emb,
                                              attention_bias=attention_bias, **kv_cache))
        if self.cross_attention is not None and context is not None:
            hidden_states = self._residual_branch(
                self.pre_cross_attn_layernorm, hidden_states,
                lambda x: self.cross_attention(x, context_mask, context=context))
        if self.mlp is not None:
            hidden_states = self._residual_branch(self.pre_mlp_layernorm, hidden_states, self.mlp)
        return hidden_states  # [s, b, h]

    def _residual_branch(self, norm, hidden_states: torch.Tensor, branch) -> torch.Tensor:
        """residual + dropout(branch(norm(x))); the residual is x, or norm(x) with
        apply_residual_connection_post_layernorm (as in BERT-era Megatron)."""
        normed = norm(hidden_states) if norm is not None else hidden_states  # [s, b, h]
        output, bias = branch(normed)  # [s, b, h], bias [h] or None
        residual = normed if self.config.apply_residual_connection_post_layernorm else hidden_states
        return self.bias_dropout_add(output, bias, residual)

    def bias_dropout_add(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(x + bias), [s, b, h] ([s/t, b, h] under SP: each rank's own mask)."""
        with tensor_parallel_dropout_context(partitioned=self.config.sequence_parallel):
            if self.config.bias_dropout_fusion:
                return fused_kernels.bias_dropout_add(x, bias, residual, self.config.hidden_dropout, self.training,
                                                      impl=fused_impl(self.config, x))
            return residual + self.hidden_dropout(x if bias is None else x + bias)


def get_num_layers_to_build(config: TransformerConfig) -> int:
    """Layers of this pipeline stage (of this model chunk, with virtual stages): L / (pp x vp)."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if config.num_layers % (pp * vp):
        raise ValueError(f"num_layers ({config.num_layers}) is not divisible by the pipeline-parallel size ({pp})"
                         + (f" x virtual stages ({vp})" if vp > 1 else ""))
    return config.num_layers // (pp * vp)


def get_layer_offset(config: TransformerConfig) -> int:
    """Global index of this stage's (chunk's) first layer.

    Model chunks are dealt round-robin over the pipeline ranks: chunk v of rank p is chunk
    v * pp + p of the model, so its first layer is v * L / vp + p * L / (pp * vp).
    """
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp_rank = parallel_state.get_virtual_pipeline_model_parallel_rank() or 0
    return (vp_rank * pp + pp_rank) * get_num_layers_to_build(config)


class TransformerBlock(MegatronModule):
    """This pipeline stage's layers. Keys: layers.{i}.* (i local to the stage), final_layernorm.*
    (only when post_process).

    pre_process=False: the input comes from set_input_tensor() (the previous pipeline stage)
    instead of the forward argument. post_process=False: no final layer norm. Layers are
    numbered globally (layer_number = offset + i + 1), the number query-key scaling uses; with
    init_seed each layer is initialised from its own stream (see GPTModel), so its weights do
    not depend on which stage builds it. layer_range (offset, count) overrides the even split of
    config.num_layers over the stages (an encoder-decoder model splits each stack over its own stages).
    With config.num_moe_experts the layers config.is_moe_layer names get the MoE MLP in their mlp slot
    (layer_specs.spec_for_layer; moe_layer_freq).
    """

    def __init__(self, config: TransformerConfig, spec: ModuleSpec | None = None, pre_process: bool = True,
                 post_process: bool = True, init_seed: int | None = None,
                 layer_range: tuple[int, int] | None = None) -> None:
        super().__init__(config)
        from megatron.model.layer_specs import layer_spec_from_config  # (layer_specs imports this module)

        _check_tensor_parallel_size(config)
        self.pre_process = pre_process
        self.post_process = post_process
        self.input_tensor: torch.Tensor | None = None
        from megatron.model.layer_specs import spec_for_layer

        spec = layer_spec_from_config(config) if spec is None else spec
        offset, count = (get_layer_offset(config), get_num_layers_to_build(config)) if layer_range is None \
            else layer_range
        layers = []
        for i in range(count):
            with init_rng(init_seed, offset + i + 1):
                layers.append(build_module(spec_for_layer(spec, config, offset + i + 1), config,
                                           layer_number=offset + i + 1))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = Norm(config.hidden_size, config) if post_process else None
        _check_recompute_num_layers(config, len(self.layers))

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """Pipeline hook: the activations [s, b, h] received from the previous stage."""
        self.input_tensor = input_tensor

    def forward(self, hidden_states: torch.Tensor | None, attention_mask: torch.Tensor | None,
                rotary_pos_emb: torch.Tensor | None = None, attention_bias: torch.Tensor | None = None,
                inference_context=None) -> torch.Tensor:
        """rotary_pos_emb [s, 1, 1, rot_dim] and attention_bias [1, np/t, s, s] reach every layer.

        With an inference_context the s tokens follow its sequence_len_offset cached ones: the default
        mask is the causal one over all offset + s keys, [1, 1, s, key_length] (InferenceContext.key_length)."""
        if not self.pre_process:
            hidden_states = self.input_tensor
        if hidden_states is None:
            raise ValueError("TransformerBlock got no input: pass hidden_states or call set_input_tensor()")
        is_causal = attention_mask is None
        if inference_context is not None:
            if attention_mask is None:
                attention_mask = inference_context.causal_mask(hidden_states.shape[0], hidden_states.device)
            else:  # [.., s, offset + s] -> [.., s, key_length]: the keys the cache hands the attention
                attention_mask = inference_context.pad_to_key_length(attention_mask, hidden_states.shape[0], True)
            # The fused kernels' causal shortcut assumes a square mask: only a prefill from position 0 has one.
            is_causal = is_causal and inference_context.sequence_len_offset == 0
            for layer in self.layers:
                hidden_states = layer(hidden_states, attention_mask, is_causal, rotary_pos_emb=rotary_pos_emb,
                                      attention_bias=attention_bias, inference_context=inference_context)  # [s, b, h]
            return self.final_layernorm(hidden_states) if self.final_layernorm is not None else hidden_states
        if is_causal:
            seq_length = hidden_states.shape[0]  # s, or s/t under sequence parallelism
            if self.config.sequence_parallel:
                seq_length *= self.config.tensor_model_parallel_size
            attention_mask = get_causal_attention_mask(seq_length, hidden_states.device)  # [1, 1, s, s]
        elif attention_mask.dtype != torch.bool:
            raise TypeError(f"attention_mask must be a bool tensor (True = masked out), got {attention_mask.dtype}")
        args = (hidden_states, attention_mask, is_causal, rotary_pos_emb, attention_bias)
        if self.config.recompute_granularity == "full" and self.training and torch.is_grad_enabled():
            hidden_states = self._checkpointed_forward(*args)  # [s, b, h]
        else:
            hidden_states = self._run_layers(0, len(self.layers))(*args)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

    def _run_layers(self, start: int, end: int):
        """A function running layers [start, end) (a unit for tensor_parallel.checkpoint)."""

        def run(hidden_states: torch.Tensor, attention_mask: torch.Tensor, is_causal: bool,
                rotary_pos_emb: torch.Tensor | None, attention_bias: torch.Tensor | None) -> torch.Tensor:
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, attention_mask, is_causal, rotary_pos_emb=rotary_pos_emb,
                                      attention_bias=attention_bias)  # [s, b, h]
            return hidden_states

        return run

    def _checkpointed_forward(self, hidden_states: torch.Tensor, *layer_args) -> torch.Tensor:
        config = self.config
        count, size = len(self.layers), config.recompute_num_layers
        if config.recompute_method == "uniform":
            units = [(start, start + size, True) for start in range(0, count, size)]
        else:  # "block": the first `size` layers one by one, the rest without recompute
            units = [(i, i + 1, i < size) for i in range(count)]
        for start, end, recompute in units:
            run = self._run_layers(start, end)
            if recompute:
                hidden_states = tensor_parallel.checkpoint(run, config.distribute_saved_activations,
                                                           hidden_states, *layer_args)
            else:
                hidden_states = run(hidden_states, *layer_args)
        return hidden_states  # [s, b, h]


def _check_tensor_parallel_size(config: TransformerConfig) -> None:
    """The model takes its tensor-parallel size from the config: it must be the one it runs under."""
    live = parallel_state.get_tensor_model_parallel_world_size()
    if config.tensor_model_parallel_size != live:
        raise ValueError(f"TransformerConfig.tensor_model_parallel_size is {config.tensor_model_parallel_size} but the "
                         f"model is built in a tensor-parallel group of {live} ranks")


def _check_recompute_num_layers(config: TransformerConfig, num_layers: int) -> None:
    """recompute_num_layers against this stage's (chunk's) layers: uniform groups must tile them,
    block cannot recompute more layers than there are."""
    if config.recompute_granularity != "full":
        return
    size, method = config.recompute_num_layers, config.recompute_method
    if size > num_layers or (method == "uniform" and num_layers % size):
        rule = "divide" if method == "uniform" else "be at most"
        raise ValueError(f"recompute_num_layers ({size}) must {rule} the {num_layers} layers of each pipeline "
                         f"stage (model chunk) with recompute_method {method}")
