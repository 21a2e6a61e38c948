"""--include-padded-vocab-in-loss against megatron-core 0.16.1 itself, on one rank.

megatron-core's GPTModel (local spec, GPT-2's 50,257 ids padded to 50,304) is built in a subprocess
(tests/helpers/padded_vocab_reference.py); its weights are loaded into ours and the same batch is run
through both. With the flag our per-token losses are megatron-core's -- on both cross-entropy paths
(the one-rank fast path and the general vocab-parallel one) and with an untied output layer; by
default they are lower by exactly the probability the padding ids take, which is the figure
docs/training.md quotes (`pytest -s tests/unit/test_padded_vocab_loss.py` prints it). The padding rows
a fresh model draws with the flag are megatron-core's draw, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.model import GPTModel, TransformerConfig
from megatron.model.embedding import LanguageModelEmbedding
from megatron.model.layers import fused_impl
from tests.helpers.padded_vocab_reference import (
    GPT2_PADDED,
    GPT2_VOCAB,
    HEADS,
    HIDDEN,
    LAYERS,
    SEED,
    SEQ,
    SMALL_VOCAB,
    megatron_core_reference,
)


def _config(include_padding: bool, impl: str = "native") -> TransformerConfig:
    # bias_gelu_fusion off: megatron-core's default GeLU is the erf one (its bias_activation_fusion is off).
    return TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                             attention_dropout=0.0, bias_gelu_fusion=False, fused_kernels_cpu_impl=impl,
                             include_padded_vocab_in_loss=include_padding)


def _ours_on_megatron_cores_weights(tied: bool, include_padding: bool, impl: str = "native") -> GPTModel:
    reference = megatron_core_reference()
    state_dict = {name: value for name, value in reference[("tied" if tied else "untied") + "_state_dict"].items()
                  if not name.endswith("._extra_state")}  # None placeholders of megatron-core's linear layers
    model = GPTModel(_config(include_padding, impl), vocab_size=GPT2_PADDED, num_tokens=GPT2_VOCAB,
                     max_sequence_length=SEQ, share_embeddings_and_output_weights=tied)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def _run(model: GPTModel, labels: bool = True) -> torch.Tensor:
    """Per-token losses [b, s] of the reference batch, or the logits [b, s, vocab] without labels."""
    reference = megatron_core_reference()
    with torch.no_grad():
        return model(reference["tokens"], reference["position_ids"], reference["mask"],
                     labels=reference["labels"] if labels else None)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("impl", ["native", "reference"], ids=["one-rank-fast-ce", "vocab-parallel-ce"])
def test_flag_gives_megatron_cores_loss_on_its_weights(tied, impl):
    model = _ours_on_megatron_cores_weights(tied, include_padding=True, impl=impl)
    assert model.loss_vocab_size == GPT2_PADDED
    losses = _run(model)
    # the cross-entropy path this case is meant to take (the fast one only computes in fp32 on one rank)
    assert (fused_impl(model.config, losses) != "reference") == (impl == "native")
    expected = megatron_core_reference()[("tied" if tied else "untied") + "_losses"]
    torch.testing.assert_close(losses, expected, rtol=0, atol=5e-6)  # fp32: a few ulps of 10.8
    assert losses.mean().item() == pytest.approx(expected.mean().item(), abs=1e-6)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_default_loss_leaves_out_exactly_the_padding_probability(tied):
    """Default minus Megatron's loss is, per token, log of the real ids' share of the softmax."""
    megatron_core = megatron_core_reference()[("tied" if tied else "untied") + "_losses"]
    model = _ours_on_megatron_cores_weights(tied, include_padding=False)
    assert model.loss_vocab_size == GPT2_VOCAB
    losses = _run(model)
    logits = _run(model, labels=False).double()  # [b, s, 50304], the same weights either way
    real_share = logits[..., :GPT2_VOCAB].logsumexp(-1) - logits.logsumexp(-1)  # log p(id < 50257), [b, s]
    assert (real_share < 0).all()
    torch.testing.assert_close(losses.double(), megatron_core.double() + real_share, rtol=0, atol=5e-6)
    difference = megatron_core.mean().item() - losses.mean().item()
    # near log(50304 / 50257) = 0.000935 for a fresh model, whose logits are all small
    assert difference == pytest.approx(-real_share.mean().item(), abs=1e-6)
    assert 0.0005 < difference < 0.0015
    print(f"\nmegatron-core {megatron_core_reference()['version']} ({'tied' if tied else 'untied'}, "
          f"{GPT2_VOCAB} ids padded to {GPT2_PADDED}): lm loss {megatron_core.mean().item():.6f}; ours "
          f"--include-padded-vocab-in-loss {_run(_ours_on_megatron_cores_weights(tied, True)).mean().item():.6f}, "
          f"default {losses.mean().item():.6f} (difference {difference:.6f})")


def test_flag_draws_the_padding_rows_as_megatron_core():
    """The whole padded table [384, h] is drawn as megatron-core draws it (position table after it)."""
    reference = megatron_core_reference()
    padded = reference["embedding_word"].size(0)
    torch.manual_seed(SEED)
    embedding = LanguageModelEmbedding(_config(True), padded, SEQ, num_tokens=SMALL_VOCAB)
    assert torch.equal(embedding.word_embeddings.weight.detach(), reference["embedding_word"])
    assert torch.equal(embedding.position_embeddings.weight.detach(), reference["embedding_position"])
    assert reference["embedding_word"][SMALL_VOCAB:].std().item() == pytest.approx(0.02, rel=0.1)
    # without the flag the padding rows start at zero (and the draws after them move)
    torch.manual_seed(SEED)
    default = LanguageModelEmbedding(_config(False), padded, SEQ, num_tokens=SMALL_VOCAB)
    assert not default.word_embeddings.weight.detach()[SMALL_VOCAB:].any()
    # an untied output layer draws its whole padded matrix in either mode, as megatron-core's does
    torch.manual_seed(SEED)
    output_layer = ColumnParallelLinear(HIDDEN, padded, config=_config(True), init_method=_config(True).init_method,
                                        bias=False)
    assert torch.equal(output_layer.weight.detach(), reference["output_layer"])


def test_flag_keeps_every_id_in_a_fresh_models_loss():
    """A fresh model with the flag: loss = cross entropy over all padded logits, whose padding rows are drawn."""
    torch.manual_seed(SEED)
    model = GPTModel(_config(True), vocab_size=384, num_tokens=SMALL_VOCAB, max_sequence_length=SEQ).eval()
    assert model.embedding.word_embeddings.weight[SMALL_VOCAB:].abs().min() > 0
    generator = torch.Generator().manual_seed(3)
    tokens, labels = (torch.randint(0, SMALL_VOCAB, (2, SEQ), generator=generator) for _ in range(2))
    position_ids = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        losses = model(tokens, position_ids, None, labels=labels)  # [b, s]
        logits = model(tokens, position_ids, None)  # [b, s, 384]
    expected = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-5)
