"""tools/checkpoint/convert.py --model-type T5 with --loader hf / --saver hf on a tiny random HF
T5ForConditionalGeneration (written by save_pretrained).

HF -> ours at TP = 1 -> ours at TP = 2 -> HF, each step verified by the converter (the decoder's
logits over a padded encoder input): the result must be the source bit for bit, config included.
The TP = 2 checkpoint, merged back by the megatron loader into a TP = 1 T5Model, gives HF's logits
(fp32, 1e-5); it also runs as it is at TP = 2 in gloo processes (each rank builds T5Model from the
saved args and loads its own file strictly; 2 data-parallel replicas) with HF's logits. A swapped
query/key head is refused by the verification; what is not mapped (a missing tensor, an untied
head, num_decoder_layers != num_layers, another activation, relative positions over more than 2
pipeline stages, a non-zero output bias) is one line.

Pipeline stages (the split rank in the args): HF -> TP 1 x PP 2 -> HF and HF -> TP 2 x PP 2 -> TP 1
x PP 1 -> HF are bit-identical; the TP 2 x PP 2 files are each a T5Model stage's state dict (4 gloo
processes, strict loads) whose pipeline loss is HF's. Megatron's own T5 (learned positions, made
here from the same weights) goes to PP 4 split at 2 (the embedding copied to the first decoder
stage, the tied LM head to the last) and back bit for bit, and its PP 4 files give the serial loss.
"""

import argparse
import dataclasses
import json

import pytest
import torch

from megatron.training.checkpoint_safety import CheckpointError, load_file
from megatron.training.checkpointing import get_checkpoint_name
from megatron.convert import huggingface, megatron_format, t5, verify
from tests.helpers.saver_faults import break_hf_saver_rule, first_query_and_key_heads_swapped
from tests.parallel.harness import DistributedPool, init_parallel
from tools.checkpoint import convert, loader_megatron, saver_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, D_MODEL, HEADS, D_KV, D_FF, LAYERS = 100, 32, 4, 12, 48, 2
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hf_config(**overrides):
    fields = dict(vocab_size=VOCAB, d_model=D_MODEL, d_kv=D_KV, d_ff=D_FF, num_layers=LAYERS, num_heads=HEADS,
                  relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                  feed_forward_proj="relu", decoder_start_token_id=0)
    return transformers.T5Config(**{**fields, **overrides})


def _save_hf(path, seed=0, **overrides):
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(_hf_config(**overrides)).eval()
    with torch.no_grad():  # norms away from 1, so that a mix-up between them shows
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    return model


def _convert(load_dir, save_dir, loader, saver, *extra, model_type="T5"):
    convert.main(["--model-type", model_type, "--loader", loader, "--saver", saver, "--load-dir", str(load_dir),
                  "--save-dir", str(save_dir), *extra])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    model = _save_hf(root / "hf")
    _convert(root / "hf", root / "tp1", "hf", "megatron")
    _convert(root / "tp1", root / "tp2", "megatron", "megatron", "--target-tensor-parallel-size", "2")
    _convert(root / "tp2", root / "back", "megatron", "hf")
    return root, model


@pytest.fixture(scope="module")
def pool4():
    """4 gloo processes for the module: TP 2 x DP 2, TP 2 x PP 2, PP 4."""
    pool = DistributedPool(4)
    yield pool
    pool.close()


def _inputs():
    """encoder tokens [3, 20] (rows 1 and 2 padded after 13 and 7), its padding mask, decoder tokens [3, 9]."""
    g = torch.Generator().manual_seed(3)
    encoder = torch.randint(1, VOCAB, (3, 20), generator=g)
    padding = torch.ones_like(encoder)
    padding[1, 13:] = padding[2, 7:] = 0
    return encoder * padding, padding, torch.randint(1, VOCAB, (3, 9), generator=g)


def _hf_logits(model):
    encoder, padding, decoder = _inputs()
    with torch.no_grad():
        logits = model(input_ids=encoder, attention_mask=padding, decoder_input_ids=decoder).logits
    assert logits.abs().max() > 1.0  # large enough for the check to mean something
    return logits


