"""The planner's Mamba layers (megatron/model/mamba/): parameters, inference state and the activations
autograd keeps, per layer and TP rank, as plain arithmetic (no tensors, no process group).

Notation: s sequence, b micro-batch, h hidden, t TP, e bytes per element of the layer's dtype; the
mixer's d_in = nh hd inner channels, nh heads of hd, ng groups, n state, k = 4 conv taps, L chunk size,
c = ceil(s / L) chunks and s' = c L the padded length; per rank nh/t heads, ng/t groups, ch = (d_in +
2 ng n)/t conv channels, P = (2 d_in + 2 ng n + nh)/t in_proj rows.

Activations (mixer.py and fused_kernels/fused_ssd.py in fp32; counted from what autograd saves, checked against
saved_tensor_bytes in tests/unit/test_planner_mamba.py):
    norm                the layer's input and the normed input (e h each per token), 1/rms (fp32), the
                        residual dropout's 1-byte mask (with --hidden-dropout)
    in_proj / conv      in_proj's output P, the conv's window ch (s + k - 1), its output and silu's (ch each)
    dt                  softplus's input and output (fp32, nh/t each per token), A = -exp(A_log) twice (fp32)
    scan, within chunks the decay exp(segment sums), C B^T and their product: 3 x 4 b nh/t c L^2, and the
                        two L x L bool masks
    scan, operands      batched-matmul copies of B and C (5 x 4 s' b nh/t n; one chunk: 4) and of x dt
                        (3 x 4 s' b nh/t hd), the decays to the chunk's end and from its start (2 x 4 s' b nh/t)
    scan, across chunks exp of the (c+1) x (c+1) segment sums (4 b nh/t (c+1)^2 and two bool masks), the
                        stacked chunk states 4 b nh/t (c+1) hd n and the entering states 4 b nh/t c hd n
    gated norm / out    the scan's output, silu(z), the gated product, the normed output and out_proj's
                        input (e d_in/t each), 1/rms per group (fp32 ng/t)
In bf16 / fp16 the scan still runs in fp32 (its fp32 copies of x, B and C are not counted: the plan
is exact in fp32 only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HybridShape:
    """A hybrid model's layer pattern (M Mamba, * attention, - MLP, E MoE) and its Mamba sizes."""

    pattern: str
    state_dim: int
    head_dim: int
    num_groups: int
    num_heads: int
    d_conv: int = 4
    chunk_size: int = 128

    def kind(self, number: int) -> str:
        """The symbol of the 1-based layer `number`."""
        return self.pattern[number - 1]

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim


def hybrid_shape_from_args(args: Any) -> HybridShape | None:
    """The HybridShape of validated pretrain_mamba.py args, None for a model that is not hybrid."""
    from megatron.training.config_builders import hybrid_pattern_from_args

    pattern = hybrid_pattern_from_args(args)
    if pattern is None:
        return None
    heads = args.mamba_num_heads or 2 * args.hidden_size // args.mamba_head_dim
    return HybridShape(pattern, args.mamba_state_dim, args.mamba_head_dim, args.mamba_num_groups, heads)


def mamba_layer_parameters(h: int, hy: HybridShape, tp: int, layernorm: bool) -> int:
    """A Mamba layer's parameters on one TP rank: its norm (whole), in_proj, conv1d (+ bias), dt_bias,
    A_log, D (per head), the gated norm (per channel) and out_proj."""
    heads, inner, bc = hy.num_heads // tp, hy.d_inner // tp, 2 * hy.num_groups * hy.state_dim // tp
    channels = inner + bc
    in_proj = (2 * inner + bc + heads) * h
    return (2 * h if layernorm else h) + in_proj + channels * (hy.d_conv + 1) + 3 * heads + inner + h * inner


