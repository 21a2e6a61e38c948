"""The fine-tuning heads (megatron/model/classification.py, multiple_choice.py) on BertModel's trunk:
Megatron's key names, a pretrain_bert.py state dict loaded (its LM and binary heads dropped, the new
head announced), the logits as the pooler and the head compute them, and BertModel unchanged."""
from __future__ import annotations

import pytest
import torch

from megatron.model import BertModel, TransformerConfig
from megatron.model.classification import Classification
from megatron.model.multiple_choice import MultipleChoice

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB, SEQ = 64, 12


def _config() -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                             attention_dropout=0.0)


def _inputs(batch: int, seed: int = 3):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[0, 8:] = 0
    types = (torch.arange(SEQ) >= 5).long().expand(batch, SEQ)
    return tokens, mask, types


def test_keys_are_the_bert_trunk_and_megatron_head_names():
    keys = set(Classification(_config(), 3, VOCAB, SEQ).state_dict())
    assert {"classification_head.weight", "classification_head.bias", "pooler.dense.weight",
            "embedding.tokentype_embeddings.weight", "encoder.final_layernorm.weight"} <= keys
    assert not [k for k in keys if k.startswith(("lm_head.", "output_layer.", "binary_head."))]
    choice = MultipleChoice(_config(), VOCAB, SEQ).state_dict()
    assert choice["multichoice_head.weight"].shape == (1, 32)
    trunk = {k for k in keys if not k.startswith("classification_head.")}
    assert trunk == {k for k in choice if not k.startswith("multichoice_head.")}


def test_a_pretraining_state_dict_loads_and_the_logits_are_pooler_then_head(capsys):
    torch.manual_seed(0)
    bert = BertModel(_config(), VOCAB, SEQ).eval()  # pretrain_bert.py's: LM head, pooler, binary head
    torch.manual_seed(1)
    model = Classification(_config(), 3, VOCAB, SEQ).eval()
    head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("classification_head.")}
    model.load_state_dict(bert.state_dict())
    assert "***WARNING*** could not find classification_head in the checkpoint, initializing to random" in \
        capsys.readouterr().out
    for name, value in model.state_dict().items():
        expected = head[name] if name in head else bert.state_dict()[name]
        assert torch.equal(value, expected), name
    tokens, mask, types = _inputs(2)
    with torch.no_grad():
        pooled = bert.pooler(bert.encode(tokens, mask, types), 0)  # [b, h]
        expected = pooled @ head["classification_head.weight"].t() + head["classification_head.bias"]
        logits = model(tokens, mask, tokentype_ids=types)
    assert logits.shape == (2, 3)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    # a fine-tuned model's own state dict loads back without a warning
    again = Classification(_config(), 3, VOCAB, SEQ)
    again.load_state_dict(model.state_dict())
    assert "WARNING" not in capsys.readouterr().out


def test_a_bert_without_the_binary_head_gives_a_new_pooler_and_tokentype_table(capsys):
    bert = BertModel(_config(), VOCAB, SEQ, num_tokentypes=0, add_binary_head=False)
    model = Classification(_config(), 2, VOCAB, SEQ)
    model.load_state_dict(bert.state_dict())
    out = capsys.readouterr().out
    for name in ("classification_head", "pooler", "embedding.tokentype_embeddings"):
        assert f"***WARNING*** could not find {name} in the checkpoint, initializing to random" in out


def test_a_missing_encoder_tensor_is_named():
    state = BertModel(_config(), VOCAB, SEQ).state_dict()
    del state["encoder.layers.1.mlp.linear_fc1.weight"]
    with pytest.raises(RuntimeError, match=r"missing from the checkpoint: \['encoder.layers.1.mlp.linear_fc1.weight'\]"):
        Classification(_config(), 3, VOCAB, SEQ).load_state_dict(state)


def test_multiple_choice_scores_each_choice_and_reshapes_to_choices():
    torch.manual_seed(0)
    model = MultipleChoice(_config(), VOCAB, SEQ).eval()
    tokens, mask, types = _inputs(6)
    with torch.no_grad():
        logits = model(tokens.view(3, 2, SEQ), mask.view(3, 2, SEQ), types.reshape(3, 2, SEQ))  # [b=3, c=2]
        one_by_one = torch.stack([model.multichoice_head(model.pooled(tokens[i:i + 1], mask[i:i + 1],
                                                                      types[i:i + 1]))[0, 0] for i in range(6)])
    assert logits.shape == (3, 2)
    torch.testing.assert_close(logits.reshape(-1), one_by_one, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="batch, choices, sequence"):
        model(tokens, mask, types)


def test_bert_model_without_the_lm_head_refuses_tied_weights():
    with pytest.raises(ValueError, match="share_embeddings_and_output_weights=False"):
        BertModel(_config(), VOCAB, SEQ, add_lm_head=False)
    trunk = BertModel(_config(), VOCAB, SEQ, add_lm_head=False, share_embeddings_and_output_weights=False,
                      add_pooler=True)
    assert trunk.lm_head is None and trunk.output_layer is None and trunk.pooler is not None
