"""BertModel equals HuggingFace's MegatronBertForPreTraining (pre-LN, Megatron's layout) and, with
post_layernorm=True, HF's BertForPreTraining (the original post-LN BERT) after the converter's weight
mapping (megatron/convert/bert.py: one mapping for the converter and this test).

A tiny random HF model (2 layers, h 64, 4 heads, vocab 96, s 24) in fp32 eval mode, norm weights and
biases perturbed so a mix-up between them shows, init std 0.1 so attention is far from uniform. The
batch has rows of different lengths (padding at the end) and both token types. Our config matches
HF's with: hidden_act "gelu" is the exact erf GeLU, so bias_gelu_fusion=False (our fused bias-GeLU is
the tanh approximation, Megatron's) with the default activation_func F.gelu and openai_gelu False;
layernorm_epsilon = layer_norm_eps; dropout 0; apply_residual_connection_post_layernorm False (both
are pre-LN with a final layer norm; BertForPreTraining's post-LN layers and embedding LayerNorm are
post_layernorm's). Each check runs for both HF classes, with the default (fused, CPU fast path) flags
and with the plain path. Only real positions are compared: a padding query sees no key in Megatron's mask
(b1ss) but every real key in HF's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.convert import huggingface as hf_mapping
from megatron.model import BertModel, TransformerConfig, bert_loss
from megatron.model.bert_model import bert_extended_attention_mask

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, HEADS, FFN, LAYERS, SEQ, BATCH = 96, 64, 4, 80, 2, 24, 3
LENGTHS = (SEQ, 17, 9)  # real tokens per row
STD = 0.1

FUSED = {}  # TransformerConfig's defaults: fused softmax and bias-dropout-add on the "native" CPU fast path
UNFUSED = dict(masked_softmax_fusion=False, bias_gelu_fusion=False, bias_dropout_fusion=False,
               fused_kernels_cpu_impl="reference")
FLAGS = pytest.mark.parametrize("flags", [FUSED, UNFUSED], ids=["fused", "unfused"])
KINDS = pytest.mark.parametrize("kind", ["megatron-bert", "bert"])  # HF model_type: pre-LN, post-LN

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one intra-op thread


def make_hf(seed: int = 0, kind: str = "megatron-bert"):
    """A tiny MegatronBertForPreTraining ("megatron-bert") or BertForPreTraining ("bert")."""
    config_class, model_class = {
        "megatron-bert": (transformers.MegatronBertConfig, transformers.MegatronBertForPreTraining),
        "bert": (transformers.BertConfig, transformers.BertForPreTraining)}[kind]
    config = config_class(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=32, type_vocab_size=2, initializer_range=STD, layer_norm_eps=1e-12)
    torch.manual_seed(seed)
    hf = model_class(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias") or ".ln." in name or "LayerNorm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return hf


def config_from_hf(c, **flags) -> TransformerConfig:
    """The TransformerConfig computing what the HF config does (the converter's, megatron/convert/bert.py)."""
    kwargs, _ = hf_mapping.config_from_hf(c)
    return TransformerConfig(**{**flags, **kwargs, "bias_gelu_fusion": False})  # erf GeLU wins over the flags


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], c, add_binary_head: bool = True) -> dict[str, torch.Tensor]:
    """HF MegatronBertForPreTraining names -> ours: the converter's mapping (megatron/convert/bert.py)."""
    out = hf_mapping.state_dict_from_hf(hf_sd, c)
    if not add_binary_head:
        out = {k: t for k, t in out.items() if not k.startswith(("pooler.", "binary_head."))}
    return {k: t.clone() for k, t in out.items()}


def make_ours(hf, flags: dict, add_binary_head: bool = True) -> BertModel:
    post_layernorm = hf_mapping.config_from_hf(hf.config)[1]["post_layernorm"]  # True for BertForPreTraining
    ours = BertModel(config_from_hf(hf.config, **flags), VOCAB, hf.config.max_position_embeddings,
                     num_tokentypes=2, add_binary_head=add_binary_head, post_layernorm=post_layernorm).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), hf.config, add_binary_head))  # strict: the same keys
    return ours


