"""The plan of a layout on a device: per pipeline stage (every TP and DP rank of a stage holds the
same), memory, communication, compute and the predicted step time and MFU; and the search over
layouts.

Time model (stated, simple): a stage computes its FLOPs (recompute included) at
peak x compute_efficiency; TP and PP traffic sits on the critical path; the pipeline stretches
that by the bubble (p - 1) / (v m); the DP gradient reduction is exposed whole, or with
--overlap-grad-reduce only what the last micro-batch's backward cannot hide. Collectives are
ring algorithms at the link bandwidth of the group (inside a node or across nodes, ranks placed
in Megatron's tp-cp-dp-pp order); latency is left out.

Context parallelism (c): a rank computes 1/c of its DP replica's FLOPs; its attention exchanges
(megatron/core/context_parallel.py's cp_exchange_bytes, the formula bench/context_parallel.py checks
against the counted bytes; 3/2 of it with recompute, whose rerun forward exchanges again) sit on the
critical path like TP's; the gradients are reduced, and the distributed optimizer sharded, over the
d x c ranks of a stage's DP x CP group.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

from megatron.core.context_parallel import cp_exchange_bytes
from megatron.planner.mamba import hybrid_layer_flops_per_sequence
from megatron.planner.model import (
    PARAM_BYTES,
    PlanError,
    Layout,
    ModelShape,
    bytes_per_parameter,
    chunk_layer_numbers,
    cp_tokens,
    expert_rows,
    in_flight_units,
    pipeline_bubble,
    recompute_working_bytes,
    shape_at_tp,
    stage_activation_bytes,
    stage_expert_parameters,
    stage_parameters,
    transient_bytes,
)

GIB = 1024 ** 3
MEMORY_KEYS = ("model_params", "grads", "main_params", "main_grads", "optimizer_state", "activations")


@dataclass(frozen=True)
class Device:
    """One accelerator and its links. Defaults: an 80 GB H100-class device (989 dense bf16
    TFLOP/s), 8 per node on NVLink (3600 Gbit/s = 450 GB/s per direction), one 400 Gbit/s NIC
    per device across nodes."""

    memory_gb: float = 80.0
    devices_per_node: int = 8
    peak_tflops: float = 989.0
    intra_node_gbps: float = 3600.0
    inter_node_gbps: float = 400.0
    compute_efficiency: float = 0.6  # the fraction of peak the GEMMs reach
    memory_reserve: float = 0.1  # kept free: allocator slack, workspaces, the runtime's context

    @property
    def usable_bytes(self) -> float:
        return self.memory_gb * 1e9 * (1 - self.memory_reserve)


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """The device flags of tools/plan.py and pretrain_gpt.py --dry-run."""
    group = parser.add_argument_group(title="planner device")
    d = Device()
    group.add_argument("--device-memory-gb", type=float, default=d.memory_gb, help="Memory per device (GB, 1e9).")
    group.add_argument("--devices-per-node", type=int, default=d.devices_per_node)
    group.add_argument("--peak-tflops", type=float, default=d.peak_tflops, help="Dense peak TFLOP/s per device "
                       "in the training dtype.")
    group.add_argument("--intra-node-gbps", type=float, default=d.intra_node_gbps,
                       help="Per-device bandwidth inside a node, Gbit/s per direction.")
    group.add_argument("--inter-node-gbps", type=float, default=d.inter_node_gbps,
                       help="Per-device bandwidth across nodes, Gbit/s per direction.")
    group.add_argument("--compute-efficiency", type=float, default=d.compute_efficiency,
                       help="Fraction of the peak that the model's GEMMs reach.")
    group.add_argument("--memory-reserve", type=float, default=d.memory_reserve,
                       help="Fraction of device memory a plan leaves free.")


def device_from_args(args: argparse.Namespace) -> Device:
    return Device(memory_gb=args.device_memory_gb, devices_per_node=args.devices_per_node,
                  peak_tflops=args.peak_tflops, intra_node_gbps=args.intra_node_gbps,
                  inter_node_gbps=args.inter_node_gbps, compute_efficiency=args.compute_efficiency,
                  memory_reserve=args.memory_reserve)


@dataclass
class RankPlan:
    """One pipeline stage's rank (any of its TP and DP ranks)."""

    stage: int
    parameters: int  # expert parameters included
    memory: dict  # bytes by MEMORY_KEYS, plus "recompute_working" and "transient" (which includes it)
    in_flight: list
    expert_parameters: int = 0
    comm: dict = field(default_factory=dict)  # bytes sent per step by "tp", "cp", "pp", "dp" (DP x CP), "ep", "edp" (expert DP)
    flops: float = 0.0  # this rank's FLOPs per step, recompute included
    compute_s: float = 0.0
    comm_s: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.memory[key] for key in MEMORY_KEYS)

    @property
    def peak_bytes(self) -> int:
        return self.total_bytes + self.memory["transient"]

    def memory_breakdown(self) -> dict:
        out = {key: self.memory[key] for key in MEMORY_KEYS}
        out["total"] = self.total_bytes
        return out


