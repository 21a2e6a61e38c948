"""What one rank of a GPT layout holds: parameters, the optimizer's bytes per parameter, the
activations autograd keeps per micro-batch, and how many micro-batches the schedule keeps.

Notation as in docs (s sequence, b micro-batch, h hidden, a heads, g query groups, hn kv
channels, f ffn width, V padded vocab, t TP, c CP, p PP, v virtual stages, d DP, e bytes per activation
element: 2 for bf16/fp16, 4 for fp32; MoE: E experts, k top-k, EP, ETP, expert-DP = t d / (ETP
EP)). Everything here is arithmetic on a ModelShape and a Layout; nothing allocates a tensor or
needs a process group.

Context parallelism (c > 1) cuts every micro-batch's sequence into c load-balanced parts of s/c
tokens: every per-token term below takes s/c, the attention's s x s terms s/c x s (a rank's queries
against every key), the causal mask [1, 1, s/c, s]. With selective or full recompute that is exactly
what a CP rank keeps, for every comm type (measured: tests/parallel/test_context_parallel.py, each
rank 1/c of the serial layer's bytes). Without recompute the comm types keep different things
(layer_activation_bytes): a2a and allgather are modelled (exact for the paper's layer and the
Llama-style one with 2 or 8 K/V groups at CP 2, measured); p2p is NOT: the planner counts the
serial layer's bytes / c, and the ring keeps more (each block's fp32 copies of q, k, v, its fp32
exponentials and the merged partial results): measured at s 64, h 64, a 8, CP 2 it keeps 1.9x
that, so the plan under-estimates p2p without recompute; use selective recompute (or a2a).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Optional

from megatron.training.config.architecture import ModelArchitecture
from megatron.planner.mamba import (HybridShape, hybrid_shape_from_args, mamba_layer_activation_bytes,
                                    mamba_layer_parameters)


class PlanError(ValueError):
    """The flags describe something the planner does not model (said in one line)."""


@dataclass(frozen=True)
class MoEShape:
    """The MoE MLPs of a GPT (--num-experts and the --moe-* flags the planner models)."""

    num_experts: int
    layers: tuple  # the 1-based numbers of the MoE layers (--moe-layer-freq)
    ffn_hidden_size: int  # --moe-ffn-hidden-size (default --ffn-hidden-size)
    topk: int = 2
    shared_ffn_hidden_size: int = 0  # --moe-shared-expert-intermediate-size (0: none)
    grouped_gemm: bool = False
    dispatcher: str = "allgather"  # or "alltoall"
    capacity_factor: Optional[float] = None
    pad_to_capacity: bool = False
    router_dtype: Optional[str] = None  # None (the activations' dtype), "fp32" or "fp64"
    pre_softmax: bool = False
    aux_loss: bool = False  # --moe-router-load-balancing-type aux_loss with a coefficient > 0


@dataclass(frozen=True)
class ModelShape:
    """The GPT the flags build (validated args), independent of the parallel layout."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    padded_vocab_size: int
    seq_length: int
    max_position_embeddings: int
    swiglu: bool = False
    layernorm: bool = True  # LayerNorm (weight + bias, mean and 1/std kept); False: RMSNorm
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    learned_positions: bool = True
    rope: bool = False
    rope_fused: bool = True
    swiglu_fused: bool = True
    tied_embeddings: bool = True
    hidden_dropout: bool = True
    attention_dropout: bool = True
    params_dtype: str = "bf16"  # "fp32", "bf16" or "fp16"
    flash_attn: bool = False  # --use-flash-attn on a GPU: no s x s tensor is kept
    vocab_size: Optional[int] = None  # the tokenizer's, for re-padding at another TP (search)
    vocab_divisor: int = 128  # --make-vocab-size-divisible-by
    grads_fp32: bool = True
    moe: Optional[MoEShape] = None
    fast_loss: bool = True  # t = 1 takes the cross entropy's one-rank path (fp32 softmax, native kernels)
    hybrid: Optional[HybridShape] = None  # pretrain_mamba.py: the layer pattern and Mamba sizes (planner/mamba.py)

    def is_moe_layer(self, number: int) -> bool:
        """Whether the 1-based layer `number` has an MoE MLP."""
        return self.moe is not None and number in self.moe.layers