def make_batch(seed: int = 1):
    """tokens, tokentypes (segment B from the middle of each row), padding_mask [b, s]; pads are id 0."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    padding_mask = torch.zeros(BATCH, SEQ, dtype=torch.long)
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        padding_mask[row, :length] = 1
        types[row, length // 2:length] = 1
    tokens = tokens * padding_mask
    return tokens, types, padding_mask


def real(x: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
    """The rows of x [b, s, ...] at real tokens: [n, ...]."""
    return x[padding_mask.bool()]


@KINDS
@FLAGS
def test_logits_equal_hf(flags, kind):
    hf = make_hf(kind=kind)
    ours = make_ours(hf, flags)
    tokens, types, padding_mask = make_batch()
    with torch.no_grad():
        expected = hf(input_ids=tokens, attention_mask=padding_mask, token_type_ids=types)
        lm_logits, binary_logits = ours(tokens, padding_mask, tokentype_ids=types)
    assert lm_logits.shape == (BATCH, SEQ, VOCAB) and binary_logits.shape == (BATCH, 2)
    torch.testing.assert_close(real(lm_logits, padding_mask), real(expected.prediction_logits, padding_mask),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(binary_logits, expected.seq_relationship_logits, rtol=0, atol=1e-5)
    # The token types matter (a model ignoring them would not pass the check above by luck).
    with torch.no_grad():
        untyped, _ = ours(tokens, padding_mask)
    assert (real(untyped, padding_mask) - real(lm_logits, padding_mask)).abs().max() > 1e-2


@KINDS
@FLAGS
def test_per_token_loss_is_cross_entropy_of_hf_logits(flags, kind):
    hf = make_hf(kind=kind)
    ours = make_ours(hf, flags)
    tokens, types, padding_mask = make_batch()
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(input_ids=tokens, attention_mask=padding_mask, token_type_ids=types)
        lm_loss, binary_logits = ours(tokens, padding_mask, tokentype_ids=types, lm_labels=labels)
    assert lm_loss.shape == (BATCH, SEQ) and lm_loss.dtype == torch.float32
    reference = F.cross_entropy(expected.prediction_logits.transpose(1, 2), labels, reduction="none")  # [b, s]
    torch.testing.assert_close(real(lm_loss, padding_mask), real(reference, padding_mask), rtol=0, atol=1e-5)
    torch.testing.assert_close(binary_logits, expected.seq_relationship_logits, rtol=0, atol=1e-5)


@KINDS
def test_gradients_equal_hf(kind):
    """One MLM + sentence-order loss: every gradient equals HF's on the mapped weights."""
    hf = make_hf(kind=kind)
    ours = make_ours(hf, FUSED)
    tokens, types, padding_mask = make_batch()
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    loss_mask = padding_mask * (torch.arange(SEQ) % 3 == 0)  # some real positions are "masked tokens"
    order = torch.tensor([0, 1, 1])
    lm_loss, binary_logits = ours(tokens, padding_mask, tokentype_ids=types, lm_labels=labels)
    total, _ = bert_loss(lm_loss, binary_logits, loss_mask, order)
    total.backward()
    out = hf(input_ids=tokens, attention_mask=padding_mask, token_type_ids=types)
    hf_lm = F.cross_entropy(out.prediction_logits.transpose(1, 2), labels, reduction="none")
    hf_total = (hf_lm * loss_mask).sum() / loss_mask.sum() + F.cross_entropy(out.seq_relationship_logits, order)
    torch.testing.assert_close(total, hf_total, rtol=1e-5, atol=0)
    hf_total.backward()
    expected = state_dict_from_hf({n: p.grad for n, p in hf.named_parameters()}
                                  | {"cls.predictions.bias": hf.cls.predictions.bias.grad}, hf.config)
    assert set(expected) == {name for name, _ in ours.named_parameters()}
    for name, param in ours.named_parameters():
        scale = expected[name].abs().max().item()
        assert (param.grad - expected[name]).abs().max().item() <= 1e-4 * scale + 1e-7, name


def test_without_binary_head():
    hf = make_hf()
    ours = make_ours(hf, FUSED, add_binary_head=False)
    assert ours.pooler is None and ours.binary_head is None
    assert not any(k.startswith(("pooler.", "binary_head.")) for k in ours.state_dict())
    tokens, types, padding_mask = make_batch()
    with torch.no_grad():
        expected = hf(input_ids=tokens, attention_mask=padding_mask, token_type_ids=types)
        lm_logits, binary_logits = ours(tokens, padding_mask, tokentype_ids=types)
        lm_loss, no_logits = ours(tokens, padding_mask, tokentype_ids=types, lm_labels=tokens)
    assert binary_logits is None and no_logits is None and lm_loss.shape == (BATCH, SEQ)
    torch.testing.assert_close(real(lm_logits, padding_mask), real(expected.prediction_logits, padding_mask),
                               rtol=0, atol=1e-5)


def test_state_dict_keys_are_megatron_cores():
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    keys = set(BertModel(config, 64, 16).state_dict())
    assert {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
            "embedding.tokentype_embeddings.weight", "encoder.layers.0.self_attention.linear_qkv.weight",
            "encoder.final_layernorm.weight", "lm_head.dense.weight", "lm_head.layer_norm.bias",
            "output_layer.bias", "pooler.dense.weight", "binary_head.weight", "binary_head.bias"} <= keys
    assert "output_layer.weight" not in keys  # tied to the word embedding
    untied = BertModel(config, 64, 16, num_tokentypes=0, share_embeddings_and_output_weights=False)
    keys = set(untied.state_dict())
    assert "output_layer.weight" in keys and "embedding.tokentype_embeddings.weight" not in keys


