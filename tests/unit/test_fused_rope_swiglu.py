"""rotary_pos_emb and bias_swiglu: the references against independent formulations (complex
rotation, HuggingFace's Llama RoPE, unfused silu), bf16 and compiled implementations, what the
forward saves, input checks. Their Triton kernels and fp32 native paths are tested with every other
op's in test_fused_kernels.py (TRITON_CASES, FAST_PATH_CASES).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron import fused_kernels as fk
from tests.helpers.fused_kernels import assert_rel_close, assert_same_results, bias_swiglu_case, leaf, rope_case, \
    rope_freqs, run


def _complex_rotation(t, freqs, interleaved, sign=1.0):
    """RoPE as complex multiplication in fp64: pair (x_a, x_b) -> (x_a + i x_b) * exp(i sign angle)."""
    rot = freqs.shape[-1]
    x = t[..., :rot].double()
    if interleaved:
        pairs, angle = x.unflatten(-1, (rot // 2, 2)), freqs[..., 0::2]
    else:
        pairs, angle = torch.stack(x.chunk(2, dim=-1), dim=-1), freqs[..., :rot // 2]
    rotated = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * torch.polar(
        torch.ones_like(angle.double()), sign * angle.double()))  # [..., rot / 2, 2]
    rotated = rotated.flatten(-2) if interleaved else torch.cat(rotated.unbind(-1), dim=-1)
    return torch.cat((rotated, t[..., rot:].double()), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_reference_is_a_complex_rotation(interleaved):
    """Forward: each pair rotated by its angle; backward: the gradient rotated by minus the angle;
    partial rotary: channels rot..hn pass through, forward and backward."""
    t = leaf(5, 2, 3, 12, seed=3)
    freqs = rope_freqs(5, 8, interleaved)
    y = fk.rotary_pos_emb(t, freqs, interleaved, impl="reference")
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    (dt,) = torch.autograd.grad(y, t, grad)
    assert_rel_close(y.double(), _complex_rotation(t.detach(), freqs, interleaved))
    assert_rel_close(dt.double(), _complex_rotation(grad, freqs, interleaved, sign=-1.0))
    assert torch.equal(y[..., 8:], t[..., 8:]) and torch.equal(dt[..., 8:], grad[..., 8:])


def test_rope_matches_huggingface_llama():
    """Non-interleaved RoPE is HuggingFace Llama's: its cos/sin (LlamaRotaryEmbedding) are cos/sin
    of Megatron's cat(f, f) freqs, and apply_rotary_pos_emb gives the same q and k, and gradients."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    s, b, heads, groups, hn = 6, 2, 4, 2, 16
    config = LlamaConfig(hidden_size=heads * hn, num_attention_heads=heads, num_key_value_heads=groups,
                         head_dim=hn, max_position_embeddings=64)
    q, k = leaf(s, b, heads, hn, seed=1), leaf(s, b, groups, hn, seed=2)  # [s, b, heads, hn]
    cos, sin = LlamaRotaryEmbedding(config)(q, torch.arange(s).expand(b, s))  # [b, s, hn]
    freqs = rope_freqs(s, hn, interleaved=False, base=config.rope_parameters["rope_theta"])
    assert_rel_close(cos[0], freqs.cos().view(s, hn))
    assert_rel_close(sin[1], freqs.sin().view(s, hn))

    def ours(q, k):
        return torch.cat([fk.rotary_pos_emb(x, freqs, impl="reference").flatten(2) for x in (q, k)], dim=-1)

    def theirs(q, k):  # HF's layout: [b, heads, s, hn]
        q_hf, k_hf = apply_rotary_pos_emb(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), cos, sin)
        return torch.cat([x.permute(2, 0, 1, 3).flatten(2) for x in (q_hf, k_hf)], dim=-1)

    assert_same_results(run(ours, [q, k]), run(theirs, [q, k]))


def test_swiglu_reference_is_unfused_silu():
    for with_bias in (True, False):
        x, bias = leaf(3, 5, 14, scale=2.0), leaf(14, seed=1) if with_bias else None

        def unfused(x, b):
            gate, up = torch.chunk(x if b is None else x + b, 2, dim=-1)
            return F.silu(gate) * up

        inputs = [x, bias]
        assert_same_results(run(lambda x, b: fk.bias_swiglu(x, b, impl="reference"), inputs), run(unfused, inputs))


