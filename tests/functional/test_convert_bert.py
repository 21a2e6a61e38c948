"""tools/checkpoint/convert.py --model-type BERT with --loader hf / --saver hf on a tiny random
HF MegatronBertForPreTraining (pre-LN) and BertForPreTraining (the original post-LN BERT, which
becomes BertModel(post_layernorm=True), args.bert_post_layernorm), each written by save_pretrained.

HF -> ours at TP = 2, PP = 2 -> HF, each step verified by the converter (MLM and binary-head logits
with a padding mask): the result must be the source bit for bit. The TP = 2 PP = 2 checkpoint,
merged back by the megatron loader into a TP = 1 BertModel, gives HF's logits (fp32, 1e-5 at the
real positions), and its stage files hold the keys pretrain_bert.py's BertModel stages have.
The checkpoint also runs as it is in 4 gloo processes (each rank builds its stage as
pretrain_bert.py's model_provider does and loads its own file strictly) and gives HF's logits.
A swapped query/key head is refused by the verification; bad input is one line (a BertForMaskedLM
checkpoint among it). Every test runs for both HF classes.
"""

import json
import os

import pytest
import torch

from megatron.training.checkpointing import get_checkpoint_name
from megatron.training.checkpoint_safety import load_file
from megatron.convert import verify
from tests.helpers.saver_faults import break_hf_saver_rule, first_query_and_key_heads_swapped
from tests.parallel.harness import DistributedPool, init_parallel
from tools.checkpoint import convert, loader_megatron, saver_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, HIDDEN, HEADS, FFN, LAYERS, POSITIONS = 100, 32, 4, 48, 2, 32
pytestmark = pytest.mark.usefixtures("one_torch_thread")


KINDS = {"megatron-bert": ("MegatronBertConfig", "MegatronBertForPreTraining"),  # HF model_type -> classes
         "bert": ("BertConfig", "BertForPreTraining")}


def _save_hf(path, seed=0, kind="megatron-bert"):
    config_class, model_class = (getattr(transformers, name) for name in KINDS[kind])
    config = config_class(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, initializer_range=0.2)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0, so that a mix-up shows
        for name, param in model.named_parameters():
            if name.endswith(".bias") or ".ln." in name or "LayerNorm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    return model


def _convert(load_dir, save_dir, loader, saver, *extra, model_type="BERT"):
    convert.main(["--model-type", model_type, "--loader", loader, "--saver", saver, "--load-dir", str(load_dir),
                  "--save-dir", str(save_dir), *extra])


@pytest.fixture(scope="module", params=sorted(KINDS))
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = _save_hf(root / "hf", kind=request.param)
    _convert(root / "hf", root / "tp2pp2", "hf", "megatron", "--target-tensor-parallel-size", "2",
             "--target-pipeline-parallel-size", "2")
    _convert(root / "tp2pp2", root / "back", "megatron", "hf")
    return root, model


def test_hf_to_tp2pp2_to_hf_is_bit_identical(converted):
    root, _ = converted
    source = safetensors_torch.load_file(str(root / "hf" / "model.safetensors"))
    back = safetensors_torch.load_file(str(root / "back" / "model.safetensors"))
    assert sorted(back) == sorted(source)
    for name, tensor in source.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with open(root / "hf" / "config.json") as a, open(root / "back" / "config.json") as b:
        assert json.load(a) == json.load(b)
    model_class = type(converted[1])
    reloaded = model_class.from_pretrained(str(root / "back"), local_files_only=True)
    assert isinstance(reloaded, model_class)


