"""--use-flash-attn: FlashDotProductAttention (torch SDPA on CPU, flash-attn on CUDA when installed)
against the unfused DotProductAttention, with attention dropout 0: causal, padding and block masks,
fully masked rows, fp32 and bf16, forward and backward, alone and inside GPTModel.

With dropout > 0 the kernels draw their own masks (documented in docs/memory.md): the results are
reproducible from a seed, and recompute restores them exactly.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron.core import device

from megatron.model import GPTModel, TransformerConfig
from megatron.fused_kernels import backend
from megatron.model.attention import DotProductAttention, FlashDotProductAttention
from megatron.model.utils import get_causal_attention_mask

S, B, NP, HN = 12, 3, 4, 8
VOCAB = 64

# Largest error relative to the largest value, against the fp32 unfused result of the same inputs.
# In bf16 the unfused path itself is 0.4-1% off (its softmax runs in bf16); SDPA's is similar.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _config(**overrides) -> TransformerConfig:
    # the unfused softmax is the reference: its fully masked rows give 1/sk, as SDPA's path does
    kwargs = dict(num_layers=2, hidden_size=NP * HN, num_attention_heads=NP, hidden_dropout=0.0,
                  attention_dropout=0.0, masked_softmax_fusion=False)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _padding_mask() -> torch.Tensor:
    """Causal plus key padding: sample i has its last 3 i tokens padded. [b, 1, s, s], True = masked."""
    lengths = torch.tensor([S - 3 * i for i in range(B)])
    padded_key = torch.arange(S).view(1, S) >= lengths.view(B, 1)  # [b, s]
    return get_causal_attention_mask(S) | padded_key.view(B, 1, 1, S)


def _fully_masked_rows_mask() -> torch.Tensor:
    """BERT-style padding: padded queries see nothing (rows all True), the others see unpadded keys."""
    valid = torch.arange(S).view(1, S) < torch.tensor([S, S - 4, 5]).view(B, 1)  # [b, s]
    return ~(valid.view(B, 1, S, 1) & valid.view(B, 1, 1, S))  # [b, 1, s, s]


MASKS = {
    "causal": (lambda: get_causal_attention_mask(S), True),
    "causal-as-mask": (lambda: get_causal_attention_mask(S), False),
    "padding": (_padding_mask, False),
    "fully-masked-rows": (_fully_masked_rows_mask, False),
    "none": (lambda: None, False),
}


def _qkv(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(S, B, NP, HN, generator=generator).to(dtype).requires_grad_() for _ in range(3)]


def _run(module: torch.nn.Module, qkv, mask, is_causal: bool):
    for tensor in qkv:
        tensor.grad = None
    out = module(*qkv, mask, is_causal)  # [s, b, np * hn]
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
    return out.detach(), [tensor.grad.clone() for tensor in qkv]


def _max_relative_error(actual, expected) -> float:
    pairs = zip([actual[0]] + actual[1], [expected[0]] + expected[1])
    return max(((a.float() - e).abs().max() / e.abs().max()).item() for a, e in pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask_name", list(MASKS), ids=list(MASKS))
def test_sdpa_equals_unfused_attention(mask_name, dtype):
    make_mask, is_causal = MASKS[mask_name]
    qkv = _qkv(dtype)
    reference = _run(DotProductAttention(_config(), 1), [t.detach().float().requires_grad_() for t in qkv],
                     make_mask(), is_causal)  # fp32
    config = _config(params_dtype=dtype)
    unfused = _run(DotProductAttention(config, 1), qkv, make_mask(), is_causal)
    fused = _run(FlashDotProductAttention(config, 1), qkv, make_mask(), is_causal)
    assert fused[0].dtype == dtype
    assert _max_relative_error(unfused, reference) <= TOLERANCE[dtype]
    assert _max_relative_error(fused, reference) <= TOLERANCE[dtype]


def test_query_key_layer_scaling_changes_nothing_in_the_fused_path():
    qkv = _qkv(torch.float32)
    mask = get_causal_attention_mask(S)
    scaled = _run(FlashDotProductAttention(_config(apply_query_key_layer_scaling=True), 5), qkv, mask, True)
    plain = _run(DotProductAttention(_config(), 1), qkv, mask, True)
    torch.testing.assert_close(scaled[0], plain[0], rtol=1e-5, atol=1e-5)


def _model_run(config: TransformerConfig, mask: torch.Tensor | None = None):
    torch.manual_seed(1)
    model = GPTModel(config, VOCAB, S)
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (B, S + 1), generator=generator)
    torch.manual_seed(3)
    loss = model(tokens[:, :-1], torch.arange(S).expand(B, S), mask, labels=tokens[:, 1:]).mean()
    loss.backward()
    return model, loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mask", [None, _padding_mask()], ids=["causal", "padding"])
def test_gpt_model_with_flash_attn_equals_without(mask):
    plain, loss, grads = _model_run(_config(), mask)
    fused, fused_loss, fused_grads = _model_run(_config(use_flash_attn=True), mask)
    assert isinstance(fused.decoder.layers[0].self_attention.core_attention, FlashDotProductAttention)
    assert list(fused.state_dict()) == list(plain.state_dict())  # the attention kernel has no parameters
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6)


def test_dropout_in_the_fused_path_is_applied_and_seeded():
    """Attention dropout > 0 is accepted: the kernel draws its mask from the device generator (in
    the TP rank's stream), so a seed reproduces it. Which mask is the kernel's business: torch's
    CPU math backend happens to draw DotProductAttention's, CUDA kernels draw others."""
    config = _config(attention_dropout=0.3)
    qkv = _qkv(torch.float32)
    mask = get_causal_attention_mask(S)
    fused = FlashDotProductAttention(config, 1)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(_run(fused, qkv, mask, True))
    assert torch.equal(runs[0][0], runs[1][0]) and all(map(torch.equal, runs[0][1], runs[1][1]))
    no_dropout = _run(FlashDotProductAttention(_config(), 1), qkv, mask, True)
    assert not torch.allclose(no_dropout[0], runs[0][0])
    fused.eval()  # no dropout in eval
    torch.testing.assert_close(_run(fused, qkv, mask, True)[0], no_dropout[0])


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="selective"),
                                       dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=1)], ids=["selective", "full"])
