"""The MoE router: which experts each token goes to, with what weight, and the balancing losses.

Tokens are the rows of x [T, h] (this rank's [s/t * b] under sequence parallelism, s-major).

    logits  = x W^T (+ b)                               [T, E]  (W: router.weight [E, h]; fp32/fp64 with
                                                                  moe_router_dtype)
    softmax, moe_router_pre_softmax False (default):  top-k of the logits, softmax over those k
    softmax, pre-softmax:                              softmax over all E, top-k of that
    sigmoid:                                           sigmoid, top-k, divided by their sum when k > 1
    sinkhorn (load balancing type):                    top-k of Sinkhorn-normalised logits while
                                                       training (no gradient through it); the weights
                                                       are sigmoid (k = 1) or the softmax over all E
    then x moe_router_topk_scaling_factor when given.

Group-limited routing (moe_router_num_groups G, moe_router_group_topk g): the E experts form G equal
groups, a group scores the sum of its top k/g scores (logits, or the softmax / sigmoid ones), each
token keeps its g best groups and takes its top-k among their experts (the others masked to -inf).
The expert bias (moe_router_enable_expert_bias, sigmoid only): buffer expert_bias [E] fp32 is added to
the sigmoid scores to choose the experts (and the groups); the weights stay the unbiased scores. In
training (autograd on) local_tokens_per_expert [E] counts the tokens each expert got (after dropping);
finalize_model_grads.update_router_expert_bias sums the counts over TP x CP x DP after the step's
micro-batches and moves the bias by rate * sign(mean - count) (Megatron-Core's aux-loss-free balancing).

The result is probs [T, E] (zero off the chosen experts) and routing_map [T, E] (bool), as in
Megatron-Core. Capacity (moe_expert_capacity_factor f): each expert takes at most
C = ceil(T * k / E * f) of this rank's tokens; the rest of its tokens are dropped (their weight
to that expert is 0), keeping the C largest weights ("probs") or the first C tokens ("position").
With moe_pad_expert_input_to_capacity every expert runs exactly C tokens, the extra ones with
weight 0 (the result is the same; the shapes are fixed).

Balancing losses (training only, attached to the activations with AuxLossAutoScaler, so their
gradient joins the main loss's), with P the softmax (or normalised sigmoid) of all E logits and
the routing of its top-k, over the tokens of the tensor-parallel group (sequence parallelism
splits the sequence; counts are summed over the group, each rank adds its tokens' share):
    aux_loss      coeff * E / (k T^2) * sum_e (sum_t P[t, e]) * n_e       (n_e: tokens routed to e)
    seq_aux_loss  the same per sequence (T = s), averaged over the batch
    z_loss        z_coeff * mean_t logsumexp(logits[t])^2
These are Megatron-Core's formulas (switch_load_balancing_loss_func, sequence_load_balancing,
z_loss_func), so the values and gradients match it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.core import aux_losses, communication, parallel_state
from megatron.core.aux_losses import AuxLossAutoScaler
from megatron.model.module import MegatronModule
from megatron.model.transformer_config import TransformerConfig

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp on exp(cost) [T, E]: scale rows and columns until every expert's column sums
    to about T/E times every token's row (S-BASE routing); returns the balanced matrix."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1.0 / d0.size(0)) / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1.0 / d1.size(0)) / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """(values, indices) [T, k] of the top-k of scores [T, E] among each token's group_topk best groups of
    experts (a group's score: the sum of its top topk // group_topk scores; Megatron-Core's group_limited_topk)."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)  # [T, G, E/G]
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    chosen = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)  # [T, E]
    return torch.topk(scores.masked_fill(~expert_mask, float("-inf")), k=topk, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
                 scaling_factor: float | None = None, num_groups: int | None = None, group_topk: int | None = None,
                 expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E], routing_map [T, E] bool) of top-k routing with the score function (module doc);
    group_topk (with num_groups) limits each token to its best groups; expert_bias [E] (sigmoid only) is
    added to the scores to choose the experts, not to their weights."""

    def choose(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            return group_limited_topk(scores, topk, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=1)

    if expert_bias is not None and score_function != "sigmoid":
        raise ValueError(f"the expert bias needs the sigmoid score function, got {score_function!r}")
    if score_function == "softmax":
        if pre_softmax:
            weights, indices = choose(torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits))
        else:
            top, indices = choose(logits)
            weights = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:  # the bias picks the experts; the weights stay the unbiased scores
            indices = choose(scores + expert_bias)[1]
            weights = torch.gather(scores, 1, indices)
        else:
            weights, indices = choose(scores)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function must be softmax or sigmoid, got {score_function!r}")
    if scaling_factor:
        weights = weights * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, indices, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return probs, routing_map


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) of Sinkhorn routing (Megatron-Core's: balanced choice while training)."""
    if topk == 1:
        weights = torch.sigmoid(logits)
    else:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    with torch.no_grad():
        choice = sinkhorn(logits.detach().to(torch.float32)) if training else weights
        indices = torch.topk(choice, k=topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return weights * routing_map, routing_map


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert takes: ceil(T * k / E * f) (Megatron-Core's get_capacity)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def drop_tokens(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, capacity_factor: float,
                policy: str = "probs", pad_to_capacity: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the expert capacity (module doc); returns (probs, routing_map) after dropping (and padding)."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, topk, num_experts, capacity_factor)
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    elif policy == "probs":
        # The C largest weights per expert; among equal weights the earlier token (a stable order).
        order = torch.sort(probs.detach(), dim=0, descending=True, stable=True).indices[:capacity]
        keep = torch.zeros_like(routing_map).scatter(0, order, True)
    elif policy == "position":
        # The first C routed tokens per expert; padding takes the first unrouted ones after them.
        routed = routing_map.long()
        rank = torch.where(routing_map, routed.cumsum(0), routed.sum(0, keepdim=True) + (1 - routed).cumsum(0))
        keep = rank <= capacity
    else:
        raise ValueError(f"moe_token_drop_policy must be probs or position, got {policy!r}")
    final_map = keep if pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: int,
                               topk: int, num_experts: int, coeff: float) -> torch.Tensor:
    """coeff * E / (k T^2) * sum_e (sum_t scores[t, e]) * tokens_per_expert[e] (this rank's share when
    the scores are this rank's tokens and the counts and T the whole group's)."""
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * (num_experts * coeff / (topk * total_tokens ** 2))


class TopKRouter(MegatronModule):
    """x [s, b, h] -> (probs [T, E], routing_map [T, E]); keys weight [E, h] (bias [E] with add_bias_linear).

    The weight is replicated on every rank (drawn in full with the config's init_method); under
    sequence parallelism each rank sees its own tokens, so it is marked sequence_parallel and its
    gradient summed over the tensor-parallel group.
    """

    def __init__(self, config: TransformerConfig, layer_number: int | None = None) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        weight = torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32)
        if config.perform_initialization:
            config.init_method(weight)
        self.weight = torch.nn.Parameter(weight.to(config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        if config.add_bias_linear:
            bias = torch.empty(self.num_experts, dtype=torch.float32)
            if config.perform_initialization:
                config.init_method(bias)
            self.bias = torch.nn.Parameter(bias.to(config.params_dtype))
            self.bias.sequence_parallel = config.sequence_parallel
        else:
            self.register_parameter("bias", None)
        if config.moe_router_enable_expert_bias:
            # expert_bias is saved (mlp.router.expert_bias, Megatron's key); the counts of the step's
            # micro-batches are not (update_router_expert_bias zeroes them after each step).
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32),
                                 persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None

    def _keep_expert_bias_fp32(self) -> None:
        """A bf16/fp16 cast of the model casts the buffers too: the bias and counts go back to fp32 (small
        steps of the update rate would be lost in 16 bits)."""
        for name in ("expert_bias", "local_tokens_per_expert"):
            buffer = getattr(self, name)
            if buffer is not None and buffer.dtype != torch.float32:
                buffer.data = buffer.data.to(torch.float32)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._keep_expert_bias_fp32()
        super()._load_from_state_dict(*args, **kwargs)

    def _save_to_state_dict(self, *args, **kwargs) -> None:
        self._keep_expert_bias_fp32()
        super()._save_to_state_dict(*args, **kwargs)

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """logits [s, b, E] in moe_router_dtype (else x's dtype)."""
        dtype = _ROUTER_DTYPES[self.config.moe_router_dtype] or x.dtype
        bias = self.bias.to(dtype) if self.bias is not None else None
        return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._keep_expert_bias_fp32()
        seq_length, batch = hidden_states.shape[:2]
        logits = self.gating(hidden_states).reshape(-1, self.num_experts)  # [T, E]
        return self.routing(logits, seq_length, batch)

    # ------------------------------------------------------------------ routing
    def _balancing(self) -> bool:
        """Whether the balancing losses run: in training, with autograd on (not the no-grad first
        pass of a recomputed layer: its recompute attaches them)."""
        return self.training and torch.is_grad_enabled()

    def routing(self, logits: torch.Tensor, seq_length: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.config
        # The ranks that hold this micro-batch's other tokens: TP (MoE needs SP) and, under context
        # parallelism, the CP ranks too (Megatron's tp-cp group): counts are summed over them, and a
        # rank's partial z-loss is divided by their number.
        if config.context_parallel_size > 1:
            tp_group = parallel_state.get_tensor_and_context_parallel_group()
            tp = parallel_state.get_tensor_and_context_parallel_world_size()
        else:
            tp_group = parallel_state.get_tensor_model_parallel_group()
            tp = parallel_state.get_tensor_model_parallel_world_size()
        num_layers = config.num_layers
        if config.moe_z_loss_coeff and self._balancing():
            z_value = torch.mean(torch.square(torch.logsumexp(logits, dim=-1)))  # this rank's tokens
            logits = AuxLossAutoScaler.apply(logits, z_value * (config.moe_z_loss_coeff / tp) * self._per_token(logits))
            aux_losses.record_loss("z_loss", self.layer_number, num_layers, z_value, divide_by=tp)
        if config.moe_router_load_balancing_type == "sinkhorn":
            probs, routing_map = sinkhorn_routing(logits, self.topk, self.training)
        else:
            probs, routing_map = topk_routing(logits, self.topk, config.moe_router_score_function,
                                              config.moe_router_pre_softmax, config.moe_router_topk_scaling_factor,
                                              config.moe_router_num_groups, config.moe_router_group_topk,
                                              self.expert_bias)
        routed = routing_map
        if config.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_tokens(probs, routing_map, self.topk, config.moe_expert_capacity_factor,
                                             config.moe_token_drop_policy, config.moe_pad_expert_input_to_capacity)
        if self.expert_bias is not None and torch.is_grad_enabled():
            # Megatron counts with autograd on (not in evaluation, nor the no-grad first pass of a
            # recomputed layer: its recompute counts), the tokens kept after dropping.
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        if self._balancing():
            aux_losses.record_tokens(self.layer_number, num_layers, routed.sum(0), (routed & routing_map).sum(0))
            kind, coeff = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
            if kind in ("aux_loss", "seq_aux_loss") and coeff > 0:
                probs = self._attach_aux_loss(kind, probs, logits, seq_length, batch, tp_group, tp)
        return probs, routing_map

    def _attach_aux_loss(self, kind: str, probs: torch.Tensor, logits: torch.Tensor, seq_length: int, batch: int,
                         tp_group: dist.ProcessGroup | None, tp: int) -> torch.Tensor:
        config = self.config
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32) if config.moe_router_score_function == "softmax" \
            else _normalised_sigmoid(logits)
        top = torch.topk(scores, k=self.topk, dim=1).indices
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
        if kind == "seq_aux_loss":  # each sequence its own set of E experts: [s, b * E]
            scores, chosen = scores.reshape(seq_length, -1), chosen.reshape(seq_length, -1)
        counts = chosen.sum(0).to(scores.dtype)
        if tp > 1:
            counts = communication.all_reduce(counts, group=tp_group)
        total = chosen.shape[0] * tp
        loss = switch_load_balancing_loss(scores, counts, total, self.topk, self.num_experts,
                                          config.moe_aux_loss_coeff)
        if kind == "seq_aux_loss":
            loss = loss / batch
        name = "load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss"
        aux_losses.record_loss(name, self.layer_number, config.num_layers, loss / config.moe_aux_loss_coeff)
        return AuxLossAutoScaler.apply(probs, loss * self._per_token(probs))

    def _per_token(self, tokens: torch.Tensor) -> int:
        """With calculate_per_token_loss the gradients are divided by the global batch's token count
        afterwards: an aux loss is multiplied by this rank's tokens first (Megatron-Core's rule)."""
        return tokens.shape[0] if self.config.calculate_per_token_loss else 1


def _normalised_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    scores = torch.sigmoid(logits.float())
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