@dataclass(frozen=True)
class Layout:
    """How the model is cut: sizes, recompute, sequence parallelism, the optimizer's sharding."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1  # model chunks per pipeline rank (1: plain 1F1B)
    micro_batch_size: int = 1
    global_batch_size: int = 1
    sequence_parallel: bool = False
    recompute: Optional[str] = None  # None, "selective" or "full"
    recompute_method: Optional[str] = None  # "uniform" or "block" with full
    recompute_num_layers: Optional[int] = None
    distribute_saved_activations: bool = False
    distributed_optimizer: bool = False
    ep: int = 1  # --expert-model-parallel-size
    etp: Optional[int] = None  # --expert-tensor-parallel-size (None: tp)
    cp: int = 1  # --context-parallel-size
    cp_comm_type: str = "p2p"  # --cp-comm-type: p2p, allgather or a2a (the same for every layer)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel size: the ranks of a stage (t c d) over ETP x EP."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def name(self) -> str:
        cp = [f"cp{self.cp}" + ("" if self.cp_comm_type == "p2p" else f"{self.cp_comm_type}")] if self.cp > 1 else []
        parts = [f"tp{self.tp}"] + cp + [f"pp{self.pp}", f"dp{self.dp}"] + ([f"vpp{self.vpp}"] if self.vpp > 1 else [])
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.expert_tp}"] if self.expert_tp != self.tp else []
        parts += [f"mbs{self.micro_batch_size}"] + (["sp"] if self.sequence_parallel else [])
        if self.recompute == "full":
            parts.append(f"full-{self.recompute_method}{self.recompute_num_layers}")
        elif self.recompute:
            parts.append(self.recompute)
        parts += ["distopt"] if self.distributed_optimizer else []
        return "-".join(parts)


def _dtype_name(args: argparse.Namespace) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def shape_from_args(args: argparse.Namespace, vocab_size: Optional[int] = None) -> ModelShape:
    """The ModelShape of validated pretrain_gpt.py args (padded_vocab_size set); vocab_size, the
    tokenizer's, lets shape_at_tp pad the vocabulary for another TP size."""
    if args.qk_layernorm or args.squared_relu:
        raise PlanError("--qk-layernorm / --squared-relu layers are not modelled by the planner")
    arch = ModelArchitecture.from_args(args)
    return ModelShape(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups, kv_channels=arch.kv_channels, ffn_hidden_size=arch.ffn_hidden_size,
        padded_vocab_size=arch.padded_vocab_size, seq_length=arch.seq_length,
        max_position_embeddings=arch.max_position_embeddings, swiglu=bool(arch.swiglu),
        layernorm=arch.normalization == "LayerNorm", add_bias_linear=bool(arch.add_bias_linear),
        add_qkv_bias=bool(args.add_qkv_bias), learned_positions=arch.position_embedding_type == "learned_absolute",
        rope=arch.position_embedding_type == "rope", rope_fused=bool(args.apply_rope_fusion),
        swiglu_fused=bool(args.bias_swiglu_fusion),
        tied_embeddings=not arch.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout > 0, attention_dropout=args.attention_dropout > 0,
        params_dtype=_dtype_name(args), flash_attn=bool(args.use_flash_attn),
        vocab_size=vocab_size, vocab_divisor=args.make_vocab_size_divisible_by,
        grads_fp32=bool(args.accumulate_allreduce_grads_in_fp32) or not
        (args.bf16 or args.fp16), moe=_moe_from_args(args, arch),
        fast_loss=(not args.fp16_lm_cross_entropy or not (args.bf16 or args.fp16))
        and args.fused_kernels_cpu_impl != "reference",
        hybrid=hybrid_shape_from_args(args))


def _moe_from_args(args: argparse.Namespace, arch: ModelArchitecture) -> Optional[MoEShape]:
    """The MoEShape of validated args (None for a dense model); what is not modelled is refused."""
    if not arch.num_experts:
        return None
    if args.moe_router_load_balancing_type not in ("aux_loss", "none"):
        raise PlanError(f"--moe-router-load-balancing-type {args.moe_router_load_balancing_type}: the planner "
                        "models aux_loss and none only")
    if args.moe_router_score_function != "softmax":
        raise PlanError("--moe-router-score-function sigmoid is not modelled by the planner")
    if args.moe_z_loss_coeff:
        raise PlanError("--moe-z-loss-coeff is not modelled by the planner")
    if args.moe_router_group_topk:
        raise PlanError("--moe-router-group-topk (group-limited routing) is not modelled by the planner")
    if args.moe_grouped_gemm and args.fp16:
        raise PlanError("--moe-grouped-gemm with --fp16: the batched fallback's memory is not modelled")
    hybrid = hybrid_shape_from_args(args)
    layers = arch.moe_layers if hybrid is None else [i + 1 for i, kind in enumerate(hybrid.pattern) if kind == "E"]
    return MoEShape(
        num_experts=arch.num_experts, layers=tuple(layers),
        ffn_hidden_size=arch.moe_ffn_hidden_size, topk=arch.moe_router_topk,
        shared_ffn_hidden_size=arch.moe_shared_expert_intermediate_size or 0,
        grouped_gemm=bool(args.moe_grouped_gemm), dispatcher=args.moe_token_dispatcher_type,
        capacity_factor=args.moe_expert_capacity_factor, pad_to_capacity=bool(args.moe_pad_expert_input_to_capacity),
        router_dtype=args.moe_router_dtype, pre_softmax=bool(args.moe_router_pre_softmax),
        aux_loss=args.moe_router_load_balancing_type == "aux_loss" and args.moe_aux_loss_coeff > 0)


