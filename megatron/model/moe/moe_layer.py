"""MoELayer: the mixture-of-experts MLP (megatron-core's MoELayer, local implementation).

    [s, b, h] -> router -> dispatcher -> this rank's experts -> dispatcher -> [s, b, h]  (+ shared experts)

It fills the `mlp` slot of a transformer layer (layer_specs.get_gpt_layer_spec(num_experts=...),
or per layer with config.moe_layer_freq), and returns (output, None) like the MLP. Keys:
router.*, experts.local_experts.{i}.* (router.py, experts.py) and shared_experts.* (a dense MLP
of moe_shared_expert_intermediate_size, tensor parallel like the layer's MLP, run on every
token and added to the routed experts' output; Megatron-Core's shared experts without a gate).

Under sequence parallelism (required with TP > 1) each rank routes its own s/t tokens; the
dispatcher (token_dispatcher.py, moe_token_dispatcher_type) moves them between the expert
ranks. Initialisation draws the router weight, then a seed for the experts, from the layer's
stream, so the experts are the same at every EP / ETP (experts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.core import parallel_state
from megatron.model.mlp import MLP
from megatron.model.module import MegatronModule
from megatron.model.moe.experts import SequentialMLP
from megatron.model.moe.router import TopKRouter
from megatron.model.moe.token_dispatcher import build_dispatcher
from megatron.model.spec import ModuleSpec, build_module
from megatron.model.transformer_config import TransformerConfig


@dataclass
class MoESubmodules:
    router: ModuleSpec | type = TopKRouter
    experts: ModuleSpec | type = SequentialMLP
    shared_experts: ModuleSpec | type | None = MLP


class MoELayer(MegatronModule):
    def __init__(self, config: TransformerConfig, submodules: MoESubmodules | None = None,
                 layer_number: int | None = None) -> None:
        super().__init__(config)
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs config.num_moe_experts (--num-experts)")
        submodules = submodules or MoESubmodules()
        ep = parallel_state.get_expert_model_parallel_world_size()
        if ep != config.expert_model_parallel_size:
            raise ValueError(f"TransformerConfig.expert_model_parallel_size is {config.expert_model_parallel_size} but "
                             f"the model is built in an expert-parallel group of {ep} ranks")
        self.num_local_experts = config.num_moe_experts // ep
        first = parallel_state.get_expert_model_parallel_rank() * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.router = build_module(submodules.router, config, layer_number=layer_number)
        seed = int(torch.randint(0, 2**62, (1,)).item())  # from the layer's stream: the same on every rank
        self.experts = build_module(submodules.experts, config, self.num_local_experts, first, seed=seed)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None and submodules.shared_experts is not None:
            self.shared_experts = build_module(submodules.shared_experts, config,
                                               ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        self.dispatcher = build_dispatcher(config.moe_token_dispatcher_type, config.num_moe_experts,
                                           self.num_local_experts)

    def set_layer_number(self, layer_number: int) -> None:
        self.router.layer_number = layer_number

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        """[s, b, h] ([s/t, b, h] under sequence parallelism) -> ([s, b, h], None)."""
        shape = hidden_states.shape
        probs, routing_map = self.router(hidden_states)  # [T, E] each
        tokens = hidden_states.reshape(-1, shape[-1])  # [T, h]
        output = self.dispatcher.run(tokens, probs, routing_map, self.experts).reshape(shape)
        if self.shared_experts is not None:
            shared, bias = self.shared_experts(hidden_states)
            output = output + (shared if bias is None else shared + bias)
        return output, None