def _our_logits(model):
    from megatron.model.t5_model import t5_attention_masks

    encoder, padding, decoder = _inputs()
    with torch.no_grad():
        return model(encoder, decoder, *t5_attention_masks(padding, torch.ones_like(decoder)))


def _assert_same_hf(source_dir, back_dir):
    source = safetensors_torch.load_file(str(source_dir / "model.safetensors"))
    back = safetensors_torch.load_file(str(back_dir / "model.safetensors"))
    assert sorted(back) == sorted(source)
    for name, tensor in source.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    for file in ("config.json", "generation_config.json"):
        with open(source_dir / file) as a, open(back_dir / file) as b:
            assert json.load(a) == json.load(b), file


def test_hf_to_tp1_to_tp2_to_hf_is_bit_identical(converted):
    root, _ = converted
    _assert_same_hf(root / "hf", root / "back")
    reloaded = transformers.T5ForConditionalGeneration.from_pretrained(str(root / "back"), local_files_only=True)
    assert reloaded.config.feed_forward_proj == "relu" and reloaded.config.scale_decoder_outputs


def _namespace(**values):
    return argparse.Namespace(**{"true_vocab_size": None, "vocab_file": None, "tokenizer_model": None, **values})


def test_the_checkpoint_args_carry_the_t5_choices(converted):
    root, _ = converted
    meta, _ = loader_megatron.load_checkpoint(_namespace(load_dir=str(root / "tp2")))
    args = meta.args
    assert args.model_family == "T5" and args.tensor_model_parallel_size == 2
    assert (args.position_embedding_type, args.relative_attention_num_buckets,
            args.relative_attention_max_distance) == ("relative", 8, 16)
    assert (args.normalization, args.add_bias_linear, args.kv_channels, args.ffn_hidden_size) == \
        ("RMSNorm", False, D_KV, D_FF)
    assert (args.t5_activation, args.t5_gated_linear_unit, args.t5_attention_scale) == ("relu", False, 1.0)
    assert args.t5_output_hidden_scale == D_MODEL ** -0.5 and not args.untie_embeddings_and_output_weights
    shard = load_file(get_checkpoint_name(str(root / "tp2"), 0, True, tensor_rank=1))["model"]
    assert shard["decoder.layers.1.cross_attention.linear_kv.weight"].shape == (HEADS // 2 * 2 * D_KV, D_MODEL)
    assert shard["decoder.layers.1.cross_attention.linear_proj.weight"].shape == (D_MODEL, HEADS // 2 * D_KV)
    assert shard["lm_head.output_layer.bias"].shape == (128,)  # the vocabulary padded to 256, over 2 ranks
    assert shard["encoder_relative_pos_emb.relative_attention_bias.weight"].shape == (8, HEADS)  # replicated


def test_our_converted_model_gives_hfs_logits(converted):
    root, model = converted
    meta, tensors = loader_megatron.load_checkpoint(_namespace(load_dir=str(root / "tp2")))
    ours = verify.build_serial_model(meta.args, tensors)
    logits = _our_logits(ours)
    torch.testing.assert_close(logits[..., :VOCAB], _hf_logits(model), rtol=0, atol=1e-5)
    assert torch.all(logits[..., VOCAB:] == 0)  # padding rows: zero weights and zero bias


def _rank_logits(checkpoint, inputs):
    """Task: this rank's T5Model of the TP = 2 checkpoint, built from its saved args; the gathered logits."""
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.core import parallel_state, tensor_parallel
    from megatron.model.t5_model import T5Model, t5_attention_masks

    init_parallel(tp=2)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # the attention's dropout context (dropout is 0)
    rank = parallel_state.get_tensor_model_parallel_rank()
    state = load_file(get_checkpoint_name(str(checkpoint), 0, release=True, tensor_rank=rank))
    args = state["args"]
    config = dataclasses.replace(core_transformer_config_from_args(args), hidden_dropout=0.0, attention_dropout=0.0,
                                 **t5.t5_transformer_config_kwargs(args))
    model = T5Model(config, vocab_size=args.padded_vocab_size, parallel_output=False, **t5.t5_model_kwargs(args))
    model.load_state_dict(state["model"], strict=True)
    encoder, padding, decoder = inputs
    with torch.no_grad():
        return model.eval()(encoder, decoder, *t5_attention_masks(padding, torch.ones_like(decoder)))


def test_the_tp2_checkpoint_runs_tensor_parallel_with_hfs_logits(converted, pool4):
    root, model = converted
    expected = _hf_logits(model)
    per_rank = pool4.run(_rank_logits, str(root / "tp2"), _inputs())  # 2 data-parallel replicas of TP = 2
    for logits in per_rank:
        torch.testing.assert_close(logits[..., :VOCAB], expected, rtol=0, atol=1e-5)


def test_a_swapped_query_and_key_is_refused(converted, tmp_path, monkeypatch, capsys):
    root, _ = converted
    break_hf_saver_rule(monkeypatch, saver_hf, "decoder.layers.1.self_attention.linear_qkv.weight",
                        first_query_and_key_heads_swapped(D_KV))
    with pytest.raises(convert.ConversionError, match="logits differ"):
        _convert(root / "tp2", tmp_path / "swapped", "megatron", "hf")
    assert "MISMATCH" in capsys.readouterr().out
    assert not (tmp_path / "swapped").exists()


def _one_line_error(argv, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        convert.cli(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("convert.py: error: ")
    return err


def _edited_copy(source, target, edit):
    """source's HF folder at target with its weights edited by edit(dict of tensors)."""
    target.mkdir()
    for file in ("config.json", "generation_config.json"):
        (target / file).write_text((source / file).read_text())
    weights = safetensors_torch.load_file(str(source / "model.safetensors"))
    edit(weights)
    safetensors_torch.save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})


def test_what_is_not_mapped_is_one_line(converted, tmp_path, capsys):
    root, _ = converted
    out = tmp_path / "out"
    argv = ["--model-type", "T5", "--loader", "hf", "--saver", "megatron", "--save-dir", str(out)]
    missing = "decoder.block.1.layer.1.EncDecAttention.k.weight"
    _edited_copy(root / "hf", tmp_path / "missing", lambda w: w.pop(missing))
    error = _one_line_error([*argv, "--load-dir", str(tmp_path / "missing")], capsys)
    assert "lack 1 tensor(s)" in error and missing in error
    _edited_copy(root / "hf", tmp_path / "untied", lambda w: w.update({"lm_head.weight": torch.randn(VOCAB, D_MODEL)}))
    error = _one_line_error([*argv, "--load-dir", str(tmp_path / "untied")], capsys)
    assert "an untied T5 head (T5 v1.1 / flan-t5" in error
    _hf_config(num_decoder_layers=3).save_pretrained(tmp_path / "deeper")
    error = _one_line_error([*argv, "--load-dir", str(tmp_path / "deeper")], capsys)
    assert "num_decoder_layers 3 != num_layers 2" in error
    _hf_config(feed_forward_proj="gated-silu").save_pretrained(tmp_path / "silu")
    error = _one_line_error([*argv, "--load-dir", str(tmp_path / "silu")], capsys)
    assert "feed_forward_proj 'gated-silu'" in error and "cannot be converted to T5Model" in error
    error = _one_line_error([*argv, "--load-dir", str(root / "hf"), "--target-pipeline-parallel-size", "4",
                             "--target-pipeline-model-parallel-split-rank", "3"], capsys)
    assert "--target-pipeline-parallel-size 4 --target-pipeline-model-parallel-split-rank 3" in error
    assert "the encoder's 2 layers do not split over its 3 pipeline stages" in error
    error = _one_line_error([*argv, "--load-dir", str(root / "hf"), "--target-pipeline-parallel-size", "2",
                             "--target-pipeline-model-parallel-split-rank", "2"], capsys)
    assert "the split rank (2) must be in [1, 1]" in error
    error = _one_line_error(["--model-type", "GPT", *argv[2:], "--load-dir", str(root / "hf")], capsys)
    assert "holds a T5 model" in error
    assert not out.exists()


def test_a_gpt_folder_is_not_a_t5(tmp_path, capsys):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    error = _one_line_error(["--model-type", "T5", "--loader", "hf", "--saver", "megatron", "--load-dir",
                             str(tmp_path / "gpt2"), "--save-dir", str(tmp_path / "out")], capsys)
    assert "--model-type T5: the checkpoint under" in error and "holds a GPT model" in error


def test_a_nonzero_output_bias_has_no_hf_counterpart(converted):
    root, model = converted
    ours = huggingface.state_dict_from_hf(model.state_dict(), model.config)
    assert huggingface.state_dict_to_hf(ours, model.config).keys() >= {"shared.weight"}
    ours[t5.OUTPUT_BIAS] = ours[t5.OUTPUT_BIAS] + 0.5
    with pytest.raises(CheckpointError, match="has no T5ForConditionalGeneration counterpart"):
        huggingface.state_dict_to_hf(ours, model.config)


def test_the_hf_config_built_from_our_args_is_the_sources(converted):
    """A T5 checkpoint without the HF config (one our training wrote) gets the same model's config;
    Megatron's own T5 (learned positions, GeLU MLP from our flags) has none."""
    root, _ = converted
    meta, _ = loader_megatron.load_checkpoint(_namespace(load_dir=str(root / "tp2")))
    built = huggingface.hf_config_from_args(meta.args, VOCAB)
    source = json.loads((root / "hf" / "config.json").read_text())
    assert {key: source[key] for key in built} == built
    megatron_t5 = argparse.Namespace(**vars(meta.args))
    megatron_t5.position_embedding_type = "learned_absolute"
    with pytest.raises(ValueError, match="--position-embedding-type learned_absolute"):
        huggingface.hf_config_from_args(megatron_t5, VOCAB)
    del megatron_t5.t5_activation
    megatron_t5.position_embedding_type = "relative"
    with pytest.raises(ValueError, match="Megatron's T5 MLP"):
        huggingface.hf_config_from_args(megatron_t5, VOCAB)


def test_pretrain_gpt_load_hf_refuses_a_t5_model(converted):
    from megatron.training.load_hf import apply_hf_args

    root, _ = converted
    with pytest.raises(CheckpointError, match="a t5 model is not a GPTModel; convert it with .* --model-type T5"):
        apply_hf_args(argparse.Namespace(load_hf=str(root / "hf")), argv=[])


# ------------------------------------------------------------------------------ pipeline stages


@pytest.fixture(scope="module")
def pipelined(converted):
    """HF -> TP 1 x PP 2 -> HF, and HF -> TP 2 x PP 2 -> TP 1 x PP 1 -> HF (each step verified)."""
    root, model = converted
    pp = ["--target-pipeline-parallel-size", "2"]
    _convert(root / "hf", root / "pp2", "hf", "megatron", *pp)  # the split rank by default: 1
    _convert(root / "pp2", root / "pp2-back", "megatron", "hf")
    _convert(root / "hf", root / "tp2pp2", "hf", "megatron", *pp, "--target-tensor-parallel-size", "2")
    _convert(root / "tp2pp2", root / "tp1pp1", "megatron", "megatron", "--target-tensor-parallel-size", "1",
             "--target-pipeline-parallel-size", "1")
    _convert(root / "tp1pp1", root / "tp1pp1-back", "megatron", "hf")
    _convert(root / "hf", root / "pp4", "hf", "megatron", "--target-pipeline-parallel-size", "4")  # split 2
    _convert(root / "pp4", root / "pp4-back", "megatron", "hf")
    return root, model


@pytest.mark.parametrize("back", ["pp2-back", "tp1pp1-back", "pp4-back"])
def test_hf_through_pipeline_stages_is_bit_identical(pipelined, back):
    root, _ = pipelined
    _assert_same_hf(root / "hf", root / back)


def test_the_split_rank_travels_in_the_args(pipelined):
    root, _ = pipelined
    for name, sizes in (("pp2", (1, 2, 1)), ("tp2pp2", (2, 2, 1)), ("tp1pp1", (1, 1, None))):
        args = loader_megatron.load_checkpoint(_namespace(load_dir=str(root / name)))[0].args
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                args.pipeline_model_parallel_split_rank) == sizes, name


def _labels():
    return torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(5))