def plan_rank(m: ModelShape, lay: Layout, stage: int) -> RankPlan:
    """Memory of pipeline rank `stage` (bytes; the optimizer table applied to its parameters)."""
    params = stage_parameters(m, lay, stage)
    experts = stage_expert_parameters(m, lay, stage)
    per_param = bytes_per_parameter(m.params_dtype, m.grads_fp32, lay.distributed_optimizer, lay.dp * lay.cp)
    per_expert = bytes_per_parameter(m.params_dtype, m.grads_fp32, lay.distributed_optimizer, lay.expert_dp)
    memory = {key: int(round(per_param[key] * (params - experts) + per_expert[key] * experts))
              for key in MEMORY_KEYS[:5]}
    memory["activations"] = stage_activation_bytes(m, lay, stage)
    memory["recompute_working"] = recompute_working_bytes(m, lay)
    memory["transient"] = transient_bytes(m, lay, stage)
    return RankPlan(stage=stage, parameters=params, memory=memory, in_flight=in_flight_units(lay, stage),
                    expert_parameters=experts)


# ----------------------------------------------------------------------------- FLOPs and time


def layer_flops_per_sequence(m: ModelShape, moe: bool = False) -> float:
    """training_log.num_floating_point_operations's per-layer term (forward + backward, one
    sequence); for an MoE layer its attention and shared experts only (expert_flops_per_micro_batch
    has the routed experts)."""
    s, h, a, g = m.seq_length, m.hidden_size, m.num_attention_heads, m.num_query_groups
    q_ratio = m.kv_channels * a / h
    attention = 12 * h * h * (1 + g / a + s / (2 * h)) * q_ratio
    f = m.moe.shared_ffn_hidden_size if moe else m.ffn_hidden_size
    mlp = 12 * h * f * (1.5 if m.swiglu else 1.0)
    return s * (attention + mlp)


def expert_flops_per_micro_batch(m: ModelShape, lay: Layout) -> float:
    """FLOPs the local experts of one MoE layer run per micro-batch on one rank (forward + backward):
    12 h (f / ETP) (3/2 with SwiGLU) per row, for the M rows of expert_rows (capacity padding included)."""
    _, rows = expert_rows(m, lay)
    return 12 * m.hidden_size * (m.moe.ffn_hidden_size / lay.expert_tp) * (1.5 if m.swiglu else 1.0) * rows


def flops_per_step(m: ModelShape, global_batch_size: int) -> float:
    """Model FLOPs of one iteration: training_log.num_floating_point_operations's formula, in
    its order of operations (so the two agree to the bit); recompute is not counted. An MoE
    layer counts the experts a token runs: top-k x moe_ffn_hidden_size + the shared experts. A hybrid
    model counts each layer by its kind (hybrid_layer_flops_per_sequence), as its log line does."""
    s, layers, h, a, g = m.seq_length, m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups
    if m.hybrid is not None:
        per_sequence = sum(hybrid_layer_flops_per_sequence(m, kind) for kind in m.hybrid.pattern)
        if "E" in m.hybrid.pattern:  # the routed experts a token runs
            per_sequence += m.hybrid.pattern.count("E") * 12 * s * h * m.moe.ffn_hidden_size * m.moe.topk * \
                (1.5 if m.swiglu else 1.0)
        return global_batch_size * (per_sequence + 6 * s * h * m.padded_vocab_size)
    q_ratio = m.kv_channels * a / h
    gated = 1.5 if m.swiglu else 1.0
    attention = 12 * layers * h * h * (1 + g / a + s / (2 * h)) * q_ratio
    mlp = 12 * layers * h * m.ffn_hidden_size * gated
    if m.moe is not None:
        moe_layers = len(m.moe.layers)
        moe_ffn = m.moe.ffn_hidden_size * m.moe.topk + m.moe.shared_ffn_hidden_size
        mlp = 12 * h * gated * ((layers - moe_layers) * m.ffn_hidden_size + moe_layers * moe_ffn)
    logits = 6 * h * m.padded_vocab_size
    return global_batch_size * s * (attention + mlp + logits)


