"""Megatron-LM's megatron-core T5 checkpoints through `convert.py --model-type T5 --loader mcore`.

A T5Model built and run by megatron-core 0.16.1 itself (tests/helpers/mcore_reference.py; local block specs
with the final norms the CPU patches give them, learned positions, tied embeddings), saved by the
snippet in Megatron-LM's file layout with pretrain_t5.py-style args (encoder/decoder_num_layers,
bias_gelu_fusion False), also renamed to the Transformer Engine spec's fused norm names: converted
to ours (at TP = 2), it gives megatron-core's logits on megatron-core's masks. Its state dict holds
position_embeddings.weight and output_layer.bias twice (legacy.drop_core_aliases); ours written
back with --saver mcore loads strictly in megatron-core's T5Model with the first logits.

classic: Megatron-LM's legacy T5Model (language_model.{embedding, encoder, decoder}, the decoder
layers' post_attention_norm / inter_attention.{query, key_value, dense} / post_inter_attention_norm,
lm_head.bias) at TP = 2, checkpoint_version 3.0, written by this test from one of our seeded T5Models
with its own table: converted, the same tensors and logits.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename
from megatron.convert import verify
from megatron.model.t5_model import t5_attention_masks
from tests.helpers.mcore_reference import require_mcore, run_mcore
from tools.checkpoint import convert, saver_megatron

LAYERS, HIDDEN, HEADS, SEQ, DEC_SEQ, VOCAB, NULL_VOCAB, ITERATION = 2, 32, 4, 16, 12, 256, 255, 3

MCORE_T5 = '''
import argparse, os
import torch
patch_for_cpu()
from megatron.core.models.T5.t5_model import T5Model
from megatron.core.models.T5.t5_spec import get_t5_decoder_with_local_block_spec, get_t5_encoder_with_local_block_spec
from megatron.core.transformer.transformer_config import TransformerConfig
init_one_rank(77)
config = TransformerConfig(num_layers=@LAYERS@, hidden_size=@HIDDEN@, num_attention_heads=@HEADS@, hidden_dropout=0.0,
                           attention_dropout=0.0, init_method_std=0.1, use_cpu_initialization=True)
model = T5Model(config, config, get_t5_encoder_with_local_block_spec(@LAYERS@),
                get_t5_decoder_with_local_block_spec(@LAYERS@), vocab_size=@VOCAB@, max_sequence_length=@SEQ@,
                share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute").eval()
gen = torch.Generator().manual_seed(9)
with torch.no_grad():
    for param in model.parameters():
        param.add_(torch.randn(param.shape, generator=gen) * 0.05)
batch = torch.load("@DIR@/batch.pt")
with torch.no_grad():
    logits = model(batch["tokens"], batch["dec_tokens"], *batch["masks"])
torch.save(logits, "@DIR@/logits.pt")
args = argparse.Namespace(num_layers=@LAYERS@, encoder_num_layers=@LAYERS@, decoder_num_layers=@LAYERS@,
                          hidden_size=@HIDDEN@, num_attention_heads=@HEADS@, ffn_hidden_size=4 * @HIDDEN@,
                          kv_channels=@HIDDEN@ // @HEADS@, max_position_embeddings=@SEQ@, seq_length=@SEQ@,
                          encoder_seq_length=@SEQ@, decoder_seq_length=@DEC_SEQ@, padded_vocab_size=@VOCAB@,
                          make_vocab_size_divisible_by=128, tokenizer_type="NullTokenizer", vocab_size=@NULL_VOCAB@,
                          position_embedding_type="learned_absolute", normalization="LayerNorm", norm_epsilon=1e-5,
                          add_bias_linear=True, bias_gelu_fusion=False, untie_embeddings_and_output_weights=False,
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
def mcore_t5(tmp_path_factory):
    require_mcore()
    folder = tmp_path_factory.mktemp("mcore_t5_ckpt")
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=gen)
    dec_tokens = torch.randint(0, VOCAB, (3, DEC_SEQ), generator=gen)
    padding = (torch.arange(SEQ) < torch.tensor([[SEQ], [11], [6]])).long()
    dec_padding = (torch.arange(DEC_SEQ) < torch.tensor([[DEC_SEQ], [8], [5]])).long()
    batch = {"tokens": tokens, "dec_tokens": dec_tokens, "masks": t5_attention_masks(padding, dec_padding)}
    torch.save(batch, folder / "batch.pt")
    snippet = MCORE_T5
    for key, value in {"@DIR@": folder, "@LAYERS@": LAYERS, "@HIDDEN@": HIDDEN, "@HEADS@": HEADS,
                       "@VOCAB@": VOCAB, "@NULL_VOCAB@": NULL_VOCAB, "@SEQ@": SEQ, "@DEC_SEQ@": DEC_SEQ,
                       "@ITER7@": f"{ITERATION:07d}", "@ITERATION@": ITERATION}.items():
        snippet = snippet.replace(key, str(value))
    run_mcore(snippet)
    return folder, batch, torch.load(folder / "logits.pt")


def _te_copy(source, target) -> None:
    """The checkpoint in the Transformer Engine spec's names (fused norms, TE's empty `_extra_state`)."""
    state = torch.load(get_checkpoint_name(str(source), ITERATION), weights_only=False)
    entry = {}
    for name, value in state["model"].items():
        for local, fused in TE_NORMS.items():
            name = name.replace(f".{local}", f".{fused}")
        if name.endswith("_extra_state") and ".layers." in name:
            value = torch.empty(0, dtype=torch.uint8)
        entry[name] = value
    state["model"], state["args"].transformer_impl = entry, "transformer_engine"
    out = get_checkpoint_name(str(target), ITERATION)
    os.makedirs(os.path.dirname(out))
    torch.save(state, out)
    with open(get_checkpoint_tracker_filename(str(target)), "w") as f:
        f.write(str(ITERATION))


@pytest.mark.parametrize("naming", ["local", "te"])
def test_megatron_core_t5_converts_to_ours_with_megatron_cores_logits(mcore_t5, naming, tmp_path, capsys):
    folder, batch, reference = mcore_t5
    source = folder / "mcore"
    if naming == "te":
        _te_copy(source, tmp_path / "te")
        source = tmp_path / "te"
    convert.main(["--model-type", "T5", "--loader", "mcore", "--saver", "megatron", "--load-dir", str(source),
                  "--save-dir", str(tmp_path / "ours"), "--target-tensor-parallel-size", "2"])
    assert "-> OK" in capsys.readouterr().out
    target_args, tensors = saver_megatron.read_back(str(tmp_path / "ours"))
    assert target_args.model_family == "T5" and target_args.decoder_seq_length == DEC_SEQ
    target_args.masked_softmax_fusion = False  # megatron-core's fp32 softmax: a padding query gets 1/sk
    model = verify.build_serial_model(target_args, tensors)
    with torch.no_grad():
        logits = model(batch["tokens"], batch["dec_tokens"], *batch["masks"])
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


def test_unequal_encoder_and_decoder_depths_are_one_line(mcore_t5, tmp_path, capsys):
    folder = mcore_t5[0]
    state = torch.load(get_checkpoint_name(str(folder / "mcore"), ITERATION), weights_only=False)
    state["args"].decoder_num_layers = LAYERS + 1
    out = get_checkpoint_name(str(tmp_path / "bad"), ITERATION)
    os.makedirs(os.path.dirname(out))
    torch.save(state, out)
    with open(get_checkpoint_tracker_filename(str(tmp_path / "bad")), "w") as f:
        f.write(str(ITERATION))
    with pytest.raises(SystemExit):
        convert.cli(["--model-type", "T5", "--loader", "mcore", "--saver", "megatron", "--load-dir",
                     str(tmp_path / "bad"), "--save-dir", str(tmp_path / "out")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "one layer count for both" in err[0], err


MCORE_LOAD_T5 = '''
import torch
patch_for_cpu()
from megatron.core.models.T5.t5_model import T5Model
from megatron.core.models.T5.t5_spec import get_t5_decoder_with_local_block_spec, get_t5_encoder_with_local_block_spec
from megatron.core.transformer.transformer_config import TransformerConfig
init_one_rank(1)
state = torch.load("@PATH@", weights_only=False)
args = state["args"]
config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                           num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                           hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=args.bias_gelu_fusion,
                           use_cpu_initialization=True)
model = T5Model(config, config, get_t5_encoder_with_local_block_spec(args.num_layers),
                get_t5_decoder_with_local_block_spec(args.num_layers), vocab_size=args.padded_vocab_size,
                max_sequence_length=args.max_position_embeddings,
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                position_embedding_type=args.position_embedding_type).eval()
model.load_state_dict(state["model"], strict=True)
batch = torch.load("@BATCH@")
with torch.no_grad():
    torch.save(model(batch["tokens"], batch["dec_tokens"], *batch["masks"]), "@OUT@")
'''


def test_our_t5_through_the_mcore_saver_loads_strictly_in_megatron_core(mcore_t5, tmp_path, capsys):
    """megatron-core's T5 -> ours (TP 2) -> --saver mcore (local names, with megatron-core's alias
    keys and extra state) -> megatron-core's T5Model.load_state_dict(strict) -> the first logits."""
    folder, batch, reference = mcore_t5
    convert.main(["--model-type", "T5", "--loader", "mcore", "--saver", "megatron", "--load-dir",
                  str(folder / "mcore"), "--save-dir", str(tmp_path / "ours"), "--target-tensor-parallel-size", "2"])
    convert.main(["--model-type", "T5", "--loader", "megatron", "--saver", "mcore", "--load-dir",
                  str(tmp_path / "ours"), "--save-dir", str(tmp_path / "mcore"), "--target-tensor-parallel-size",
                  "1", "--saver-transformer-impl", "local"])
    assert capsys.readouterr().out.count("-> OK") == 2
    snippet = (MCORE_LOAD_T5.replace("@PATH@", get_checkpoint_name(str(tmp_path / "mcore"), ITERATION))
               .replace("@BATCH@", str(folder / "batch.pt")).replace("@OUT@", str(tmp_path / "out.pt")))
    run_mcore(snippet)
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), reference, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- classic (legacy) T5