def _stage_loss(checkpoint):
    """Task: this rank's T5Model stage of the checkpoint, built from its file's args (split rank
    included) and loaded strictly; the pipeline's mean loss on the last stage (else [])."""
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules
    from megatron.model.t5_model import T5Model, t5_attention_masks
    from megatron.training.training import _stage_roles

    args = load_file(get_checkpoint_name(checkpoint, 0, release=True, pipeline_parallel=True))["args"]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                             pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                             pipeline_model_parallel_split_rank=args.pipeline_model_parallel_split_rank)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    state = load_file(get_checkpoint_name(checkpoint, 0, release=True, pipeline_parallel=True,
                                          tensor_rank=parallel_state.get_tensor_model_parallel_rank(),
                                          pipeline_rank=parallel_state.get_pipeline_model_parallel_rank()))
    config = dataclasses.replace(core_transformer_config_from_args(state["args"]), hidden_dropout=0.0,
                                 attention_dropout=0.0, **t5.t5_transformer_config_kwargs(args))
    model = T5Model(config, vocab_size=args.padded_vocab_size, **t5.t5_model_kwargs(args),
                    **_stage_roles(ModelType.encoder_and_decoder))
    model.load_state_dict(state["model"], strict=True)  # the file holds exactly this stage's keys
    encoder, padding, decoder = _inputs()
    batch = (encoder, decoder, _labels(), t5_attention_masks(padding, torch.ones_like(decoder)))

    def forward_step(data_iterator, model):
        enc, dec, labels, masks = next(data_iterator)
        return model(enc, dec, *masks, lm_labels=labels), lambda losses: (losses.mean(), {"lm loss": losses.mean()})

    losses = schedules.get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([batch]), model=[model.eval()], num_microbatches=1,
        seq_length=encoder.shape[1], decoder_seq_length=decoder.shape[1], micro_batch_size=encoder.shape[0],
        forward_only=True)
    return [entry["lm loss"].item() for entry in losses]