def _recompute_flops_per_layer(m: ModelShape, lay: Layout, moe: bool = False, kind: str | None = None) -> float:
    """Per sequence: the dense part's rerun (full: its forward; selective: the scores and x V, of an
    attention layer only). kind: a hybrid model's layer symbol."""
    if lay.recompute == "full":
        forward = layer_flops_per_sequence(m, moe) if kind is None else hybrid_layer_flops_per_sequence(m, kind)
        return forward / 3  # the forward again
    if lay.recompute == "selective" and kind in (None, "*"):
        q_ratio = m.kv_channels * m.num_attention_heads / m.hidden_size
        return 2 * m.seq_length * m.seq_length * m.hidden_size * q_ratio  # scores and x V, forward
    return 0.0


def _stage_flops(m: ModelShape, lay: Layout, stage: int) -> float:
    """This rank's FLOPs per step, recompute included: the dense parts of its layers over t c, its
    local experts' rows (of its s/c tokens), the logits on the last stage (over t c)."""
    sequences = lay.global_batch_size // lay.dp  # per DP rank and step
    numbers = [n for chunk in range(lay.vpp) for n in chunk_layer_numbers(m, lay, stage, chunk)]
    moe = sum(m.is_moe_layer(n) for n in numbers)
    if m.hybrid is not None:  # each layer by its kind; an E layer's routed experts by rows below
        kinds = [m.hybrid.kind(n) for n in numbers]
        total = sequences * sum(hybrid_layer_flops_per_sequence(m, kind) + _recompute_flops_per_layer(m, lay, kind=kind)
                                for kind in kinds) / (lay.tp * lay.cp)
        if moe:
            moe_rerun = 4 / 3 if lay.recompute == "full" else 1.0
            total += moe * lay.num_microbatches * expert_flops_per_micro_batch(m, lay) * moe_rerun
        if stage == lay.pp - 1:
            total += sequences * 6 * m.hidden_size * m.padded_vocab_size * m.seq_length / (lay.tp * lay.cp)
        return total
    dense = (layer_flops_per_sequence(m) + _recompute_flops_per_layer(m, lay)) / (lay.tp * lay.cp)
    total = sequences * (len(numbers) - moe) * dense
    if moe:
        rerun = 4 / 3 if lay.recompute == "full" else 1.0
        per_sequence = layer_flops_per_sequence(m, True) + _recompute_flops_per_layer(m, lay, True)
        total += moe * sequences * per_sequence / (lay.tp * lay.cp)
        total += moe * lay.num_microbatches * expert_flops_per_micro_batch(m, lay) * rerun
    if stage == lay.pp - 1:
        total += sequences * 6 * m.hidden_size * m.padded_vocab_size * m.seq_length / (lay.tp * lay.cp)
    return total