def shape_at_tp(m: ModelShape, tp: int) -> ModelShape:
    """The shape with the vocabulary padded as at TP size tp (a multiple of divisor x tp)."""
    if m.vocab_size is None:
        return m
    multiple = m.vocab_divisor * tp
    return replace(m, padded_vocab_size=-(-m.vocab_size // multiple) * multiple)


def layout_from_args(args: argparse.Namespace) -> Layout:
    """The Layout of validated args (--cp-comm-type: one type for every layer, not a2a+p2p)."""
    kinds = set(args.cp_comm_type if isinstance(args.cp_comm_type, (list, tuple)) else [args.cp_comm_type])
    cp = args.context_parallel_size
    if cp > 1 and len(kinds) > 1:
        raise PlanError("--cp-comm-type with a different type per layer is not modelled by the planner")
    kind = kinds.pop() if kinds else "p2p"
    if cp > 1 and kind not in ("p2p", "allgather", "a2a"):
        raise PlanError(f"--cp-comm-type {kind} is not modelled by the planner (p2p, allgather, a2a are)")
    return Layout(cp=cp, cp_comm_type=kind or "p2p", tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                  dp=args.data_parallel_size, vpp=args.virtual_pipeline_model_parallel_size or 1,
                  micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                  sequence_parallel=bool(args.sequence_parallel), recompute=args.recompute_granularity,
                  recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
                  distribute_saved_activations=bool(args.distribute_saved_activations),
                  distributed_optimizer=bool(args.use_distributed_optimizer),
                  ep=args.expert_model_parallel_size,
                  etp=args.expert_tensor_parallel_size)


# ----------------------------------------------------------------------------- parameters


def _mlp_parameters(m: ModelShape, f: int, tp: int) -> int:
    """A dense (tensor-parallel) MLP of width f on one TP rank: fc1 [(2) f/t, h], fc2 [h, f/t] and
    their biases (fc1's split, fc2's [h] whole)."""
    h = m.hidden_size
    fc1_rows = (2 if m.swiglu else 1) * f // tp
    return fc1_rows * h + h * (f // tp) + ((fc1_rows + h) if m.add_bias_linear else 0)


def expert_layer_parameters(m: ModelShape, lay: Layout) -> int:
    """Expert parameters of one MoE layer on one rank: E/EP experts, each split over ETP
    (experts.py: fc1 [(2) f/etp, h], fc2 [h, f/etp], biases only at ETP 1)."""
    moe, h, etp = m.moe, m.hidden_size, lay.expert_tp
    f = moe.ffn_hidden_size // etp
    fc1_rows = (2 if m.swiglu else 1) * f
    per_expert = fc1_rows * h + h * f + ((fc1_rows + h) if m.add_bias_linear else 0)
    return moe.num_experts // lay.ep * per_expert


def layer_parameters(m: ModelShape, tp: int, number: int = 0, lay: Optional[Layout] = None) -> int:
    """Parameters of one transformer layer on one TP rank (the gpt_model.py state-dict table);
    for an MoE layer (1-based `number`, with the layout's EP / ETP) the dense part only: the
    attention, the norms, the router [E, h] (+ bias, replicated) and the shared experts
    (tensor parallel); expert_layer_parameters holds the experts."""
    h, hn = m.hidden_size, m.kv_channels
    norm = 2 * h if m.layernorm else h
    qkv_rows = (m.num_attention_heads + 2 * m.num_query_groups) * hn // tp
    weights = qkv_rows * h + h * (m.num_attention_heads * hn // tp)
    # Column-parallel biases are split, row-parallel biases ([h]) are whole on every rank.
    qkv_bias = qkv_rows if (m.add_bias_linear or m.add_qkv_bias) else 0
    biases = qkv_bias + (h if m.add_bias_linear else 0)
    attention = 2 * norm + weights + biases
    if not m.is_moe_layer(number):
        return attention + _mlp_parameters(m, m.ffn_hidden_size, tp)
    moe = m.moe
    router = moe.num_experts * h + (moe.num_experts if m.add_bias_linear else 0)
    shared = _mlp_parameters(m, moe.shared_ffn_hidden_size, tp) if moe.shared_ffn_hidden_size else 0
    return attention + router + shared


def hybrid_layer_parameters(m: ModelShape, tp: int, number: int, lay: Optional[Layout] = None) -> int:
    """A hybrid model's layer `number` on one TP rank: Mamba (planner/mamba.py), attention only (the GPT
    layer without its MLP and second norm), MLP only (its norm and MLP) or MoE only (its norm, the
    router and shared experts as layer_parameters counts them, and the layout's experts)."""
    kind, h = m.hybrid.kind(number), m.hidden_size
    norm = 2 * h if m.layernorm else h
    if kind == "M":
        return mamba_layer_parameters(h, m.hybrid, tp, m.layernorm)
    if kind == "E":
        moe = m.moe
        router = moe.num_experts * h + (moe.num_experts if m.add_bias_linear else 0)
        shared = _mlp_parameters(m, moe.shared_ffn_hidden_size, tp) if moe.shared_ffn_hidden_size else 0
        return norm + router + shared + expert_layer_parameters(m, lay or Layout())
    mlp = norm + _mlp_parameters(m, m.ffn_hidden_size, tp)
    return mlp if kind == "-" else layer_parameters(m, tp) - mlp


def chunk_layer_numbers(m: ModelShape, lay: Layout, stage: int, chunk: int) -> range:
    """The 1-based layer numbers of model chunk `chunk` of pipeline rank `stage` (chunk v of rank
    p is the model's chunk v p_size + p)."""
    per_chunk = m.num_layers // (lay.pp * lay.vpp)
    first = (chunk * lay.pp + stage) * per_chunk
    return range(first + 1, first + per_chunk + 1)


def _moe_count(m: ModelShape, numbers: range) -> int:
    """How many of the layers `numbers` are MoE layers."""
    return 0 if m.moe is None else sum(1 for n in numbers if n in m.moe.layers)


def chunk_parameters(m: ModelShape, lay: Layout, stage: int, chunk: int) -> int:
    """Parameters of one model chunk on one TP rank, expert parameters included: its layers, the
    embedding on the very first chunk, the final norm and the output layer (or the tied copy) on
    the very last."""
    h, tp = m.hidden_size, lay.tp
    first = stage == 0 and chunk == 0
    last = stage == lay.pp - 1 and chunk == lay.vpp - 1
    numbers = chunk_layer_numbers(m, lay, stage, chunk)
    if m.hybrid is not None:
        total = sum(hybrid_layer_parameters(m, tp, n, lay) for n in numbers)
    else:
        moe = _moe_count(m, numbers)
        total = (len(numbers) - moe) * layer_parameters(m, tp)
        if moe:
            total += moe * (layer_parameters(m, tp, m.moe.layers[0], lay) + expert_layer_parameters(m, lay))
    if first:
        total += m.padded_vocab_size // tp * h + (m.max_position_embeddings * h if m.learned_positions else 0)
    if last:
        total += 2 * h if m.layernorm else h
        # Untied: its own [V/t, h]; tied on a stage without the embedding: a copy of it.
        if not m.tied_embeddings or not first:
            total += m.padded_vocab_size // tp * h
    return total


def stage_parameters(m: ModelShape, lay: Layout, stage: int) -> int:
    """Parameters of pipeline rank `stage` (all its chunks) on one TP rank, experts included."""
    return sum(chunk_parameters(m, lay, stage, c) for c in range(lay.vpp))


def stage_expert_parameters(m: ModelShape, lay: Layout, stage: int) -> int:
    """The expert parameters among stage_parameters (their own DDP buffers, reduced and, with the
    distributed optimizer, sharded over the expert-data-parallel group)."""
    if m.moe is None:
        return 0
    return sum(expert_layer_parameters(m, lay) for c in range(lay.vpp)
               for n in chunk_layer_numbers(m, lay, stage, c) if m.is_moe_layer(n))


# ----------------------------------------------------------------------------- optimizer

PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def bytes_per_parameter(params_dtype: str, grads_fp32: bool, distributed: bool, dp: int) -> dict:
    """Megatron's table (megatron/core/optimizer/memory.py) per category, for Adam.

    fp32 params need no main copy; half params keep fp32 main params, and an fp32 main grad
    copy only when the grad buffer is half (fp16 grads). The distributed optimizer divides the
    main params, main grads and Adam's two moments by d."""
    param = PARAM_BYTES[params_dtype]
    grad = 4 if grads_fp32 or params_dtype == "fp32" else 2
    main_param = 0 if params_dtype == "fp32" else 4
    main_grad = 4 if grad == 2 else 0
    shard = dp if distributed else 1
    out = {"model_params": float(param), "grads": float(grad), "main_params": main_param / shard,
           "main_grads": main_grad / shard, "optimizer_state": 8 / shard}
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------- activations


def _e(m: ModelShape) -> int:
    return 4 if m.params_dtype == "fp32" else 2


def cp_tokens(m: ModelShape, lay: Layout) -> int:
    """The tokens of a sequence one CP rank holds: s / c."""
    return m.seq_length // lay.cp


def layer_activation_bytes(m: ModelShape, lay: Layout, recompute: Optional[str] = None, moe: bool = False) -> int:
    """Bytes one layer keeps for backward per micro-batch on one TP rank (no full recompute):
    the Korthikanti et al. terms of megatron/model/activation_memory.py, at element size e, with
    the norms' fp32 statistics, GQA, RoPE, SwiGLU and dropouts as the flags set them; moe: an
    MoE layer, whose MLP term is moe_mlp_activation_bytes. Under CP (the module docstring) s is
    the rank's s/c tokens and the scores are [b, a/t, s/c, s]."""
    e, t, b, s, h = _e(m), lay.tp, lay.micro_batch_size, cp_tokens(m, lay), m.hidden_size
    hn, f = m.kv_channels, m.ffn_hidden_size
    heads, groups = m.num_attention_heads // t, max(1, m.num_query_groups // t)
    local = s // t if lay.sequence_parallel else s  # tokens of the norms, dropouts, linears' inputs
    stats = 8 if m.layernorm else 4  # fp32 mean and 1/std (RMSNorm: 1/rms) per token
    masks = 2 * h if m.hidden_dropout else 0  # the two residual dropouts' 1-byte masks
    replicated = local * b * (2 * e * h + 2 * stats + 2 * e * h + masks)  # norm inputs, QKV/fc1 inputs
    qkv = e * s * b * (heads + 2 * groups) * hn  # the QKV output, one storage
    if m.rope:
        rope = 0 if m.rope_fused else 2 * 4 * 2 * s * hn  # unfused: cos and sin, fp32 [s, hn], for q and k
        query = e * s * b * heads * hn
        if recompute == "selective":
            core = query + e * s * b * groups * hn + qkv
        else:
            # v is a view of the QKV output only for MHA with attention dropout; else its own copy
            values = e * s * b * heads * hn if groups < heads or not m.attention_dropout else qkv
            core = rope + query + e * s * b * heads * hn + values
    else:
        if groups < heads and recompute != "selective":
            qkv += 2 * e * s * b * heads * hn  # k and v repeated to the query heads
        core = qkv
    if m.flash_attn and recompute != "selective":
        # flash-attn keeps q, k, v (counted above), its output (the projection input, below) and
        # the fp32 log-sum-exp [b, np, s]; not measurable on CPU (docs/planner.md)
        core += 4 * b * heads * s
    elif recompute != "selective":
        scores = e * heads * s * m.seq_length * b  # softmax output (a CP rank's queries x every key)
        core += scores + (scores + heads * s * m.seq_length * b if m.attention_dropout else 0)  # dropout out, mask
    if lay.cp > 1 and recompute != "selective":
        core += _cp_core_extra_bytes(m, lay, heads, groups)
    projection = e * s * b * heads * hn
    mlp = moe_mlp_activation_bytes(m, lay) if moe else _dense_mlp_bytes(m, s * b, f // t)
    return replicated + core + projection + mlp


def _cp_core_extra_bytes(m: ModelShape, lay: Layout, heads: int, groups: int) -> int:
    """Without recompute, what a CP rank's core attention keeps beyond the serial layer's terms at
    s/c tokens (layer_activation_bytes): a2a keeps the two int64 [s] permutations to and from position
    order, and its values are the all-to-all's own tensor where the serial MHA + RoPE + attention
    dropout layer's are a view of the QKV output (whose storage they keep); allgather keeps the int64 [s] order and keys and
    values of all s positions: the gathered [2, s, b, g/t, hn] (MHA without RoPE: the local ones are
    views of the QKV output), or the repeated [s, b, a/t, hn] pair (GQA). p2p: not modelled (module
    docstring)."""
    e, b, hn, s_all, s = _e(m), lay.micro_batch_size, m.kv_channels, m.seq_length, cp_tokens(m, lay)
    view_values = m.rope and groups == heads and m.attention_dropout  # v a view of the QKV output serially
    if lay.cp_comm_type == "a2a":
        # values: their own [s/c, b, a/t, hn] in place of the [s/c, b, (a + 2 g)/t, hn] QKV output
        return 16 * s_all - (2 * e * s * b * groups * hn if view_values else 0)
    if lay.cp_comm_type != "allgather":
        return 0
    if groups < heads:
        return 8 * s_all + 2 * e * (s_all - s) * b * heads * hn
    return 8 * s_all + (0 if m.rope else 2 * e * s_all * b * groups * hn)


def hybrid_layer_activation_bytes(m: ModelShape, lay: Layout, number: int, recompute: Optional[str] = None) -> int:
    """A hybrid model's layer `number` (no full recompute): a Mamba layer's (planner/mamba.py), an
    attention-only layer's (the GPT layer's terms without the MLP half), an MLP-only layer's or an
    MoE-only layer's (the MLP-only layer's norm half and moe_mlp_activation_bytes)."""
    kind = m.hybrid.kind(number)
    if kind == "M":
        return mamba_layer_activation_bytes(m, lay, _e(m))
    e, b, h = _e(m), lay.micro_batch_size, m.hidden_size
    local = m.seq_length // lay.tp if lay.sequence_parallel else m.seq_length
    stats = 8 if m.layernorm else 4
    mlp_half = local * b * (2 * e * h + stats + (h if m.hidden_dropout else 0))
    if kind == "E":
        return mlp_half + moe_mlp_activation_bytes(m, lay)
    mlp_half += _dense_mlp_bytes(m, m.seq_length * b, m.ffn_hidden_size // lay.tp)  # no CP: make_plan refuses it
    return mlp_half if kind == "-" else layer_activation_bytes(m, lay, recompute) - mlp_half


def _layers_activation_bytes(m: ModelShape, lay: Layout, numbers, recompute: Optional[str]) -> int:
    """The layers `numbers` of a chunk without full recompute (dense, MoE or hybrid)."""
    if m.hybrid is not None:
        return sum(hybrid_layer_activation_bytes(m, lay, n, recompute) for n in numbers)
    moe = _moe_count(m, numbers)
    total = (len(numbers) - moe) * layer_activation_bytes(m, lay, recompute)
    return total + (moe * layer_activation_bytes(m, lay, recompute, True) if moe else 0)


def _dense_mlp_bytes(m: ModelShape, rows: int, fl: int) -> int:
    """What a dense MLP of fl columns per rank keeps on `rows` tokens beyond its input: fc1's
    output and the activation's (SwiGLU: gate and up, silu(gate) unless fused, the product)."""
    if m.swiglu:
        return _e(m) * rows * (2 * fl + fl + (0 if m.swiglu_fused else fl))
    return 2 * _e(m) * rows * fl  # GeLU input and output


def expert_rows(m: ModelShape, lay: Layout) -> tuple:
    """(N, M) of one MoE layer and micro-batch on one rank: N the (token, expert) pairs of this
    rank's T = s/t x b tokens, M the rows its local experts run (over the ETP and EP peers).

    Without a capacity the routing is assumed balanced: each expert gets T k / E of every rank's
    tokens (the measurement forces such a routing). With --moe-expert-capacity-factor f each
    expert takes at most C = ceil(T k / E f) of a rank's tokens; with
    --moe-pad-expert-input-to-capacity exactly C (every token when C >= T): exact, whatever the
    routing."""
    import math

    moe, b = m.moe, lay.micro_batch_size
    s = cp_tokens(m, lay)
    tokens = (s // lay.tp if lay.sequence_parallel else s) * b
    e_, k = moe.num_experts, moe.topk
    per_expert = tokens * k / e_
    if moe.capacity_factor is not None:
        capacity = math.ceil(tokens * k / e_ * moe.capacity_factor)
        if moe.pad_to_capacity:
            per_expert = tokens if capacity >= tokens else capacity
        elif capacity < tokens:
            per_expert = min(per_expert, capacity)
    pairs = int(round(e_ * per_expert))
    return pairs, lay.expert_tp * pairs


def moe_mlp_activation_bytes(m: ModelShape, lay: Layout) -> int:
    """Bytes an MoE MLP keeps for backward per micro-batch on one rank beyond its input (the norm
    output, counted with the dense layer's; megatron/model/moe/): the router's fp32 top-k softmax
    and int64 indices [T, k] (pre-softmax: the softmax [T, E]), the aux loss's fp32 softmax and
    top-k indices, the capacity's keep mask [T, E] (bool); the dispatcher's int64 (token, expert)
    pairs (alltoall: [N, 2]; allgather: [M, 2] and the global expert index [M]), the experts'
    input [M, h], each expert's fc1 output and activation (grouped GEMM: also the stacked local
    weights and the int32 row offsets), the experts' output, its weights and the weighted output
    that the combine's index_add keeps ([N] rows alltoall, [M] allgather); the shared experts as a
    dense MLP; router dtype fp32/fp64: its copy of the input and of the router weight (the input
    itself then is kept only by the shared experts)."""
    moe, e, h = m.moe, _e(m), m.hidden_size
    t, etp = lay.tp, lay.expert_tp
    s = cp_tokens(m, lay)
    tokens = (s // t if lay.sequence_parallel else s) * lay.micro_batch_size
    n_pairs, rows = expert_rows(m, lay)
    e_, k = moe.num_experts, moe.topk
    total = 4 * tokens * e_ + 8 * tokens * k if moe.pre_softmax else 12 * tokens * k
    if moe.aux_loss:
        total += 4 * tokens * e_ + 8 * tokens * k + 4 * e_ + 4  # softmax, top-k, token counts, the loss
    if moe.capacity_factor is not None:
        total += tokens * e_
    if moe.router_dtype is not None:
        size = 4 if moe.router_dtype == "fp32" else 8
        total += size * tokens * h + size * e_ * h - (0 if moe.shared_ffn_hidden_size else e * tokens * h)
    f = moe.ffn_hidden_size // etp
    local = e_ // lay.ep
    if moe.dispatcher == "alltoall":
        total += 16 * n_pairs + e * n_pairs * (2 * h + 1)
    else:
        total += 24 * rows + e * rows * (2 * h + 1)
    total += e * rows * h  # the experts' input
    if moe.grouped_gemm and local > 1:
        if (h * e) % 16 or (f * e) % 16:
            raise PlanError("--moe-grouped-gemm with a hidden or expert width (per ETP rank) not a multiple of "
                            "16 bytes: the batched fallback's memory is not modelled")
        total += e * local * ((3 if m.swiglu else 2) * f * h) + 4 * local  # the stacked weights, int32 offsets
        total += 8 * rows if m.add_bias_linear else 0  # the expert index of every row, for the biases
    total += e * rows * (4 * f if m.swiglu else 2 * f)  # fc1 output; silu(gate) and the product (or GeLU's)
    if moe.shared_ffn_hidden_size:
        total += _dense_mlp_bytes(m, s * lay.micro_batch_size, moe.shared_ffn_hidden_size // t)
    return total


def full_recompute_kept_bytes(m: ModelShape, lay: Layout) -> int:
    """Full recompute: what one checkpointed group of layers keeps per micro-batch, its input
    [s/c, b, h] (over t with SP or --distribute-saved-activations)."""
    split = lay.sequence_parallel or lay.distribute_saved_activations
    return _e(m) * cp_tokens(m, lay) * lay.micro_batch_size * m.hidden_size // (lay.tp if split else 1)


def chunk_activation_bytes(m: ModelShape, lay: Layout, stage: int, chunk: int) -> int:
    """Bytes one model chunk keeps for backward per micro-batch on one TP rank, its layers plus
    the embedding (first) and the final norm, output layer and cross entropy (last); s is a CP
    rank's s/c tokens."""
    e, t, b, s, h = _e(m), lay.tp, lay.micro_batch_size, cp_tokens(m, lay), m.hidden_size
    local = s // t if lay.sequence_parallel else s
    numbers = chunk_layer_numbers(m, lay, stage, chunk)
    first = stage == 0 and chunk == 0
    last = stage == lay.pp - 1 and chunk == lay.vpp - 1
    if lay.recompute == "full":
        kept_input = full_recompute_kept_bytes(m, lay)
        n = lay.recompute_num_layers
        if lay.recompute_method == "block":
            total = n * kept_input + _layers_activation_bytes(m, lay, numbers[n:], None)
        else:
            total = (len(numbers) // n) * kept_input
    else:
        total = _layers_activation_bytes(m, lay, numbers, lay.recompute)
    # Made once per forward and shared by the chunk's layers: RoPE's fp32 angles [s, 1, 1, hn],
    # and the [1, 1, s, s] bool causal mask, which the recompute checkpoints keep as an input
    # (under CP the rank's [s/c, 1, 1, hn] angles and [1, 1, s/c, s] rows of the mask).
    total += 4 * s * m.kv_channels if m.rope else 0
    total += s * m.seq_length if lay.recompute else 0
    if first:
        total += 8 * s * b * (2 if m.learned_positions else 1)  # token (and position) ids, int64
        total += s * b if t > 1 else 0  # VocabParallelEmbedding's bool mask of ids outside its slice
        total += e * local * b * h if m.hidden_dropout else 0  # the embedding dropout's mask (in e bytes)
    if last:
        total += local * b * (e * h + (8 if m.layernorm else 4))  # final norm input and statistics
        total += e * local * b * h  # the output layer's input
        vocab = m.padded_vocab_size // t
        # cross entropy: t = 1 keeps its gradient in the logits' dtype; t > 1 the fp32 softmax
        # and the target's [s, b] bool and int64
        total += e * s * b * vocab if t == 1 else 4 * s * b * vocab + 9 * s * b
    return total


def recompute_working_bytes(m: ModelShape, lay: Layout) -> int:
    """Full recompute: what one group of recompute_num_layers layers holds while its backward
    reruns it (one micro-batch); 0 otherwise. Not kept between micro-batches, so not in the
    saved-tensor measurement, but part of the peak."""
    if lay.recompute != "full":
        return 0
    if m.hybrid is not None:
        widest = max(hybrid_layer_activation_bytes(m, lay, n) for n in range(1, m.num_layers + 1))
    else:
        widest = max(layer_activation_bytes(m, lay, moe=moe) for moe in ({False, m.moe is not None}))
    return lay.recompute_num_layers * widest


# ----------------------------------------------------------------------------- schedule


def in_flight_units(lay: Layout, stage: int) -> list[int]:
    """Micro-batches each chunk of pipeline rank `stage` holds at once, at the start of the
    first backward (the schedule's peak): 1F1B keeps min(p - stage, m) of its one chunk; the
    interleaved schedule runs (p - stage - 1) x 2 + (v - 1) x p warm-up forwards plus one, in
    Megatron's order (groups of p micro-batches per chunk), so its chunks hold different counts."""
    m = lay.num_microbatches
    if lay.vpp == 1:
        return [min(lay.pp - stage, m)]
    total = min((lay.pp - stage - 1) * 2 + (lay.vpp - 1) * lay.pp + 1, m * lay.vpp)
    counts = [0] * lay.vpp
    for k in range(total):
        counts[(k // lay.pp) % lay.vpp] += 1
    return counts


def stage_activation_bytes(m: ModelShape, lay: Layout, stage: int) -> int:
    """Activation bytes pipeline rank `stage` keeps at its peak: per chunk, the micro-batches in
    flight times the chunk's bytes per micro-batch (recompute_working_bytes not included)."""
    return sum(units * chunk_activation_bytes(m, lay, stage, c) for c, units in enumerate(in_flight_units(lay, stage)))


def pipeline_bubble(lay: Layout) -> float:
    """The fraction of ideal time the pipeline idles: (p - 1) / (v m) (Narayanan et al. 2021)."""
    return (lay.pp - 1) / (lay.vpp * lay.num_microbatches)


# ----------------------------------------------------------------------------- transients

_LOSS_CHUNK_BYTES = 4 << 20  # the one-rank cross entropy's fp32 probabilities per chunk of tokens


def _weight_grad_bytes(m: ModelShape, n: int) -> int:
    """What the weight gradient of an n-element weight allocates on its way into the fp32 (or
    half) main_grad: a half-precision product plus the fp32 copy main_grad.add_ makes of it, or,
    when the dtypes agree, the placeholder gradient the fused accumulation returns."""
    e = _e(m)
    grad = 4 if m.grads_fp32 or m.params_dtype == "fp32" else 2
    return (e + grad) * n if grad != e else e * n


def loss_transient_bytes(m: ModelShape, lay: Layout) -> int:
    """The last stage's most bytes beyond what autograd keeps, around the loss: the cross
    entropy's forward (the logits, which nothing saves, and its fp32 working copies), its backward
    (t > 1: the softmax's clone and its cast) and the output layer's backward (the logits' and its
    input's gradients, the weight gradient). At a 128k vocabulary the logits alone are s b V e
    (s/c under CP)."""
    e, t, b, s, h = _e(m), lay.tp, lay.micro_batch_size, cp_tokens(m, lay), m.hidden_size
    vocab = m.padded_vocab_size // t
    tokens = s * b
    logits = e * tokens * vocab  # [s, b, V/t]
    gathered = e * tokens * h if lay.sequence_parallel else 0  # the output layer's all-gathered input
    if t == 1 and m.fast_loss:
        # chunks of fp32 probabilities: the previous chunk's is still referenced when the next is made,
        # and the chunk itself is copied to fp32 (or, with padding, to a contiguous copy)
        real = min(m.vocab_size or m.padded_vocab_size, m.padded_vocab_size)
        rows = min(tokens, max(1, _LOSS_CHUNK_BYTES // (4 * real)))
        live = 2 if tokens > rows else 1
        copies = 1 if e != 4 or real < m.padded_vocab_size else 0
        forward = logits + 4 * rows * real * (live + copies)
        backward, grad_logits = 0, 0  # scales the saved gradient in place, which becomes the logits' gradient
    else:
        forward = logits + 4 * tokens * vocab  # the fp32 copy; its exp is the saved softmax
        backward = 4 * tokens * vocab + (logits if e != 4 else 0)  # the softmax's clone, cast to the logits' dtype
        grad_logits = logits - 4 * tokens * vocab  # replaces the saved softmax
    output = grad_logits + e * tokens * h + _weight_grad_bytes(m, vocab * h)
    return max(forward + gathered, backward, output + gathered)


def layer_transient_bytes(m: ModelShape, lay: Layout) -> int:
    """A layer's most bytes beyond what autograd keeps during its backward: the MLP's first linear
    (the gradient of its output, of its input and two of the residual stream, and its weight
    gradient) or the core attention's (the gradients of the [b, np, s, s] probabilities and
    scores, without flash attention; [b, np, s/c, s] under CP)."""
    e, t, b, s, h = _e(m), lay.tp, lay.micro_batch_size, cp_tokens(m, lay), m.hidden_size
    rows = (2 if m.swiglu else 1) * m.ffn_hidden_size // t  # fc1's output features per rank
    mlp = 3 * e * s * b * h + e * s * b * rows + _weight_grad_bytes(m, rows * h)
    attention = 0 if m.flash_attn else 2 * e * b * (m.num_attention_heads // t) * s * m.seq_length
    return max(mlp, attention)


_GENERATOR_STATE_BYTES = 5056  # torch.get_rng_state() of the CPU generator (mt19937), a uint8 tensor


def checkpoint_rng_bytes(m: ModelShape, lay: Layout, stage: int) -> int:
    """Recompute's checkpoints keep, outside autograd's saved tensors, the generator states of
    their forward (the CPU generator and the tensor-parallel tracker's stream, each 5056 bytes on
    CPU): per checkpointed unit (each layer with selective, each group of recompute_num_layers with
    full) and micro-batch in flight, plus one micro-batch more, whose released graph the measured
    runs still held (its states are freed by Python's garbage collector, not at once)."""
    if not lay.recompute:
        return 0
    units = m.num_layers // (lay.pp * lay.vpp)
    if lay.recompute == "full":
        units = lay.recompute_num_layers if lay.recompute_method == "block" else units // lay.recompute_num_layers
    return 2 * _GENERATOR_STATE_BYTES * units * (sum(in_flight_units(lay, stage)) + 1)


def transient_bytes(m: ModelShape, lay: Layout, stage: int) -> int:
    """Pipeline rank `stage`'s most bytes held beyond its saved activations at their peak
    (stage_activation_bytes) at any moment of a step: a layer's backward (with full recompute on
    top of the rerun group's activations), the loss on the last stage, and on the first stage the
    embedding's weight gradient (when the micro-batch's own activations are already freed)."""
    phases = [layer_transient_bytes(m, lay) + recompute_working_bytes(m, lay)]
    if stage == lay.pp - 1:
        phases.append(loss_transient_bytes(m, lay))
    if stage == 0:
        freed = chunk_activation_bytes(m, lay, 0, 0)
        phases.append(_weight_grad_bytes(m, m.padded_vocab_size // lay.tp * m.hidden_size) - freed)
    return max(phases) + checkpoint_rng_bytes(m, lay, stage)
