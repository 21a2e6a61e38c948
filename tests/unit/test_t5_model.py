"""T5Model equals HuggingFace's T5ForConditionalGeneration after the converter's mapping
(megatron/convert/t5.py: huggingface.config_from_hf and state_dict_from_hf), and our own T5 with
learned absolute positions has the encoder-decoder structure.

The HF model: tiny and random (2 + 2 layers, d_model 32, 4 heads, d_kv 12 so kv_channels != h/np,
d_ff 48, vocab 64, 8 buckets, max distance 16), feed_forward_proj "relu" (is_gated_act False),
tie_word_embeddings, dropout 0, fp32, eval; its norm weights are perturbed so a mix-up between
norms shows. Where the architectures coincide and the flags that make them compute the same:
    HF T5LayerNorm (x * rsqrt(mean x^2 + eps) * w, no bias)  normalization "RMSNorm", layernorm_epsilon
    no linear biases                                     add_bias_linear False
    DenseReluDense wi -> relu -> wo                      activation_func F.relu, ffn_hidden_size d_ff
    inner dim num_heads * d_kv                           kv_channels d_kv
    no 1/sqrt(d) in the attention (folded into the init)  T5Model(attention_scale=1.0)
    relative position bias, layer 0 of each stack,       T5Model(position_embedding_type="relative",
      bidirectional / unidirectional buckets             relative_attention_num_buckets, _max_distance)
    tied lm_head on sequence_output * d_model ** -0.5    T5Model(output_hidden_scale=d_model ** -0.5),
                                                         the output bias (Megatron's) left at zero
    shared embedding, no position table, no embedding scale   the same in T5Model
Weights: HF's separate q, k, v [np hn, h] become linear_qkv [3 np hn, h] with each head's q, k, v
rows together (Megatron's [np, 3, hn]); the cross-attention's k, v become linear_kv with each
head's k then v rows ([np, 2, hn]). Each check runs with the fused (default) and the plain flags.
The other feed-forwards (gated-gelu as T5 v1.1, gated-relu, gelu, gelu_new) and transformers 5's
scale_decoder_outputs False (config tie_word_embeddings False) give HF's logits too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.convert import huggingface
from megatron.model import TransformerConfig
from megatron.model.positions import relative_position_bucket
from megatron.model.t5_model import T5Model, t5_attention_masks

transformers = pytest.importorskip("transformers")

VOCAB, D_MODEL, HEADS, D_KV, D_FF, LAYERS = 64, 32, 4, 12, 48, 2
BUCKETS, MAX_DISTANCE = 8, 16
S_ENC, S_DEC, BATCH = 20, 11, 3
ENC_LENGTHS = (S_ENC, 13, 6)

FUSED = {}
UNFUSED = dict(masked_softmax_fusion=False, bias_dropout_fusion=False, fused_kernels_cpu_impl="reference")
FLAGS = pytest.mark.parametrize("flags", [FUSED, UNFUSED], ids=["fused", "unfused"])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_hf(seed: int = 0, feed_forward_proj: str = "relu", tie_word_embeddings: bool = True):
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=D_MODEL, d_kv=D_KV, d_ff=D_FF, num_layers=LAYERS, num_decoder_layers=LAYERS,
        num_heads=HEADS, relative_attention_num_buckets=BUCKETS, relative_attention_max_distance=MAX_DISTANCE,
        dropout_rate=0.0, layer_norm_epsilon=1e-6, feed_forward_proj=feed_forward_proj,
        tie_word_embeddings=tie_word_embeddings, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    hf = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "layer_norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    return hf


def make_ours(hf, **flags) -> T5Model:
    """Our T5Model of the HF model, through the converter's mapping (megatron/convert/t5.py)."""
    config, model_kwargs = huggingface.config_from_hf(hf.config)
    model = T5Model(TransformerConfig(**{**flags, **config}), **model_kwargs).eval()
    model.load_state_dict(huggingface.state_dict_from_hf(hf.state_dict(), hf.config), strict=True)
    assert not model.lm_head.output_layer.bias.any()  # HF has no output bias: the mapping gives zeros
    return model


def make_batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(1, VOCAB, (BATCH, S_ENC), generator=g)
    enc_pad = torch.zeros(BATCH, S_ENC, dtype=torch.long)
    for row, length in enumerate(ENC_LENGTHS):
        enc_pad[row, :length] = 1
    enc = enc * enc_pad  # padding id 0 after the real tokens
    dec = torch.randint(1, VOCAB, (BATCH, S_DEC), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, S_DEC), generator=g)
    return enc, enc_pad, dec, labels


def our_masks(enc_pad):
    return t5_attention_masks(enc_pad, torch.ones(BATCH, S_DEC, dtype=torch.long))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_buckets_equal_hf(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-200, 201)
    for buckets, distance in ((32, 128), (8, 16)):
        expected = T5Attention._relative_position_bucket(relative, bidirectional, buckets, distance)
        torch.testing.assert_close(relative_position_bucket(relative, bidirectional, buckets, distance), expected)


def test_config_is_relu_not_gated():
    hf = make_hf()
    assert hf.config.dense_act_fn == "relu" and not hf.config.is_gated_act and hf.config.tie_word_embeddings