CLASSIC_LAYER = {"input_layernorm.": "input_norm.", "self_attention.linear_qkv.": "self_attention.query_key_value.",
                 "self_attention.linear_proj.": "self_attention.dense.", "pre_mlp_layernorm.": "post_attention_norm.",
                 "mlp.linear_fc1.": "mlp.dense_h_to_4h.", "mlp.linear_fc2.": "mlp.dense_4h_to_h."}
CLASSIC_DECODER_LAYER = {**CLASSIC_LAYER, "pre_cross_attn_layernorm.": "post_attention_norm.",
                         "pre_mlp_layernorm.": "post_inter_attention_norm.",
                         "cross_attention.linear_q.": "inter_attention.query.",
                         "cross_attention.linear_kv.": "inter_attention.key_value.",
                         "cross_attention.linear_proj.": "inter_attention.dense."}
CLASSIC_FLAGS = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
                 "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
                 "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", str(NULL_VOCAB), "--hidden-dropout", "0", "--attention-dropout", "0"]


def _classic_t5_entry(whole: dict, args, tp: int, rank: int) -> dict:
    """One TP rank's model entry, nested as Megatron-LM's legacy T5Model.state_dict_for_save_checkpoint."""
    from megatron.convert.layout_rules import tensor_layout
    from megatron.core.tensor_parallel.layout import shard_for_rank

    language_model: dict = {}
    entry: dict = {"language_model": language_model}
    for name, tensor in whole.items():
        shard = shard_for_rank(tensor, tensor_layout(name, args, tp, rank), tp, rank).clone()
        stack = name.split(".")[0]
        if name.startswith("embedding."):
            _, table, leaf = name.split(".")
            language_model.setdefault("embedding", {}).setdefault(table, {})[leaf] = shard
        elif ".layers." in name:
            _, _, index, rest = name.split(".", 3)
            table = CLASSIC_DECODER_LAYER if stack == "decoder" else CLASSIC_LAYER
            old = next(prefix for prefix in table if rest.startswith(prefix))
            language_model.setdefault(stack, {})[f"layers.{index}.{table[old]}{rest[len(old):]}"] = shard
        elif ".final_layernorm." in name:
            language_model.setdefault(stack, {})[f"final_norm.{name.rsplit('.', 1)[1]}"] = shard
        elif name == "lm_head.output_layer.bias":
            entry["lm_head"] = {"bias": shard}
        else:
            raise AssertionError(name)
    return entry


