"""Megatron-LM's own BERT checkpoints through `convert.py --model-type BERT --loader legacy | mcore`.

classic: Megatron-LM's legacy BertModel (megatron/legacy/model/bert_model.py, language_model.py) at
TP = 2, PP = 2, checkpoint_version 3.0, written by this test from one of our seeded BertModels with
its own table of classic names (language_model.{embedding, encoder, pooler}, lm_head.{dense, norm,
bias}, binary_head, word_embeddings_for_head on the last stage), each TP shard cut with the layout
rules, args a Megatron-LM Namespace: converted to ours, it is the same tensors and the same logits.

megatron-core: a BertModel built and run by megatron-core 0.16.1 itself (tests/helpers/mcore_reference.py,
local spec, CPU), its state dict saved by the snippet in Megatron-LM's file layout (as
pretrain_bert.py --use-mcore-models writes it; also renamed to the Transformer Engine spec's fused
norm names with TE's empty `_extra_state`): converted to HF (--saver hf) MegatronBertForPreTraining
gives megatron-core's MLM logits on the real positions and its binary logits; converted to ours, the
same on every position. The snippet builds megatron-core with bias_activation_fusion False and
saves bias_gelu_fusion False (--no-bias-gelu-fusion): the erf GeLU in the MLP and the LM head, the
pair one HF hidden_act ("gelu") computes (the HF saver refuses Megatron's default tanh/erf pair).
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename
from megatron.convert import verify
from megatron.convert.layout_rules import renumber, tensor_layout
from megatron.core.tensor_parallel.layout import shard_for_rank
from megatron.model import BertModel
from tests.helpers.mcore_reference import require_mcore, run_mcore
from tools.checkpoint import convert, saver_megatron

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 4, 32, 4, 16, 256
NULL_VOCAB = 255  # NullTokenizer's --vocab-size: 255 ids and its eod, all 256 rows real
FLAGS = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
         "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
         "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(NULL_VOCAB), "--hidden-dropout", "0", "--attention-dropout", "0",
         "--no-bias-gelu-fusion"]
TP, PP, ITERATION = 2, 2, 7

# ours -> Megatron-LM's legacy BertModel (core_v0.5+ norm names), per part of the name
CLASSIC_LAYER = {"input_layernorm.": "input_norm.", "self_attention.linear_qkv.": "self_attention.query_key_value.",
                 "self_attention.linear_proj.": "self_attention.dense.", "pre_mlp_layernorm.": "post_attention_norm.",
                 "mlp.linear_fc1.": "mlp.dense_h_to_4h.", "mlp.linear_fc2.": "mlp.dense_4h_to_h."}
CLASSIC_HEADS = {"lm_head.dense.weight": ("lm_head", "dense.weight"), "lm_head.dense.bias": ("lm_head", "dense.bias"),
                 "lm_head.layer_norm.weight": ("lm_head", "norm.weight"),
                 "lm_head.layer_norm.bias": ("lm_head", "norm.bias"), "output_layer.bias": ("lm_head", "bias"),
                 "binary_head.weight": ("binary_head", "weight"), "binary_head.bias": ("binary_head", "bias"),
                 "word_embeddings_for_head.weight": ("word_embeddings_for_head", "weight")}


def _args() -> argparse.Namespace:
    args = parse_and_validate_args(argv=FLAGS)
    args.padded_vocab_size = VOCAB
    args.model_family, args.bert_binary_head = "BERT", True
    return args


def _megatron_args(args: argparse.Namespace, tp: int, pp: int) -> argparse.Namespace:
    """Megatron-LM's args Namespace (pretrain_bert.py's: no model_family, bert_binary_head True)."""
    raw = argparse.Namespace(**vars(args))
    del raw.model_family
    raw.tensor_model_parallel_size, raw.pipeline_model_parallel_size, raw.world_size = tp, pp, tp * pp
    raw.transformer_impl, raw.use_legacy_models = "local", True
    return raw


@pytest.fixture(scope="module")
def bert():
    """(our args, the whole state dict, the model) of a seeded BertModel, norms and biases perturbed."""
    args = _args()
    torch.manual_seed(21)
    model = BertModel(core_transformer_config_from_args(args), VOCAB, SEQ, num_tokentypes=2,
                      add_binary_head=True).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "norm" in key or key.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.3)
    return args, {k: v.detach().clone() for k, v in model.state_dict().items()}, model


def _classic_entry(local: dict) -> dict:
    """One file's model entry, nested as Megatron-LM's legacy BertModel.state_dict_for_save_checkpoint."""
    entry: dict = {}
    language_model: dict = {}
    for name, tensor in local.items():
        if name.startswith("embedding."):  # embedding.{word,position,tokentype}_embeddings.weight
            _, table, leaf = name.split(".")
            language_model.setdefault("embedding", {}).setdefault(table, {})[leaf] = tensor
        elif name.startswith("encoder.layers."):
            _, _, index, rest = name.split(".", 3)
            old = next(prefix for prefix in CLASSIC_LAYER if rest.startswith(prefix))
            language_model.setdefault("encoder", {})[f"layers.{index}.{CLASSIC_LAYER[old]}{rest[len(old):]}"] = tensor
        elif name.startswith("encoder.final_layernorm."):
            language_model.setdefault("encoder", {})[f"final_norm.{name.rsplit('.', 1)[1]}"] = tensor
        elif name.startswith("pooler.dense."):
            language_model.setdefault("pooler", {})[name[len("pooler."):]] = tensor
        else:
            module, leaf = CLASSIC_HEADS[name]
            entry.setdefault(module, {})[leaf] = tensor
    return {"language_model": language_model, **entry}


def _write_classic(save_dir, args, whole) -> None:
    raw = _megatron_args(args, TP, PP)
    per_stage = LAYERS // PP
    for pp_rank in range(PP):
        first, last = pp_rank == 0, pp_rank == PP - 1
        for tp_rank in range(TP):
            local = {}
            for name, tensor in whole.items():
                if name.startswith("encoder.layers."):
                    if int(name.split(".")[2]) // per_stage != pp_rank:
                        continue
                    local_name = renumber(name, -pp_rank * per_stage)
                elif name.startswith("embedding."):
                    if not first:
                        continue
                    local_name = name
                elif not last:
                    continue
                else:
                    local_name = name
                local[local_name] = shard_for_rank(tensor, tensor_layout(name, args, TP, tp_rank), TP, tp_rank).clone()
            if last and PP > 1:  # the last stage's copy of the tied word embeddings
                embedding = "embedding.word_embeddings.weight"
                local["word_embeddings_for_head.weight"] = shard_for_rank(
                    whole[embedding], tensor_layout(embedding, args, TP, tp_rank), TP, tp_rank).clone()
            state = {"args": raw, "iteration": ITERATION, "checkpoint_version": 3.0, "model": _classic_entry(local)}
            path = get_checkpoint_name(str(save_dir), ITERATION, pipeline_parallel=True, tensor_rank=tp_rank,
                                       pipeline_rank=pp_rank, expert_parallel=False, expert_rank=0)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state, path)
    with open(get_checkpoint_tracker_filename(str(save_dir)), "w") as f:
        f.write(str(ITERATION))


def _convert(loader, saver, load_dir, save_dir, *extra):
    convert.main(["--model-type", "BERT", "--loader", loader, "--saver", saver, "--load-dir", str(load_dir),
                  "--save-dir", str(save_dir), *extra])


def test_classic_bert_tp2_pp2_converts_to_the_same_tensors_and_logits(bert, tmp_path, capsys):
    args, whole, model = bert
    _write_classic(tmp_path / "megatron_lm", args, whole)
    _convert("legacy", "megatron", tmp_path / "megatron_lm", tmp_path / "ours",
             "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1")
    assert "-> OK" in capsys.readouterr().out
    target_args, tensors = saver_megatron.read_back(str(tmp_path / "ours"))
    tensors = dict(tensors)
    assert tensors.keys() == whole.keys() and all(torch.equal(tensors[k], whole[k]) for k in whole)
    assert target_args.model_family == "BERT" and target_args.bert_binary_head
    assert target_args.bias_gelu_fusion is False  # --no-bias-gelu-fusion carried from Megatron-LM's args
    result = verify.compare(model, verify.build_serial_model(target_args, tensors.items()), VOCAB, SEQ)
    assert result.ok, result.describe()


def test_classic_bert_is_refused_by_the_gpt_names(bert, tmp_path, capsys):
    """--model-type GPT on a BERT file: one line naming the first key GPT does not have."""
    args, whole, _ = bert
    _write_classic(tmp_path / "megatron_lm", args, whole)
    with pytest.raises(SystemExit):
        convert.cli(["--model-type", "GPT", "--loader", "legacy", "--saver", "megatron", "--load-dir",
                     str(tmp_path / "megatron_lm"), "--save-dir", str(tmp_path / "ours")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "classic GPT" in err[0], err
    assert not (tmp_path / "ours").exists()


# ----------------------------------------------------------------------------- written by megatron-core

MCORE_BERT = '''
import argparse, os
import torch
patch_for_cpu()
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer.transformer_config import TransformerConfig
init_one_rank(99)
config = TransformerConfig(num_layers=@LAYERS@, hidden_size=@HIDDEN@, num_attention_heads=@HEADS@, hidden_dropout=0.0,
                           attention_dropout=0.0, init_method_std=0.1, bias_activation_fusion=False,
                           use_cpu_initialization=True)
model = BertModel(config, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec, vocab_size=@VOCAB@,
                  max_sequence_length=@SEQ@, share_embeddings_and_output_weights=True, add_binary_head=True).eval()
gen = torch.Generator().manual_seed(8)
with torch.no_grad():
    for param in model.parameters():
        param.add_(torch.randn(param.shape, generator=gen) * 0.05)
batch = torch.load("@DIR@/batch.pt")
with torch.no_grad():
    logits, binary = model(batch["tokens"], batch["padding"], tokentype_ids=batch["types"])
torch.save({"logits": logits, "binary": binary}, "@DIR@/outputs.pt")
# pretrain_bert.py's args (the fields a Megatron-LM loader reads) and its checkpoint layout
args = argparse.Namespace(num_layers=@LAYERS@, hidden_size=@HIDDEN@, num_attention_heads=@HEADS@,
                          ffn_hidden_size=4 * @HIDDEN@, kv_channels=@HIDDEN@ // @HEADS@, max_position_embeddings=@SEQ@,
                          seq_length=@SEQ@, padded_vocab_size=@VOCAB@, make_vocab_size_divisible_by=128,
                          tokenizer_type="NullTokenizer", vocab_size=@NULL_VOCAB@,
                          position_embedding_type="learned_absolute",
                          normalization="LayerNorm", norm_epsilon=1e-5, add_bias_linear=True, bias_gelu_fusion=False,
                          bert_binary_head=True, untie_embeddings_and_output_weights=False, openai_gelu=False,
                          tensor_model_parallel_size=1, pipeline_model_parallel_size=1, world_size=1,
                          transformer_impl="local", use_legacy_models=False, ckpt_format="torch", fp16=False,
                          bf16=False, iteration=@ITERATION@)
folder = "@DIR@/mcore/iter_@ITER7@/mp_rank_00"
os.makedirs(folder)
torch.save({"args": args, "iteration": @ITERATION@, "checkpoint_version": 3.0, "model": model.state_dict()},
           folder + "/model_optim_rng.pt")
with open("@DIR@/mcore/latest_checkpointed_iteration.txt", "w") as f:
    f.write("@ITERATION@")
'''
TE_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


@pytest.fixture(scope="module")
def mcore_bert(tmp_path_factory):
    """(folder with mcore/ (the local spec's checkpoint), the batch, megatron-core's outputs)."""
    require_mcore()
    folder = tmp_path_factory.mktemp("mcore_bert_ckpt")
    tokens = verify.sample_tokens(VOCAB, SEQ)
    padding, types = verify.bert_inputs(tokens)
    batch = {"tokens": tokens, "padding": padding, "types": types}
    torch.save(batch, folder / "batch.pt")
    snippet = MCORE_BERT
    for key, value in {"@DIR@": folder, "@LAYERS@": LAYERS, "@HIDDEN@": HIDDEN, "@HEADS@": HEADS,
                       "@VOCAB@": VOCAB, "@NULL_VOCAB@": NULL_VOCAB, "@SEQ@": SEQ, "@ITER7@": f"{ITERATION:07d}",
                       "@ITERATION@": ITERATION}.items():
        snippet = snippet.replace(key, str(value))
    run_mcore(snippet)
    return folder, batch, torch.load(folder / "outputs.pt")


def _te_copy(source, target) -> None:
    """The megatron-core checkpoint in the Transformer Engine spec's names: fused norms, TE's empty
    `_extra_state` (also core_attention's)."""
    path = get_checkpoint_name(str(source), ITERATION, release=False)
    state = torch.load(path, weights_only=False)
    entry = {}
    for name, value in state["model"].items():
        for local, fused in TE_NORMS.items():
            name = name.replace(f".{local}", f".{fused}")
        if name.endswith("_extra_state") and ".layers." in name:
            value = torch.empty(0, dtype=torch.uint8)
        entry[name] = value
    for i in range(LAYERS):
        entry[f"encoder.layers.{i}.self_attention.core_attention._extra_state"] = torch.empty(0, dtype=torch.uint8)
    state["model"] = entry
    state["args"].transformer_impl = "transformer_engine"
    out = get_checkpoint_name(str(target), ITERATION, release=False)
    os.makedirs(os.path.dirname(out))
    torch.save(state, out)
    with open(get_checkpoint_tracker_filename(str(target)), "w") as f:
        f.write(str(ITERATION))


def _source(mcore_bert, naming, tmp_path):
    folder = mcore_bert[0]
    if naming == "local":
        return folder / "mcore"
    _te_copy(folder / "mcore", tmp_path / "mcore_te")
    return tmp_path / "mcore_te"


@pytest.mark.parametrize("naming", ["local", "te"])
def test_megatron_core_bert_converts_to_hf_with_megatron_cores_logits(mcore_bert, naming, tmp_path, capsys):
    from transformers import MegatronBertForPreTraining

    _, batch, reference = mcore_bert
    _convert("mcore", "hf", _source(mcore_bert, naming, tmp_path), tmp_path / "hf")
    assert "-> OK" in capsys.readouterr().out
    hf = MegatronBertForPreTraining.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    with torch.no_grad():
        out = hf(batch["tokens"], attention_mask=batch["padding"], token_type_ids=batch["types"])
    real = batch["padding"].bool()  # HF lets a padding query see the real keys, Megatron none
    torch.testing.assert_close(out.prediction_logits[real], reference["logits"][real],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.seq_relationship_logits, reference["binary"], rtol=1e-4, atol=1e-4)


def test_megatron_core_bert_converts_to_ours_at_tp2_with_megatron_cores_logits(mcore_bert, tmp_path, capsys):
    _, batch, reference = mcore_bert
    _convert("mcore", "megatron", _source(mcore_bert, "te", tmp_path), tmp_path / "ours",
             "--target-tensor-parallel-size", "2")
    assert "-> OK" in capsys.readouterr().out
    target_args, tensors = saver_megatron.read_back(str(tmp_path / "ours"))
    target_args.masked_softmax_fusion = False  # megatron-core's fp32 softmax: a padding query gets 1/sk
    model = verify.build_serial_model(target_args, tensors)
    with torch.no_grad():
        logits, binary = model(batch["tokens"], batch["padding"], tokentype_ids=batch["types"])
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(binary, reference["binary"], rtol=1e-5, atol=1e-5)


MCORE_LOAD_BERT = '''
import torch
patch_for_cpu()
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer.transformer_config import TransformerConfig
init_one_rank(1)
state = torch.load("@PATH@", weights_only=False)
args = state["args"]
config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                           num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                           hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=args.bias_gelu_fusion,
                           use_cpu_initialization=True)
model = BertModel(config, num_tokentypes=2 if args.bert_binary_head else 0,
                  transformer_layer_spec=bert_layer_local_spec,
                  vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                  share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                  add_binary_head=args.bert_binary_head).eval()
model.load_state_dict(state["model"], strict=True)
batch = torch.load("@BATCH@")
with torch.no_grad():
    logits, binary = model(batch["tokens"], batch["padding"], tokentype_ids=batch["types"])
torch.save({"logits": logits, "binary": binary, "impl": args.transformer_impl, "version": state["checkpoint_version"]},
           "@OUT@")
'''


def test_classic_bert_to_mcore_saver_loads_strictly_in_megatron_core_with_our_outputs(bert, tmp_path, capsys):
    """classic TP2 PP2 -> --saver mcore (local spec names) -> megatron-core's BertModel.load_state_dict(strict)."""
    import dataclasses

    require_mcore()
    args, whole, model = bert
    _write_classic(tmp_path / "megatron_lm", args, whole)
    _convert("legacy", "mcore", tmp_path / "megatron_lm", tmp_path / "mcore", "--target-tensor-parallel-size", "1",
             "--target-pipeline-parallel-size", "1", "--saver-transformer-impl", "local")
    assert "-> OK" in capsys.readouterr().out
    tokens = verify.sample_tokens(VOCAB, SEQ)
    padding, types = verify.bert_inputs(tokens)
    torch.save({"tokens": tokens, "padding": padding, "types": types}, tmp_path / "batch.pt")
    path = get_checkpoint_name(str(tmp_path / "mcore"), ITERATION, release=False)
    snippet = (MCORE_LOAD_BERT.replace("@PATH@", path)
               .replace("@BATCH@", str(tmp_path / "batch.pt")).replace("@OUT@", str(tmp_path / "out.pt")))
    run_mcore(snippet)
    reference = torch.load(tmp_path / "out.pt")
    assert reference["impl"] == "local" and reference["version"] == 3.0
    # ours with megatron-core's fp32 softmax (a padding query: 1/sk), the same weights
    unfused = BertModel(dataclasses.replace(model.config, masked_softmax_fusion=False), VOCAB, SEQ,
                        num_tokentypes=2, add_binary_head=True).eval()
    unfused.load_state_dict(whole, strict=True)
    with torch.no_grad():
        logits, binary = unfused(tokens, padding, tokentype_ids=types)
    torch.testing.assert_close(reference["logits"], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reference["binary"], binary, rtol=1e-5, atol=1e-5)
