"""megatron-core's BertModel and T5Model (local specs, 0.16.1, run on CPU) and ours: one state dict,
the same numbers, both ways.

Each module-scoped fixture runs one megatron-core snippet (tests/helpers/mcore_reference.py) that builds
megatron-core's tiny model with perturbed weights (norms and biases away from 1 and 0, so a mix-up
shows), saves its state dict and its outputs on a fixed batch, then loads *our* model's state dict
(saved by the fixture first) into a fresh megatron-core model and saves that model's outputs too.
The tests load megatron-core's state dict strictly into ours (the keys are the same: ours claim
megatron-core's names; megatron-core adds only `_extra_state` entries, None for its own linears) and
compare in fp32.

The flags that make the two coincide:
  both  --no-masked-softmax-fusion (masked_softmax_fusion False): megatron-core in fp32 on CPU runs
        its unfused softmax, where a query that sees no key (a padding position) gets 1/sk; our
        fused path gives it zeros, as Megatron's fused kernel does (every real position agrees
        either way: test_bert_fused_softmax_differs_only_where_a_query_sees_no_key). Dropout 0, fp32.
  BERT  --bert-binary-head (num_tokentypes 2, pooler + binary_head), tied output weight with its own
        bias, learned_absolute positions, the padding mask [b, s] with 1 = real token (both build
        Megatron's b1ss mask: (i, j) kept when both are real, in the unfused softmax a fully masked
        row averages the values, as the -10000 fill makes it). The LM head's GeLU is the exact erf
        one in both. The MLP's GeLU: megatron-core's bias_activation_fusion (Megatron-LM's
        --bias-gelu-fusion, its default) is the tanh approximation, as our bias_gelu_fusion is;
        without fusion both use F.gelu (both forms tested).
  T5    learned_absolute positions (Megatron's T5), tied embeddings (the LM head then has a bias in
        both; megatron-core's has none when untied), LayerNorm, the exact GeLU (our bias_gelu_fusion
        False, --no-bias-gelu-fusion, against megatron-core's default bias_activation_fusion False),
        the three bool masks True = masked out that t5_attention_masks builds (Megatron's
        pretrain_t5.py masks after its `< 0.5`). megatron-core's T5 state dict has two tensors twice
        (position_embeddings.weight, output_layer.bias: second names of embedding.position_embeddings
        and lm_head.output_layer); legacy.drop_core_aliases keeps one, as the core dialect does.
        megatron-core's local block spec takes its final norms from Transformer Engine (TENorm);
        without TE it has none, so the CPU patches put its torch LayerNorm there -- the layout a
        megatron-core T5 written with TE installed has (encoder/decoder.final_layernorm.*).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from megatron.convert.legacy import drop_core_aliases
from megatron.model import BertModel, TransformerConfig
from megatron.model.t5_model import T5Model, t5_attention_masks
from tests.helpers.mcore_reference import require_mcore, run_mcore

VOCAB, SEQ, BATCH = 128, 16, 3
LENGTHS = (16, 11, 6)  # real tokens per row
DEC_SEQ, DEC_LENGTHS = 12, (12, 8, 5)
SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, hidden_dropout=0.0,
             attention_dropout=0.0, layernorm_epsilon=1e-5, init_method_std=0.1)
FUSED = {"fused": True, "unfused": False}  # megatron-core's bias_activation_fusion = our bias_gelu_fusion


def _batch():
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    types = (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ).contiguous()
    padding = (torch.arange(SEQ) < torch.tensor(LENGTHS)[:, None]).long()  # [b, s] 1 = real
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    dec_tokens = torch.randint(0, VOCAB, (BATCH, DEC_SEQ), generator=gen)
    dec_padding = (torch.arange(DEC_SEQ) < torch.tensor(DEC_LENGTHS)[:, None]).long()
    dec_labels = torch.randint(0, VOCAB, (BATCH, DEC_SEQ), generator=gen)
    return dict(tokens=tokens, types=types, padding=padding, labels=labels, dec_tokens=dec_tokens,
                dec_padding=dec_padding, dec_labels=dec_labels)


def _perturb(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)


_PRELUDE = '''
import torch, torch.nn.functional as F
patch_for_cpu()
from megatron.core.transformer.transformer_config import TransformerConfig
init_one_rank(1234)
batch = torch.load("@DIR@/batch.pt")

def perturb(model):
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)

def load_ours(model, name, aliases=()):
    # aliases: megatron-core's second names of a module (T5's position_embeddings, output_layer),
    # loaded through the first name
    missing, unexpected = model.load_state_dict(torch.load("@DIR@/" + name), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") or k.startswith(aliases) for k in missing), \
        (missing, unexpected)
'''

MCORE_BERT = _PRELUDE + '''
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec

def build(fused):
    config = TransformerConfig(**@SHAPE@, bias_activation_fusion=fused, use_cpu_initialization=True)
    return BertModel(config, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec, vocab_size=@VOCAB@,
                     max_sequence_length=@SEQ@, share_embeddings_and_output_weights=True,
                     add_binary_head=True).eval()

def outputs(model):
    with torch.no_grad():
        logits, binary = model(batch["tokens"], batch["padding"], tokentype_ids=batch["types"])
        loss, _ = model(batch["tokens"], batch["padding"], tokentype_ids=batch["types"], lm_labels=batch["labels"])
    return {"logits": logits, "binary": binary, "loss": loss}

for name, fused in @FUSED@.items():
    model = build(fused)
    perturb(model)
    torch.save({"state": model.state_dict(), "outputs": outputs(model)}, "@DIR@/mcore_" + name + ".pt")
    theirs = build(fused)
    load_ours(theirs, "ours_bert.pt")
    torch.save(outputs(theirs), "@DIR@/mcore_with_ours_" + name + ".pt")
'''

MCORE_T5 = _PRELUDE + '''
from megatron.core.models.T5.t5_model import T5Model
from megatron.core.models.T5.t5_spec import (get_t5_decoder_with_local_block_spec,
                                             get_t5_encoder_with_local_block_spec)
masks = batch["t5_masks"]

def build():
    config = TransformerConfig(**@SHAPE@, use_cpu_initialization=True)
    layers = config.num_layers
    return T5Model(config, config, get_t5_encoder_with_local_block_spec(layers),
                   get_t5_decoder_with_local_block_spec(layers), vocab_size=@VOCAB@, max_sequence_length=@SEQ@,
                   share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute").eval()

def outputs(model):
    with torch.no_grad():
        logits = model(batch["tokens"], batch["dec_tokens"], *masks)
        loss = model(batch["tokens"], batch["dec_tokens"], *masks, lm_labels=batch["dec_labels"])
    return {"logits": logits, "loss": loss}

model = build()
perturb(model)
torch.save({"state": model.state_dict(), "outputs": outputs(model)}, "@DIR@/mcore_t5.pt")
theirs = build()
load_ours(theirs, "ours_t5.pt", ("position_embeddings.", "output_layer."))
torch.save(outputs(theirs), "@DIR@/mcore_with_ours_t5.pt")
'''


def _snippet(template: str, folder) -> str:
    for key, value in {"@DIR@": folder, "@SHAPE@": repr(SHAPE), "@VOCAB@": VOCAB,
                       "@SEQ@": SEQ, "@FUSED@": repr(FUSED)}.items():
        template = template.replace(key, str(value))
    return template


def _our_bert(fused: bool, softmax_fusion: bool = False) -> BertModel:
    config = TransformerConfig(**SHAPE, bias_gelu_fusion=fused, masked_softmax_fusion=softmax_fusion)
    return BertModel(config, VOCAB, SEQ, num_tokentypes=2, add_binary_head=True).eval()


def _our_t5() -> T5Model:
    config = TransformerConfig(**SHAPE, masked_softmax_fusion=False, bias_gelu_fusion=False)
    return T5Model(config, VOCAB, SEQ, position_embedding_type="learned_absolute").eval()


def _strip_extra_state(state):
    extra = [k for k in state if k.endswith("_extra_state")]
    assert all(state[k] is None or torch.is_tensor(state[k]) and state[k].numel() == 0 for k in extra)
    return {k: v for k, v in state.items() if k not in extra}


@pytest.fixture(scope="module")
def bert_runs(tmp_path_factory):
    require_mcore()
    folder = tmp_path_factory.mktemp("mcore_bert")
    batch = _batch()
    torch.save(batch, folder / "batch.pt")
    torch.manual_seed(11)
    ours = _our_bert(True)  # the weights do not depend on the fusion flag
    _perturb(ours)
    torch.save(ours.state_dict(), folder / "ours_bert.pt")
    run_mcore(_snippet(MCORE_BERT, folder))
    return folder, batch, ours.state_dict()


@pytest.fixture(scope="module")
def t5_runs(tmp_path_factory):
    require_mcore()
    folder = tmp_path_factory.mktemp("mcore_t5")
    batch = _batch()
    batch["t5_masks"] = t5_attention_masks(batch["padding"], batch["dec_padding"])
    torch.save(batch, folder / "batch.pt")
    torch.manual_seed(13)
    ours = _our_t5()
    _perturb(ours)
    torch.save(ours.state_dict(), folder / "ours_t5.pt")
    run_mcore(_snippet(MCORE_T5, folder))
    return folder, batch, ours.state_dict()


def _bert_outputs(model: BertModel, batch):
    with torch.no_grad():
        logits, binary = model(batch["tokens"], batch["padding"], batch["types"])
        loss, _ = model(batch["tokens"], batch["padding"], batch["types"], lm_labels=batch["labels"])
    return {"logits": logits, "binary": binary, "loss": loss}


def _assert_outputs_equal(ours, reference):
    assert set(ours) == set(reference)
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("fusion", list(FUSED))
def test_megatron_core_bert_loads_strictly_and_gives_its_logits_loss_and_binary_logits(bert_runs, fusion):
    folder, batch, _ = bert_runs
    saved = torch.load(folder / f"mcore_{fusion}.pt")
    model = _our_bert(FUSED[fusion])
    state = _strip_extra_state(saved["state"])
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: tuple(v.shape) for k, v in state.items()}
    model.load_state_dict(state, strict=True)
    _assert_outputs_equal(_bert_outputs(model, batch), saved["outputs"])


@pytest.mark.parametrize("fusion", list(FUSED))
def test_our_bert_in_megatron_core_gives_our_outputs(bert_runs, fusion):
    folder, batch, ours = bert_runs
    model = _our_bert(FUSED[fusion])
    model.load_state_dict(ours, strict=True)
    _assert_outputs_equal(_bert_outputs(model, batch), torch.load(folder / f"mcore_with_ours_{fusion}.pt"))


def test_bert_gelu_forms_differ_so_the_fusion_flag_matters(bert_runs):
    folder, batch, _ = bert_runs
    fused = torch.load(folder / "mcore_fused.pt")["outputs"]["logits"]
    unfused = torch.load(folder / "mcore_unfused.pt")["outputs"]["logits"]
    assert not torch.allclose(fused, unfused, rtol=1e-5, atol=1e-5)  # else the parametrization proves nothing


def test_bert_fused_softmax_differs_only_where_a_query_sees_no_key(bert_runs):
    """Our default masked_softmax_fusion gives a padding query (every key masked) an all-zero row,
    as Megatron's fused kernel (fp16/bf16 on GPU) does; megatron-core in fp32 runs its unfused
    softmax (1/sk there). Every real position agrees either way."""
    folder, batch, _ = bert_runs
    saved = torch.load(folder / "mcore_unfused.pt")
    model = _our_bert(False, softmax_fusion=True)
    model.load_state_dict(_strip_extra_state(saved["state"]), strict=True)
    ours = _bert_outputs(model, batch)
    real = batch["padding"].bool()
    torch.testing.assert_close(ours["logits"][real], saved["outputs"]["logits"][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["binary"], saved["outputs"]["binary"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours["logits"][~real], saved["outputs"]["logits"][~real], rtol=1e-3, atol=1e-3)


def _t5_outputs(model: T5Model, batch):
    masks = batch["t5_masks"]
    with torch.no_grad():
        return {"logits": model(batch["tokens"], batch["dec_tokens"], *masks),
                "loss": model(batch["tokens"], batch["dec_tokens"], *masks, lm_labels=batch["dec_labels"])}


def test_megatron_core_t5_loads_strictly_and_gives_its_logits_and_loss(t5_runs):
    folder, batch, _ = t5_runs
    saved = torch.load(folder / "mcore_t5.pt")
    model = _our_t5()
    # megatron-core's T5 has two tensors twice (position_embeddings.*, output_layer.*); the core
    # dialect keeps one name of each, as here
    assert {"position_embeddings.weight", "output_layer.bias"} <= set(saved["state"])
    state = drop_core_aliases(_strip_extra_state(saved["state"]))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: tuple(v.shape) for k, v in state.items()}
    model.load_state_dict(state, strict=True)
    _assert_outputs_equal(_t5_outputs(model, batch), saved["outputs"])


def test_our_t5_in_megatron_core_gives_our_logits_and_loss(t5_runs):
    folder, batch, ours = t5_runs
    model = _our_t5()
    model.load_state_dict(ours, strict=True)
    _assert_outputs_equal(_t5_outputs(model, batch), torch.load(folder / "mcore_with_ours_t5.pt"))