# T5 v1.1's MLP: gated-gelu is act(wi_0 x) * wi_1 x with HF's gelu_new, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
# x^3))), the formula of F.gelu(approximate="tanh") (our openai_gelu). tie_word_embeddings False is transformers
# 5's scale_decoder_outputs False (the head stays tied; no d_model ** -0.5).
@pytest.mark.parametrize("feed_forward_proj, tied", [("gated-gelu", True), ("gated-gelu", False),
                                                     ("gated-relu", True), ("gelu", True), ("gelu_new", False)])
def test_logits_equal_hf_for_other_feed_forwards(feed_forward_proj, tied):
    hf = make_hf(feed_forward_proj=feed_forward_proj, tie_word_embeddings=tied)
    assert getattr(hf.config, "scale_decoder_outputs", tied) == tied
    model = make_ours(hf)
    assert model.output_hidden_scale == (D_MODEL ** -0.5 if tied else 1.0)
    assert model.decoder.layers[0].mlp.gated == feed_forward_proj.startswith("gated")
    enc, enc_pad, dec, _ = make_batch()
    with torch.no_grad():
        expected = hf(input_ids=enc, attention_mask=enc_pad, decoder_input_ids=dec).logits  # [b, s_dec, v]
        logits = model(enc, dec, *our_masks(enc_pad))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@FLAGS
def test_logits_equal_hf_with_padded_encoder(flags):
    hf = make_hf()
    model = make_ours(hf, **flags)
    enc, enc_pad, dec, _ = make_batch()
    with torch.no_grad():
        expected = hf(input_ids=enc, attention_mask=enc_pad, decoder_input_ids=dec).logits  # [b, s_dec, v]
        logits = model(enc, dec, *our_masks(enc_pad))
    assert logits.shape == (BATCH, S_DEC, VOCAB)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@FLAGS
def test_loss_and_gradients_equal_hf(flags):
    hf = make_hf()
    model = make_ours(hf, **flags)
    enc, enc_pad, dec, labels = make_batch()
    hf_logits = hf(input_ids=enc, attention_mask=enc_pad, decoder_input_ids=dec).logits
    hf_loss = F.cross_entropy(hf_logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").reshape(labels.shape)
    loss = model(enc, dec, *our_masks(enc_pad), lm_labels=labels)  # [b, s_dec]
    assert loss.shape == (BATCH, S_DEC)
    torch.testing.assert_close(loss, hf_loss.detach(), rtol=1e-5, atol=1e-5)
    hf_loss.sum().backward()
    loss.sum().backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters() if p.grad is not None}
    expected = huggingface.state_dict_from_hf(hf_grads, hf.config)
    del expected["lm_head.output_layer.bias"]  # the mapping's zeros: HF has no such parameter
    ours = dict(model.named_parameters())
    assert set(expected) == set(ours) - {"lm_head.output_layer.bias"}
    for name, grad in expected.items():
        torch.testing.assert_close(ours[name].grad, grad, rtol=1e-4, atol=1e-5, msg=name)
    # The output bias's gradient is the sum over tokens of softmax - onehot.
    probs = torch.softmax(hf_logits.detach(), -1) - F.one_hot(labels, VOCAB)
    torch.testing.assert_close(model.lm_head.output_layer.bias.grad, probs.sum((0, 1)), rtol=1e-4, atol=1e-5)


def tiny_absolute(**flags) -> T5Model:
    torch.manual_seed(3)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=12,
                               ffn_hidden_size=40, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1,
                               **flags)
    return T5Model(config, VOCAB, max_sequence_length=S_ENC).eval()


def test_absolute_positions_structure():
    model = tiny_absolute()
    keys = set(model.state_dict())
    assert "embedding.position_embeddings.weight" in keys
    assert "lm_head.output_layer.bias" in keys and "lm_head.output_layer.weight" not in keys
    assert not any("relative" in k for k in keys)
    assert "decoder.layers.0.cross_attention.linear_kv.weight" in keys
    assert model.decoder.layers[0].cross_attention.linear_kv.weight.shape == (2 * 4 * 12, 32)
    assert not any("cross_attention" in k for k in keys if k.startswith("encoder."))
    # The encoder and the decoder do not start from the same weights.
    assert not torch.equal(model.encoder.layers[0].self_attention.linear_qkv.weight,
                           model.decoder.layers[0].self_attention.linear_qkv.weight)


@FLAGS
def test_absolute_encoder_independent_of_decoder_and_decoder_causal(flags):
    model = tiny_absolute(**flags)
    enc, enc_pad, dec, _ = make_batch()
    masks = our_masks(enc_pad)
    with torch.no_grad():
        encoded = model.encode(enc, masks[0])
        logits = model(enc, dec, *masks)
        # The encoder never sees the decoder input.
        other_dec = (dec + 7) % VOCAB
        torch.testing.assert_close(model.encode(enc, masks[0]), encoded, rtol=0, atol=0)
        assert not torch.allclose(model(enc, other_dec, *masks), logits)
        # Causal decoder: changing token t leaves the logits before t unchanged, and changes those from t.
        t = 6
        changed = dec.clone()
        changed[:, t] = (changed[:, t] + 5) % VOCAB
        new = model(enc, changed, *masks)
        torch.testing.assert_close(new[:, :t], logits[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(new[:, t:], logits[:, t:])
        # decoder_attn_mask None is the plain causal mask.
        torch.testing.assert_close(model(enc, dec, masks[0], None, masks[2]), logits, rtol=1e-6, atol=1e-6)
        # Padded encoder positions do not reach the decoder.
        junk = enc.clone()
        junk[enc_pad == 0] = 9
        torch.testing.assert_close(model(junk, dec, *masks), logits, rtol=0, atol=1e-6)
