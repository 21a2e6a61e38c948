"""Fused ops: one module per op, each with a Triton kernel, a plain-PyTorch reference and a CPU fast path.

    scale_mask_softmax(scores, mask, scale, causal)                    fused_softmax.py
    layer_norm(x, weight, bias, eps), rms_norm(x, weight, eps)         fused_layer_norm.py
    bias_gelu(x, bias)                                                 fused_bias_gelu.py
    bias_swiglu(x, bias)                                               fused_bias_swiglu.py
    rotary_pos_emb(t, freqs, interleaved)                              fused_rope.py
    bias_dropout_add(x, bias, residual, prob, training)                fused_bias_dropout.py
    cross_entropy(logits, labels, ignore_index, loss_mask, vocab_size) fused_cross_entropy.py
    core_attention(q, k, v, scale, heads, mask, causal)                fused_core_attention.py
                   (CPU only: one autograd node around ATen's GEMMs and softmax; no Triton
                    kernel -- on CUDA the model uses flash attention)

(module names are Megatron-LM's, and differ from the functions' so both stay importable)

Every op is differentiable (a torch.autograd.Function), takes `impl=` to force an
implementation, and otherwise picks one per call from the input's device (dispatch.py):
Triton on CUDA, the op's CPU fast path on CPU. `force_implementation(name)` forces one for a
block; MEGATRON_FUSED_IMPL=reference forces one for a process. The library never imports the
training framework: the model decides whether to call these (Megatron's --no-*-fusion flags).
"""

from megatron.fused_kernels import fused_bias_dropout as _bias_dropout_add
from megatron.fused_kernels import fused_bias_gelu as _bias_gelu
from megatron.fused_kernels import fused_bias_swiglu as _bias_swiglu
from megatron.fused_kernels import fused_cross_entropy as _cross_entropy
from megatron.fused_kernels import fused_layer_norm as _norm
from megatron.fused_kernels import fused_rope as _rope
from megatron.fused_kernels import fused_softmax as _softmax
from megatron.fused_kernels.fused_bias_dropout import bias_dropout_add
from megatron.fused_kernels.fused_bias_gelu import bias_gelu
from megatron.fused_kernels.fused_bias_swiglu import bias_swiglu
from megatron.fused_kernels.fused_core_attention import core_attention
from megatron.fused_kernels.fused_cross_entropy import cross_entropy
from megatron.fused_kernels.dispatch import (
    IMPLEMENTATIONS,
    FusedOp,
    force_implementation,
    triton_available,
    triton_interpreted,
    triton_version,
)
from megatron.fused_kernels.fused_layer_norm import layer_norm, rms_norm
from megatron.fused_kernels.fused_rope import rotary_pos_emb
from megatron.fused_kernels.fused_softmax import scale_mask_softmax

# Public op name -> its implementations and selection rule.
OPS: dict[str, FusedOp] = {
    "scale_mask_softmax": _softmax.OP,
    "layer_norm": _norm.LAYER_NORM,
    "rms_norm": _norm.RMS_NORM,
    "bias_gelu": _bias_gelu.OP,
    "bias_dropout_add": _bias_dropout_add.OP,
    "cross_entropy": _cross_entropy.OP,
    "bias_swiglu": _bias_swiglu.OP,
    "rotary_pos_emb": _rope.OP,
}


def select_implementation(op: str, device, impl: str | None = None) -> str:
    """The implementation `op` would run for inputs on `device` (one of IMPLEMENTATIONS)."""
    import torch

    return OPS[op].select(torch.device(device), impl)


__all__ = [
    "IMPLEMENTATIONS",
    "OPS",
    "bias_dropout_add",
    "bias_gelu",
    "bias_swiglu",
    "core_attention",
    "cross_entropy",
    "force_implementation",
    "layer_norm",
    "rms_norm",
    "rotary_pos_emb",
    "scale_mask_softmax",
    "select_implementation",
    "triton_available",
    "triton_interpreted",
    "triton_version",
]