def test_our_converted_model_gives_hfs_logits(converted):
    root, model = converted
    args = argparse_namespace(load_dir=str(root / "tp2pp2"))
    meta, tensors = loader_megatron.load_checkpoint(args)
    assert meta.args.model_family == "BERT" and meta.args.bert_binary_head
    assert meta.args.bert_post_layernorm == (model.config.model_type == "bert")
    assert (meta.args.tensor_model_parallel_size, meta.args.pipeline_model_parallel_size) == (2, 2)
    ours = verify.build_serial_model(meta.args, tensors)
    tokens = torch.randint(1, VOCAB, (3, 20), generator=torch.Generator().manual_seed(3))
    padding_mask = torch.ones_like(tokens)
    padding_mask[1, 13:] = padding_mask[2, 7:] = 0
    tokens = tokens * padding_mask
    types = (torch.arange(20) >= 5).long().expand(3, 20) * padding_mask
    with torch.no_grad():
        expected = model(input_ids=tokens, attention_mask=padding_mask, token_type_ids=types)
        lm_logits, binary_logits = ours(tokens, padding_mask, tokentype_ids=types)
    real = padding_mask.bool()  # a padding query sees no key in Megatron's mask, every real key in HF's
    assert expected.prediction_logits.abs().max() > 1.0  # logits large enough for the check to mean something
    torch.testing.assert_close(lm_logits[..., :VOCAB][real], expected.prediction_logits[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(binary_logits, expected.seq_relationship_logits, rtol=0, atol=1e-5)


def _inputs():
    """tokens, padding_mask (rows 1 and 2 end early), tokentypes [3, 20]."""
    tokens = torch.randint(1, VOCAB, (3, 20), generator=torch.Generator().manual_seed(3))
    padding_mask = torch.ones_like(tokens)
    padding_mask[1, 13:] = padding_mask[2, 7:] = 0
    types = (torch.arange(20) >= 5).long().expand(3, 20) * padding_mask
    return tokens * padding_mask, padding_mask, types


def _stage_outputs(checkpoint, tokens, padding_mask, types):
    """Task: this rank's stage of the TP=2 PP=2 checkpoint, built as pretrain_bert.py's model_provider
    builds it; the last stage returns (MLM logits gathered over TP, binary logits)."""
    import torch.distributed as dist

    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.core import parallel_state
    from megatron.model import BertModel

    init_parallel(tp=2, pp=2)
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    state = load_file(get_checkpoint_name(str(checkpoint), 0, release=True, pipeline_parallel=True,
                                          tensor_rank=tp_rank, pipeline_rank=pp_rank))
    args = state["args"]
    args.hidden_dropout = args.attention_dropout = 0.0
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    model = BertModel(core_transformer_config_from_args(args), vocab_size=args.padded_vocab_size,
                      max_sequence_length=args.max_position_embeddings,
                      num_tokentypes=2 if args.bert_binary_head else 0, add_binary_head=args.bert_binary_head,
                      share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                      pre_process=first, post_process=last, parallel_output=False,
                      post_layernorm=args.bert_post_layernorm)
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    with torch.no_grad():
        if first:
            hidden = model(tokens, padding_mask, tokentype_ids=types)  # [s, b, h]
            dist.send(hidden.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        received = torch.empty(tokens.shape[1], tokens.shape[0], args.hidden_size)  # [s, b, h]
        dist.recv(received, parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(received)
        return model(None, padding_mask)


def test_the_tp2pp2_checkpoint_runs_in_4_processes_with_hfs_logits(converted):
    root, model = converted
    tokens, padding_mask, types = _inputs()
    with torch.no_grad():
        expected = model(input_ids=tokens, attention_mask=padding_mask, token_type_ids=types)
    pool = DistributedPool(4)
    try:
        per_rank = pool.run(_stage_outputs, str(root / "tp2pp2"), tokens, padding_mask, types)
    finally:
        pool.close()
    last = [out for out in per_rank if out is not None]
    assert len(last) == 2  # the two TP ranks of the last stage
    real = padding_mask.bool()
    for lm_logits, binary_logits in last:
        torch.testing.assert_close(lm_logits[..., :VOCAB][real], expected.prediction_logits[real], rtol=0, atol=1e-5)
        assert torch.all(lm_logits[..., VOCAB:] == 0)  # padding rows: zero weights and zero bias
        torch.testing.assert_close(binary_logits, expected.seq_relationship_logits, rtol=0, atol=1e-5)


def test_stage_files_hold_pretrain_berts_stage_keys(converted):
    """Each TP = 2 PP = 2 file holds the keys of the BertModel stage pretrain_bert.py builds there."""
    from megatron.model import BertModel, TransformerConfig

    root, model = converted
    config = TransformerConfig(num_layers=LAYERS // 2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               ffn_hidden_size=FFN)
    post_ln = model.config.model_type == "bert"
    for stage, kind in ((0, dict(post_process=False)), (1, dict(pre_process=False))):
        expected = set(BertModel(config, 128, POSITIONS, post_layernorm=post_ln, **kind).state_dict())
        for rank in range(2):
            path = get_checkpoint_name(str(root / "tp2pp2"), 0, True, pipeline_parallel=True, tensor_rank=rank,
                                       pipeline_rank=stage)
            state = load_file(path)
            assert set(state["model"]) == expected, (stage, rank)
            assert state["args"].model_family == "BERT"
    last = load_file(get_checkpoint_name(str(root / "tp2pp2"), 0, True, pipeline_parallel=True, tensor_rank=1,
                                         pipeline_rank=1))["model"]
    assert last["output_layer.bias"].shape == (128,)  # the vocabulary padded to 256, over 2 ranks
    assert last["lm_head.dense.weight"].shape == (HIDDEN, HIDDEN)  # replicated


def test_a_swapped_query_and_key_is_refused(converted, tmp_path, monkeypatch, capsys):
    root, _ = converted
    break_hf_saver_rule(monkeypatch, saver_hf, "encoder.layers.1.self_attention.linear_qkv.weight",
                        first_query_and_key_heads_swapped(HIDDEN // HEADS))
    with pytest.raises(convert.ConversionError, match="logits differ"):
        _convert(root / "tp2pp2", tmp_path / "swapped", "megatron", "hf")
    assert "MISMATCH" in capsys.readouterr().out
    assert not (tmp_path / "swapped").exists()


def test_a_broken_post_ln_norm_is_refused(converted, tmp_path, monkeypatch, capsys):
    """BertForPreTraining: a saver whose mapping writes a post-LN norm (attention.output.LayerNorm of
    layer 0) with its hidden dimension reversed is caught by the verification."""
    root, model = converted
    if model.config.model_type != "bert":
        pytest.skip("MegatronBertForPreTraining has no post-LN norms")
    break_hf_saver_rule(monkeypatch, saver_hf, "encoder.layers.0.post_self_attn_layernorm.weight",
                        lambda rule: lambda tensor: (tensor.flip(0),))
    with pytest.raises(convert.ConversionError, match="logits differ"):
        _convert(root / "tp2pp2", tmp_path / "broken", "megatron", "hf")
    assert "MISMATCH" in capsys.readouterr().out
    assert not (tmp_path / "broken").exists()


def test_hf_to_tp1_to_hf_is_bit_identical(converted, tmp_path):
    root, _ = converted
    _convert(root / "hf", tmp_path / "tp1", "hf", "megatron")
    _convert(tmp_path / "tp1", tmp_path / "back", "megatron", "hf")
    source = safetensors_torch.load_file(str(root / "hf" / "model.safetensors"))
    back = safetensors_torch.load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(source) and all(torch.equal(back[k], t) for k, t in source.items())


def _one_line_error(argv, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        convert.cli(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("convert.py: error: ")
    return err


def test_bad_input_is_one_line(converted, tmp_path, capsys):
    root, _ = converted
    argv = ["--loader", "hf", "--saver", "megatron", "--save-dir", str(tmp_path / "out")]
    masked_lm = tmp_path / "masked_lm"  # BertForMaskedLM: no pooler, no binary head -- not our BertModel
    transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                            intermediate_size=FFN, architectures=["BertForMaskedLM"]).save_pretrained(masked_lm)
    error = _one_line_error(["--model-type", "BERT", *argv, "--load-dir", str(masked_lm)], capsys)
    assert "['BertForMaskedLM']: only BertForPreTraining maps onto our BertModel" in error
    error = _one_line_error(["--model-type", "GPT", *argv, "--load-dir", str(root / "hf")], capsys)
    assert "--model-type GPT: the checkpoint under" in error and "holds a BERT model" in error
    broken = tmp_path / "broken"
    _save_hf(broken, kind=converted[1].config.model_type)
    weights = safetensors_torch.load_file(str(broken / "model.safetensors"))
    del weights["cls.seq_relationship.weight"]
    safetensors_torch.save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    error = _one_line_error(["--model-type", "BERT", *argv, "--load-dir", str(broken)], capsys)
    assert "lack 1 tensor(s)" in error and "cls.seq_relationship.weight" in error
    assert not (tmp_path / "out").exists()


def argparse_namespace(**values):
    import argparse

    return argparse.Namespace(**{"true_vocab_size": None, "vocab_file": None, "tokenizer_model": None, **values})


def test_the_hf_config_built_from_our_args_is_the_sources(converted):
    """A BERT checkpoint without the HF config (one pretrain_bert.py wrote) gets the same model's config."""
    from megatron.convert import huggingface

    root, _ = converted
    meta, _ = loader_megatron.load_checkpoint(argparse_namespace(load_dir=str(root / "tp2pp2")))
    built = huggingface.hf_config_from_args(meta.args, VOCAB)
    with open(root / "hf" / "config.json") as f:
        source = json.load(f)
    assert {key: source[key] for key in built} == built
    assert not (root / "back" / "generation_config.json").exists()  # the source had none


def test_pretrain_gpt_load_hf_refuses_a_bert_model(converted):
    import argparse

    from megatron.training.checkpoint_safety import CheckpointError
    from megatron.training.load_hf import apply_hf_args

    root, model = converted
    with pytest.raises(CheckpointError, match=f"a {model.config.model_type} model is not a GPTModel"):
        apply_hf_args(argparse.Namespace(load_hf=str(root / "hf")), argv=[])