def test_the_tp2_pp2_files_are_t5_stages_with_hfs_loss(pipelined, pool4):
    root, model = pipelined
    shard = load_file(get_checkpoint_name(str(root / "tp2pp2"), 0, True, pipeline_parallel=True, tensor_rank=1,
                                          pipeline_rank=1))["model"]
    assert "lm_head.output_layer.weight" not in shard  # the split stage is the last: the head is its embedding
    logits = _hf_logits(model)  # our padding rows give logit 0: HF's loss over the padded vocabulary
    padded = torch.cat([logits, logits.new_zeros(*logits.shape[:-1], 256 - VOCAB)], dim=-1)
    expected = torch.nn.functional.cross_entropy(padded.flatten(0, 1), _labels().flatten()).item()
    losses = pool4.run(_stage_loss, str(root / "tp2pp2"))
    assert losses[0] == losses[1] == []  # ranks 0, 1: stage 0 (TP ranks 0, 1); ranks 2, 3: the last stage
    for loss in losses[2:]:
        assert loss == pytest.approx([expected], abs=1e-5)


def test_the_pp4_files_keep_each_stacks_table_on_its_stages_with_hfs_loss(pipelined, pool4):
    """HF's relative position tables at PP 4, split 2: each stack's table on both of its stages (the
    later stage's a copy), and the 4-stage pipeline gives HF's loss."""
    root, model = pipelined
    stages = [load_file(get_checkpoint_name(str(root / "pp4"), 0, True, pipeline_parallel=True,
                                            pipeline_rank=p))["model"] for p in range(4)]
    for stack, held in (("encoder", (0, 1)), ("decoder", (2, 3))):
        name = f"{stack}_relative_pos_emb.relative_attention_bias.weight"
        assert [name in stage for stage in stages] == [p in held for p in range(4)], stack
        assert torch.equal(stages[held[0]][name], stages[held[1]][name])
    logits = _hf_logits(model)
    padded = torch.cat([logits, logits.new_zeros(*logits.shape[:-1], 128 - VOCAB)], dim=-1)
    expected = torch.nn.functional.cross_entropy(padded.flatten(0, 1), _labels().flatten()).item()
    losses = pool4.run(_stage_loss, str(root / "pp4"))
    assert losses[:3] == [[], [], []]
    assert losses[3] == pytest.approx([expected], abs=1e-5)