def test_post_layernorm_keys_and_layer():
    """post_layernorm: the embedding LayerNorm, post-LN layers, no final LayerNorm; the pre-LN keys are gone."""
    from megatron.model.post_ln_layer import PostLNTransformerLayer

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    model = BertModel(config, 64, 16, post_layernorm=True)
    keys = set(model.state_dict())
    assert {"embedding.layernorm.weight", "embedding.layernorm.bias",
            "encoder.layers.1.post_self_attn_layernorm.weight", "encoder.layers.1.post_mlp_layernorm.bias",
            "encoder.layers.1.self_attention.linear_qkv.weight", "encoder.layers.1.mlp.linear_fc2.weight"} <= keys
    assert not any("final_layernorm" in k or "input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)
    assert all(isinstance(layer, PostLNTransformerLayer) for layer in model.encoder.layers)
    pre_ln = BertModel(config, 64, 16)  # the default is unchanged: pre-LN, final LayerNorm, no embedding norm
    assert "encoder.final_layernorm.weight" in pre_ln.state_dict() and pre_ln.embedding.layernorm is None
    with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm"):
        BertModel(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                    apply_residual_connection_post_layernorm=True), 64, 16, post_layernorm=True)


def test_pipeline_stage_pieces():
    """post_process=False returns the hidden states [s, b, h] and has no heads; pre_process=False
    has no embedding, reads set_input_tensor() and keeps its own (zeroed) copy of the tied weight."""
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0)
    first = BertModel(config, 64, 16, post_process=False).eval()
    assert first.lm_head is None and first.output_layer is None
    tokens = torch.randint(0, 64, (2, 16))
    padding_mask = torch.ones(2, 16, dtype=torch.long)
    hidden = first(tokens, padding_mask)
    assert hidden.shape == (16, 2, 32)
    last = BertModel(config, 64, 16, pre_process=False).eval()
    assert last.embedding is None and last.output_layer.weight.shared_embedding
    assert torch.all(last.output_layer.weight == 0)
    last.set_input_tensor([hidden])
    lm_logits, binary_logits = last(None, padding_mask)
    assert lm_logits.shape == (2, 16, 64) and binary_logits.shape == (2, 2)


@KINDS
def test_attention_is_bidirectional_and_ignores_padding(kind):
    hf = make_hf(kind=kind)
    ours = make_ours(hf, FUSED)
    tokens, types, padding_mask = make_batch()
    with torch.no_grad():
        logits, _ = ours(tokens, padding_mask, tokentype_ids=types)
        later = tokens.clone()
        later[0, -1] = (later[0, -1] + 1) % VOCAB  # the last token of the full row
        changed, _ = ours(later, padding_mask, tokentype_ids=types)
        padded = tokens.clone()
        padded[2, LENGTHS[2]:] = 5  # the padding of the shortest row
        same, _ = ours(padded, padding_mask, tokentype_ids=types)
    assert (changed[0, 0] - logits[0, 0]).abs().max() > 1e-3  # the first token sees the last one
    torch.testing.assert_close(real(same, padding_mask), real(logits, padding_mask), rtol=0, atol=0)


def test_extended_attention_mask():
    padding_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    mask = bert_extended_attention_mask(padding_mask)
    assert mask.shape == (2, 1, 3, 3) and mask.dtype == torch.bool
    expected = torch.tensor([[[False, False, True], [False, False, True], [True, True, True]],
                             [[False] * 3] * 3])
    assert torch.equal(mask[:, 0], expected)


def test_bert_loss():
    lm_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    loss_mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    logits = torch.tensor([[2.0, -1.0], [0.5, 0.5]])
    order = torch.tensor([1, 0])
    total, reported = bert_loss(lm_loss, logits, loss_mask, order)
    lm = (1.0 + 3.0 + 5.0) / 3
    sop = F.cross_entropy(logits, order)
    torch.testing.assert_close(total, torch.tensor(lm) + sop)
    assert set(reported) == {"lm loss", "sop loss"}
    torch.testing.assert_close(reported["lm loss"], torch.tensor(lm))
    torch.testing.assert_close(reported["sop loss"], sop)
    ignored, _ = bert_loss(lm_loss, logits, loss_mask, torch.tensor([1, -1]))  # -1: no sentence-order label
    torch.testing.assert_close(ignored, torch.tensor(lm) + F.cross_entropy(logits[:1], order[:1]))
    total, reported = bert_loss(lm_loss, None, loss_mask, order)
    assert set(reported) == {"lm loss"}
    torch.testing.assert_close(total, torch.tensor(lm))