def _ring(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce / all-gather / reduce-scatter of nbytes over n ranks."""
    if n <= 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n * nbytes


def _bandwidths(lay: Layout, dev: Device) -> dict:
    gbps = lambda inside: (dev.intra_node_gbps if inside else dev.inter_node_gbps) * 1e9 / 8  # noqa: E731
    n = dev.devices_per_node
    # expert grid (etp, ep, expert-dp, pp): an EP group spans etp x ep consecutive ranks, an
    # expert-DP group the stage's t c d ranks
    tcd = lay.tp * lay.cp * lay.dp
    return {"tp": gbps(lay.tp <= n), "cp": gbps(lay.tp * lay.cp <= n), "dp": gbps(tcd <= n), "pp": gbps(tcd < n),
            "ep": gbps(lay.expert_tp * lay.ep <= n), "edp": gbps(tcd <= n)}


def _stage_comm(m: ModelShape, lay: Layout, rank: RankPlan) -> dict:
    e = 4 if m.params_dtype == "fp32" else 2
    t, d, b, s, h = lay.tp, lay.dp, lay.micro_batch_size, cp_tokens(m, lay), m.hidden_size
    mbs_per_step = lay.num_microbatches
    numbers = [n for c in range(lay.vpp) for n in chunk_layer_numbers(m, lay, rank.stage, c)]
    moe_layers = sum(m.is_moe_layer(n) for n in numbers)
    act = e * s * b * h  # one [s, b, h] activation ([s/c, b, h] under CP)
    full = lay.recompute == "full"  # the recomputed forward communicates again
    if lay.sequence_parallel:  # forward 2 AG + 2 RS, backward 2 RS + 2 AG + 2 AG of the saved inputs
        per_layer = (10 + (4 if full else 0)) * _ring("all_gather", act, t)
    else:  # forward 2 AR, backward 2 AR
        per_layer = (4 + (2 if full else 0)) * _ring("all_reduce", act, t)
    # An MoE layer's MLP does no TP collective (the dispatcher moves its tokens) unless it has shared experts.
    moe_tp = per_layer if m.moe is not None and m.moe.shared_ffn_hidden_size else per_layer / 2
    ends = (rank.stage == 0) + (rank.stage == lay.pp - 1)  # embedding reduce, output layer's input grad
    blocks = (len(numbers) - moe_layers) * per_layer + moe_layers * moe_tp
    if m.hybrid is not None:  # one block per layer (a mixer, attention, MLP or MoE): half a GPT layer's
        shared = m.moe is not None and m.moe.shared_ffn_hidden_size
        blocks = sum(per_layer / 2 for n in numbers if m.hybrid.kind(n) != "E" or shared)
    tp = mbs_per_step * (blocks + ends * _ring("all_reduce", act, t))
    ep = mbs_per_step * moe_layers * _dispatch_bytes(m, lay) * (1.5 if full else 1.0) if moe_layers else 0.0
    sent = act // (t if lay.sequence_parallel else 1)  # a stage's output (its s/t slice under SP)
    boundaries = lay.vpp * 2 - (rank.stage == 0) - (rank.stage == lay.pp - 1) if lay.pp > 1 else 0
    pp = mbs_per_step * sent * boundaries  # activations forward, their gradients backward
    grad_bytes = 4 if m.grads_fp32 or m.params_dtype == "fp32" else 2

    def reduce(params: int, n: int) -> float:
        if lay.distributed_optimizer:
            gather = _ring("all_gather", params * PARAM_BYTES[m.params_dtype], n)
            return _ring("reduce_scatter", params * grad_bytes, n) + gather
        return _ring("all_reduce", params * grad_bytes, n)

    dp = reduce(rank.parameters - rank.expert_parameters, d * lay.cp)  # over DP x CP
    if lay.pp > 1 and m.tied_embeddings and rank.stage in (0, lay.pp - 1):
        dp += _ring("all_reduce", m.padded_vocab_size // t * h * grad_bytes, 2)  # the tied embedding's grads
    # CP: every layer's exchange per micro-batch, the forward's again when recompute reruns it
    cp = mbs_per_step * cp_exchange_bytes(lay.cp_comm_type, lay.cp, len(numbers), m.seq_length, b,
                                          m.num_attention_heads // t, max(1, m.num_query_groups // t), m.kv_channels,
                                          e, sent=True) * (1.5 if lay.recompute else 1.0)
    return {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep, "edp": reduce(rank.expert_parameters, lay.expert_dp)}


def _dispatch_bytes(m: ModelShape, lay: Layout) -> float:
    """Bytes one rank sends for one MoE layer and micro-batch, forward and backward.

    alltoall: the dispatch and the combine each send the pairs routed to other EP ranks
    ((EP - 1) / EP of the N [h] rows, balanced), forward and backward (4 all-to-alls); with
    ETP > 1 the received rows are all-gathered and the outputs reduce-scattered over ETP (and the
    transposes backward). allgather: the tokens [T, h], probs [T, E] and routing map (1 byte)
    all-gathered over the ETP x EP group, the output reduce-scattered, and the transposes of
    the first two and the last backward."""
    e, h = (4 if m.params_dtype == "fp32" else 2), m.hidden_size
    pairs, rows = expert_rows(m, lay)
    if m.moe.dispatcher == "alltoall":
        sent = 4 * e * h * pairs * (lay.ep - 1) / lay.ep
        return sent + 4 * _ring("all_gather", e * rows * h, lay.expert_tp)
    group = lay.expert_tp * lay.ep
    s = cp_tokens(m, lay)
    tokens = (s // lay.tp if lay.sequence_parallel else s) * lay.micro_batch_size
    probs_e = {"fp32": 4, "fp64": 8}.get(m.moe.router_dtype, e)
    probs = probs_e * group * tokens * m.moe.num_experts
    return (4 * _ring("all_gather", e * group * tokens * h, group) + 2 * _ring("all_gather", probs, group)
            + _ring("all_gather", group * tokens * m.moe.num_experts, group))


@dataclass
class Plan:
    """A layout's plan on a device: one RankPlan per pipeline stage."""

    shape: ModelShape
    layout: Layout
    device: Device
    ranks: list
    flops_per_step: float
    bubble: float
    step_s: float
    mfu: float
    overlap_grad_reduce: bool = False

    @property
    def fits(self) -> bool:
        return max(r.peak_bytes for r in self.ranks) <= self.device.usable_bytes

    @property
    def peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.ranks)