@pytest.fixture(scope="module")
def learned(converted, tmp_path_factory):
    """Megatron's own T5 (learned positions, no HF config) at PP 1 from the converted weights and a
    random position table, converted to PP 4 (the split rank by default: 2) and back."""
    root, _ = converted
    meta, tensors = loader_megatron.load_checkpoint(_namespace(load_dir=str(root / "tp1")))
    args = argparse.Namespace(**vars(meta.args))
    args.position_embedding_type = "learned_absolute"
    del args.hf_config
    state = {}
    for name, tensor in tensors:
        if "_relative_pos_emb." not in name:
            state[name] = tensor
        if name == "embedding.word_embeddings.weight":
            state["embedding.position_embeddings.weight"] = torch.randn(args.max_position_embeddings, D_MODEL)
    out = tmp_path_factory.mktemp("learned")
    megatron_format.write_tensors(str(out / "pp1"), megatron_format.Metadata(args, 0, True, VOCAB),
                                  iter(state.items()), tp=1, pp=1)
    _convert(out / "pp1", out / "pp4", "megatron", "megatron", "--target-pipeline-parallel-size", "4")
    _convert(out / "pp4", out / "pp1-back", "megatron", "megatron", "--target-pipeline-parallel-size", "1")
    return out


def test_learned_positions_go_to_4_stages_and_back(learned):
    source = load_file(get_checkpoint_name(str(learned / "pp1"), 0, True))["model"]
    back = load_file(get_checkpoint_name(str(learned / "pp1-back"), 0, True))
    assert back["args"].pipeline_model_parallel_split_rank is None
    assert sorted(back["model"]) == sorted(source)
    assert all(torch.equal(back["model"][name], tensor) for name, tensor in source.items())
    stages = [load_file(get_checkpoint_name(str(learned / "pp4"), 0, True, pipeline_parallel=True,
                                            pipeline_rank=p)) for p in range(4)]
    assert {s["args"].pipeline_model_parallel_split_rank for s in stages} == {2}
    keys = [set(s["model"]) for s in stages]
    embeddings = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight"}
    assert embeddings <= keys[0] and embeddings <= keys[2] and not embeddings & (keys[1] | keys[3])
    assert {k for k in keys[1] if "layers" not in k} == {"encoder.final_layernorm.weight"}
    assert {k for k in keys[3] if "layers" not in k} == {"decoder.final_layernorm.weight",
                                                         "lm_head.output_layer.weight", "lm_head.output_layer.bias"}
    for stage in (0, 1):  # one layer per stage, numbered locally
        assert {k.split(".")[2] for k in keys[stage] if k.startswith("encoder.layers.")} == {"0"}
    assert torch.equal(stages[1]["model"]["encoder.layers.0.mlp.linear_fc1.weight"],
                       source["encoder.layers.1.mlp.linear_fc1.weight"])
    assert torch.equal(stages[3]["model"]["decoder.layers.0.cross_attention.linear_q.weight"],
                       source["decoder.layers.1.cross_attention.linear_q.weight"])
    for stage, name, copy in ((2, "embedding.position_embeddings.weight", "embedding.position_embeddings.weight"),
                              (3, "lm_head.output_layer.weight", "embedding.word_embeddings.weight")):
        assert torch.equal(stages[stage]["model"][name], source[copy]), (stage, name)


def test_the_pp4_files_give_the_serial_loss(learned, pool4):
    from megatron.model.t5_model import t5_attention_masks

    meta, tensors = loader_megatron.load_checkpoint(_namespace(load_dir=str(learned / "pp1")))
    serial = verify.build_serial_model(meta.args, tensors)
    encoder, padding, decoder = _inputs()
    with torch.no_grad():
        expected = serial(encoder, decoder, *t5_attention_masks(padding, torch.ones_like(decoder)),
                          lm_labels=_labels()).mean().item()
    losses = pool4.run(_stage_loss, str(learned / "pp4"))
    assert losses[:3] == [[], [], []]
    assert losses[3] == pytest.approx([expected], abs=1e-5)
