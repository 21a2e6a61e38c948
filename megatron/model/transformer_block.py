"""TransformerBlock: this pipeline stage's transformer layers and the final layer norm.

Each layer is built from the block's spec (layer_specs; an MoE layer where the config says so).

Full recompute (config.recompute_granularity "full", Megatron's): while training, the block keeps
only the inputs of checkpointed units and reruns them in backward (tensor_parallel.checkpoint):
    uniform  this stage's (chunk's) layers in consecutive groups of recompute_num_layers, each one unit
    block    each of the first recompute_num_layers layers of the stage (chunk) its own unit; the
             rest run normally
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.core import parallel_state, tensor_parallel
from megatron.model.layer_specs import layer_spec_from_config, spec_for_layer
from megatron.model.layers import Norm
from megatron.model.module import MegatronModule
from megatron.model.spec import ModuleSpec, build_module
from megatron.model.transformer_config import TransformerConfig
from megatron.model.transformer_layer import get_layer_offset, get_num_layers_to_build
from megatron.model.utils import get_causal_attention_mask, init_rng


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
        _check_tensor_parallel_size(config)
        self.pre_process = pre_process
        self.post_process = post_process
        self.input_tensor: torch.Tensor | None = None
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
            if getattr(inference_context, "paged", False):  # the engine's packed step: its context masks
                attention_mask, is_causal = None, False
            elif attention_mask is None:
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