def make_plan(m: ModelShape, lay: Layout, dev: Device, overlap_grad_reduce: bool = False) -> Plan:
    """Memory, communication, time and MFU of every stage of the layout."""
    if lay.cp > 1 and m.hybrid is not None:
        raise PlanError("--context-parallel-size > 1 with Mamba layers is not modelled by the planner")
    bw = _bandwidths(lay, dev)
    peak = dev.peak_tflops * 1e12
    ranks, stage_times = [], []
    for stage in range(lay.pp):
        rank = plan_rank(m, lay, stage)
        rank.flops = _stage_flops(m, lay, stage)
        rank.compute_s = rank.flops / (peak * dev.compute_efficiency)
        rank.comm = _stage_comm(m, lay, rank)
        rank.comm_s = {key: value / bw[key] for key, value in rank.comm.items()}
        dp_exposed = rank.comm_s["dp"] + rank.comm_s["edp"]
        if overlap_grad_reduce:  # hidden behind the backward of the last micro-batch (2/3 of its compute)
            dp_exposed = max(0.0, dp_exposed - rank.compute_s / lay.num_microbatches * 2 / 3)
        busy = rank.compute_s + rank.comm_s["tp"] + rank.comm_s["cp"] + rank.comm_s["pp"] + rank.comm_s["ep"]
        stage_times.append((busy, dp_exposed))
        ranks.append(rank)
    bubble = pipeline_bubble(lay)
    step = max(busy for busy, _ in stage_times) * (1 + bubble) + max(dp for _, dp in stage_times)
    total_flops = flops_per_step(m, lay.global_batch_size)
    mfu = total_flops / (step * lay.world_size * peak)
    return Plan(m, lay, dev, ranks, total_flops, bubble, step, mfu, overlap_grad_reduce)


# ----------------------------------------------------------------------------- search


def _divisors(n: int) -> list:
    return [k for k in range(1, n + 1) if n % k == 0]


def _expert_layouts(m: ModelShape, tp: int, dp: int) -> list:
    """(ep, etp) pairs for an MoE model at this TP x DP (the flags' rules: EP divides the experts,
    ETP x EP divides t d, ETP divides the expert width, expert biases only at ETP 1); ETP is 1 or
    t. A dense model: [(1, None)]."""
    if m.moe is None:
        return [(1, None)]
    pairs = []
    for etp in sorted({1, tp}):
        if m.moe.ffn_hidden_size % etp or (etp > 1 and m.add_bias_linear):
            continue
        for ep in _divisors(m.moe.num_experts):
            if (tp * dp) % (etp * ep) == 0:
                pairs.append((ep, None if etp == tp else etp))
    return pairs