def test_classic_t5_tp2_converts_to_the_same_tensors_and_logits(tmp_path, capsys):
    import argparse

    from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
    from megatron.model.t5_model import T5Model

    args = parse_and_validate_args(argv=CLASSIC_FLAGS)
    args.padded_vocab_size, args.model_family = VOCAB, "T5"
    torch.manual_seed(31)
    model = T5Model(core_transformer_config_from_args(args), VOCAB, SEQ).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "norm" in key or key.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.3)
    whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    raw = argparse.Namespace(**vars(args))
    del raw.model_family
    raw.encoder_num_layers = raw.decoder_num_layers = LAYERS
    raw.tensor_model_parallel_size, raw.world_size, raw.use_legacy_models = 2, 2, True
    for rank in range(2):
        path = get_checkpoint_name(str(tmp_path / "classic"), ITERATION, pipeline_parallel=False, tensor_rank=rank)
        os.makedirs(os.path.dirname(path))
        torch.save({"args": raw, "iteration": ITERATION, "checkpoint_version": 3.0,
                    "model": _classic_t5_entry(whole, args, 2, rank)}, path)
    with open(get_checkpoint_tracker_filename(str(tmp_path / "classic")), "w") as f:
        f.write(str(ITERATION))
    convert.main(["--model-type", "T5", "--loader", "legacy", "--saver", "megatron", "--load-dir",
                  str(tmp_path / "classic"), "--save-dir", str(tmp_path / "ours"),
                  "--target-tensor-parallel-size", "1"])
    assert "-> OK" in capsys.readouterr().out
    target_args, tensors = saver_megatron.read_back(str(tmp_path / "ours"))
    tensors = dict(tensors)
    assert tensors.keys() == whole.keys() and all(torch.equal(tensors[k], whole[k]) for k in whole)
    result = verify.compare(model, verify.build_serial_model(target_args, tensors.items()), VOCAB, SEQ)
    assert result.ok, result.describe()