def test_recompute_with_fused_attention_and_dropout_is_exact(recompute):
    config = _config(use_flash_attn=True, attention_dropout=0.2, hidden_dropout=0.2)
    _, loss, grads = _model_run(config)
    _, recomputed_loss, recomputed_grads = _model_run(dataclasses.replace(config, **recompute))
    assert torch.equal(recomputed_loss, loss)
    assert all(torch.equal(recomputed_grads[name], grad) for name, grad in grads.items())


def _reference_flash_attn_func(q, k, v, dropout_p, softmax_scale=None, causal=False):
    """flash-attn's calling convention ([b, s, np, hn] in and out), computed by hand."""
    assert dropout_p == 0.0
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) * softmax_scale  # [b, np, sq, sk]
    if causal:
        scores = scores.masked_fill(get_causal_attention_mask(q.shape[1])[0], float("-inf"))
    return torch.einsum("bnqk,bknd->bqnd", scores.softmax(-1), v)  # [b, sq, np, hn]


def test_flash_attn_seam_layout_and_fallback(monkeypatch):
    """The flash-attn branch (CUDA only) exercised on CPU with a stand-in of the same convention;
    masks other than causal still go to SDPA."""
    calls = []
    def stand_in(*args, **kwargs):
        calls.append(kwargs["causal"])
        return _reference_flash_attn_func(*args, **kwargs)

    monkeypatch.setattr(backend, "flash_attn_func", stand_in)
    assert not backend._flash_attn_applies(torch.zeros(1), None, True)  # CPU tensors: never flash-attn
    monkeypatch.setattr(backend, "_flash_attn_applies",
                        lambda query, mask, is_causal: is_causal or mask is None)
    qkv = _qkv(torch.float32)
    config = _config()
    for mask_name in ("causal", "none", "padding"):
        make_mask, is_causal = MASKS[mask_name]
        expected = _run(DotProductAttention(config, 1), qkv, make_mask(), is_causal)
        actual = _run(FlashDotProductAttention(config, 1), qkv, make_mask(), is_causal)
        torch.testing.assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(actual[1], expected[1], rtol=1e-5, atol=1e-5)
    assert calls == [True, False]  # the padding mask went to SDPA


@pytest.mark.gpu
@pytest.mark.skipif(not device.accelerator_available(), reason="needs a CUDA device (runs on the GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_attention_on_cuda_equals_unfused(dtype):
    config = _config(params_dtype=dtype)
    qkv = [t.detach().to(device.get_device()).requires_grad_() for t in _qkv(dtype)]
    mask = get_causal_attention_mask(S, device.get_device())
    expected = _run(DotProductAttention(config, 1), qkv, mask, True)
    actual = _run(FlashDotProductAttention(config, 1), qkv, mask, True)
    torch.testing.assert_close(actual[0], expected[0], rtol=2e-2, atol=2e-2)
    for got, want in zip(actual[1], expected[1]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_softmax_scale_is_one_over_sqrt_head_dim():
    assert FlashDotProductAttention(_config(), 3).softmax_scale == pytest.approx(1 / math.sqrt(HN))