def _cp_choices(m: ModelShape, tp: int, sizes: Optional[list]) -> list:
    """(cp, comm type) pairs at this TP: each size of `sizes` (default [1]) that the flags accept
    (s divisible by 2 c; a hybrid model: CP 1 only), with p2p and allgather, and a2a where c divides
    the rank's a/t heads (Ulysses' rule)."""
    pairs = []
    for cp in sizes or [1]:
        if cp == 1:
            pairs.append((1, "p2p"))
        elif m.seq_length % (2 * cp) == 0 and m.hybrid is None:
            pairs += [(cp, kind) for kind in ("p2p", "allgather", "a2a")
                      if kind != "a2a" or (m.num_attention_heads // tp) % cp == 0]
    return pairs


def candidate_layouts(m: ModelShape, base: Layout, world_size: int, devices_per_node: int,
                      micro_batch_sizes: Optional[list] = None,
                      context_parallel_sizes: Optional[list] = None) -> Iterator[Layout]:
    """Every TP x CP x PP x DP x VPP x recompute x SP x distributed-optimizer (x EP x ETP for an MoE
    model) layout of world_size that the flags' validation would accept: TP inside a node
    dividing heads and groups, layers even over the (virtual) stages, the batch a whole number
    of micro-batches (a multiple of p for VPP); an MoE model with TP > 1 takes SP (Megatron's rule);
    CP only at the sizes asked for (_cp_choices; with SP, s/c divisible by t)."""
    for tp in _divisors(world_size):
        if tp > devices_per_node or m.num_attention_heads % tp or m.num_query_groups % tp:
            continue
        for cp, cp_kind in _cp_choices(m, tp, context_parallel_sizes):
            if (world_size // tp) % cp:
                continue
            yield from _layouts_at(m, base, world_size, tp, cp, cp_kind, micro_batch_sizes)


def _layouts_at(m: ModelShape, base: Layout, world_size: int, tp: int, cp: int, cp_kind: str,
                micro_batch_sizes: Optional[list]) -> Iterator[Layout]:
    """candidate_layouts at one TP size and CP size / comm type."""
    for pp in _divisors(world_size // (tp * cp)):
        if m.num_layers % pp:
            continue
        dp = world_size // (tp * cp * pp)
        for mbs in micro_batch_sizes or [base.micro_batch_size]:
            if base.global_batch_size % (mbs * dp):
                continue
            micro = base.global_batch_size // (mbs * dp)
            vpps = [v for v in _divisors(m.num_layers // pp) if v == 1 or (pp > 1 and micro % pp == 0 and v <= 8)]
            sps = (False,) if tp == 1 else (True,) if m.moe is not None else (False, True)
            sps = tuple(sp for sp in sps if not sp or (m.seq_length // cp) % tp == 0)
            for vpp in vpps:
                for recompute in (None, "selective", "full"):
                    for sp in sps:
                        for distopt in ((False, True) if dp * cp > 1 else (False,)):
                            for ep, etp in _expert_layouts(m, tp, dp * cp):
                                yield replace(base, tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch_size=mbs,
                                              sequence_parallel=sp, recompute=recompute,
                                              recompute_method="uniform" if recompute == "full" else None,
                                              recompute_num_layers=1 if recompute == "full" else None,
                                              distribute_saved_activations=False, distributed_optimizer=distopt,
                                              ep=ep, etp=etp, cp=cp, cp_comm_type=cp_kind)


def search(m: ModelShape, base: Layout, dev: Device, world_size: int, top: int = 10,
           overlap_grad_reduce: bool = False, micro_batch_sizes: Optional[list] = None,
           context_parallel_sizes: Optional[list] = None) -> tuple:
    """(the `top` fitting plans by predicted step time, how many layouts were tried, how many fit)."""
    layouts = candidate_layouts(m, base, world_size, dev.devices_per_node, micro_batch_sizes, context_parallel_sizes)
    plans = [make_plan(shape_at_tp(m, lay.tp), lay, dev, overlap_grad_reduce) for lay in layouts]
    fitting = sorted((p for p in plans if p.fits), key=lambda p: (p.step_s, p.peak_bytes))
    return fitting[:top], len(plans), len(fitting)