def mamba_state_bytes(hy: HybridShape, tp: int, e: int) -> int:
    """One sequence's inference state in one Mamba layer on one TP rank: the conv's last k - 1 inputs
    (in the activations' dtype) and the fp32 SSM state [nh/t, hd, n] (InferenceContext.mamba_states)."""
    channels = (hy.d_inner + 2 * hy.num_groups * hy.state_dim) // tp
    return e * channels * (hy.d_conv - 1) + 4 * hy.num_heads // tp * hy.head_dim * hy.state_dim


def mamba_layer_activation_bytes(m: Any, lay: Any, e: int) -> int:
    """Bytes one Mamba layer keeps for backward per micro-batch on one TP rank (the table above);
    m: the planner's ModelShape (m.hybrid set), lay: its Layout."""
    hy, t, b, s, h = m.hybrid, lay.tp, lay.micro_batch_size, m.seq_length, m.hidden_size
    local = s // t if lay.sequence_parallel else s
    heads, groups, n, hd = hy.num_heads // t, hy.num_groups // t, hy.state_dim, hy.head_dim
    inner = hy.d_inner // t
    channels = inner + 2 * groups * n
    proj = 2 * inner + 2 * groups * n + heads
    L = hy.chunk_size
    c = -(-s // L)
    padded = c * L * b  # s' b
    stats = 8 if m.layernorm else 4
    norm = local * b * (2 * e * h + stats + (h if m.hidden_dropout else 0))  # + the residual dropout's mask
    projections = e * s * b * proj + e * b * channels * (s + hy.d_conv - 1) + 2 * e * s * b * channels
    dt = 2 * 4 * s * b * heads + 2 * 4 * heads
    within = 3 * 4 * b * heads * c * L * L + 2 * L * L
    # One chunk (s <= L): einsum reads one copy of C less, and the entering states are a view of the
    # stacked ones (their storage counts c + 1 states).
    operands = 4 * padded * heads * ((5 if c > 1 else 4) * n + 3 * hd + 2)
    entering = c if c > 1 else c + 1
    across = 4 * b * heads * ((c + 1) ** 2 + (c + 1) * hd * n + entering * hd * n) + 2 * (c + 1) ** 2
    gated = 5 * e * s * b * inner + 4 * s * b * groups
    return norm + projections + dt + within + operands + across + gated


def hybrid_layer_flops_per_sequence(m: Any, kind: str) -> float:
    """Forward + backward FLOPs (3 x the forward) of one layer of a hybrid model on one sequence, by its
    symbol, as the log line counts them (training_log.hybrid_flops, Megatron-LM's per-kind count, which
    takes d_in = 2h for the Mamba projections):

        M  2 s h (2 d_in + 2 ng n + nh) in_proj, 7 s d_in n the scan, 2 s d_in h out_proj
        *  4 s h p (h + h g / a + s / 2), p = kv channels x a / h
        -  4 s h f (x 3/2 with SwiGLU)
        E  the shared experts' 4 s h f_shared (x 3/2): the routed experts run by rows
           (plan.expert_flops_per_micro_batch; flops_per_step counts top-k of them per token)."""
    s, h = m.seq_length, m.hidden_size
    gated = 1.5 if m.swiglu else 1.0
    if kind == "M":
        hy = m.hybrid
        d_in, n, ng, nh = 2 * h, hy.state_dim, hy.num_groups, hy.num_heads
        return 3 * (2 * s * h * (2 * d_in + 2 * ng * n + nh) + 7 * s * d_in * n + 2 * s * d_in * h)
    if kind == "*":
        a, g = m.num_attention_heads, m.num_query_groups
        p = m.kv_channels * a / h
        return 3 * 4 * s * h * p * (h + h * g / a + s / 2)
    if kind == "-":
        return 3 * 4 * s * h * m.ffn_hidden_size * gated
    if kind == "E":
        return 3 * 4 * s * h * (m.moe.shared_ffn_hidden_size or 0) * gated
    raise ValueError(f"unknown hybrid layer symbol {kind!r}")