BF16_CASES = [rope_case((4, 2, 3, 10), 6, True, True, torch.bfloat16),
              rope_case((3, 2, 4, 8), 8, dtype=torch.bfloat16),
              bias_swiglu_case((3, 5, 14), True, torch.bfloat16), bias_swiglu_case((4, 66), False, torch.bfloat16)]


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_bf16_within_bf16_rounding_of_fp64(impl):
    """bf16 inputs: output and gradients in bf16, within a few bf16 roundings of the fp64 reference
    (rope's reference computes in bf16 like Megatron-Core's unfused path; native in bf16 too)."""
    for case in BF16_CASES:
        results = case(impl)
        assert all(r.dtype == torch.bfloat16 for r in results)
        assert_same_results(results, case("reference", exact=True), rel=2 ** -6)


def test_rope_compiled_matches_reference():
    """RoPE's "compiled" implementation on one fp32 case (compiling is slow); bias_swiglu's, its CPU
    fast path, runs in test_fused_kernels.test_cpu_fast_paths_match_reference."""
    assert fk.OPS["bias_swiglu"].cpu_fast_path == "compiled"
    case = rope_case((4, 2, 3, 10), 6, True, True)
    assert_same_results(case("compiled"), case("reference"))


def _saved_by_forward(fn, *inputs):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*inputs)
    return saved


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_forward_saves_only_the_inputs(impl):
    """RoPE keeps freqs only (no activation); SwiGLU keeps x (not a copy) and its bias."""
    t, freqs = leaf(3, 2, 4, 8), rope_freqs(3, 8, False)
    saved = _saved_by_forward(lambda t: fk.rotary_pos_emb(t, freqs, impl=impl), t)
    assert len(saved) == 1 and saved[0] is freqs
    x, bias = leaf(3, 14), leaf(14, seed=1)
    saved = _saved_by_forward(lambda x, b: fk.bias_swiglu(x, b, impl=impl), x, bias)
    assert len(saved) == 2 and saved[0] is x and saved[1] is bias


def test_input_checks():
    t = torch.zeros(3, 2, 4, 8)
    with pytest.raises(ValueError, match="t must be"):
        fk.rotary_pos_emb(t[0], rope_freqs(3, 8, False))
    for freqs in (rope_freqs(3, 10, False), rope_freqs(2, 8, False), torch.zeros(3, 1, 1, 7), torch.zeros(3, 8)):
        with pytest.raises(ValueError, match="freqs must be"):
            fk.rotary_pos_emb(t, freqs)
    with pytest.raises(ValueError, match="must be even"):
        fk.bias_swiglu(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="does not match"):
        fk.bias_swiglu(torch.zeros(2, 6), torch.zeros(3))


def test_rope_reference_is_megatron_core_unfused_bit_for_bit(tmp_path):
    """The reference is Megatron-Core's _apply_rotary_pos_emb_bshd (run from megatron-core), bit
    for bit, in fp32 and bf16, interleaved or not, partial rotary; bf16 native within rounding."""
    from tests.helpers.mcore_reference import run_mcore

    cases = [(dtype, interleaved) for dtype in (torch.float32, torch.bfloat16) for interleaved in (False, True)]
    inputs = [(leaf(5, 2, 3, 12, seed=7, dtype=dtype).detach(), rope_freqs(5, 8, interleaved), interleaved)
              for dtype, interleaved in cases]
    torch.save(inputs, tmp_path / "inputs.pt")
    run_mcore(f'''
        import torch
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
        inputs = torch.load({str(tmp_path / "inputs.pt")!r})
        torch.save([_apply_rotary_pos_emb_bshd(t, f, rotary_interleaved=i) for t, f, i in inputs],
                   {str(tmp_path / "outputs.pt")!r})
    ''')
    for (t, freqs, interleaved), expected in zip(inputs, torch.load(tmp_path / "outputs.pt")):
        assert torch.equal(fk.rotary_pos_emb(t, freqs, interleaved, impl="reference"), expected)
        assert_rel_close(fk.rotary_pos_emb(t, freqs, interleaved, impl="native"), expected, rel=2 ** -7)
