"""The Llama-family flags (megatron/training/arguments.py, megatron/training/arguments_model.py): Megatron's names and
defaults, the rules validate_args applies to them, and what reaches TransformerConfig and GPTModel."""

import re

import pytest
import torch.nn.functional as F

from megatron.training.arguments import (
    ArgsError,
    core_transformer_config_from_args,
    gpt_model_kwargs,
    parse_and_validate_args,
    parse_args,
)
from megatron.model.utils import squared_relu

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings", "32",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def run(flags=""):
    return parse_and_validate_args(argv=[*BASE, *flags.split()])


def warnings(out):
    return [line for line in out.splitlines() if line.startswith("WARNING")]


def test_defaults_are_megatrons():
    args = parse_args(argv=BASE)
    expected = {"position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 1.0,
                "rotary_interleaved": False, "rotary_seq_len_interpolation_factor": None, "use_rope_scaling": False,
                "rope_scaling_factor": 8.0, "group_query_attention": False, "num_query_groups": 1, "swiglu": False,
                "squared_relu": False, "normalization": "LayerNorm", "norm_epsilon": 1e-5,
                "apply_layernorm_1p": False, "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
                "untie_embeddings_and_output_weights": False, "kv_channels": None, "ffn_hidden_size": None,
                "bias_swiglu_fusion": True, "apply_rope_fusion": True}
    assert {key: getattr(args, key) for key in expected} == expected


def test_a_gpt_run_gets_the_gpt_config():
    args = run()
    config = core_transformer_config_from_args(args)
    assert config.activation_func is F.gelu and not config.gated_linear_unit and config.bias_gelu_fusion
    assert config.num_query_groups == 4 and config.normalization == "LayerNorm"  # None -> one group per head
    assert gpt_model_kwargs(args) == {"position_embedding_type": "learned_absolute", "rotary_percent": 1.0,
                                      "rotary_base": 10000, "rope_scaling": False, "rope_scaling_factor": 8.0,
                                      "seq_len_interpolation_factor": None, "transformer_layer_spec": None}
    assert args.apply_rope_fusion is False  # as Megatron: no rope, no rope fusion


def test_llama_flags_reach_the_config_and_the_model(capsys):
    args = run("--use-rotary-position-embeddings --rotary-base 500000 --rotary-percent 0.5 --rotary-interleaved "
               "--rotary-seq-len-interpolation-factor 4 --use-rope-scaling --rope-scaling-factor 32 "
               "--group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --norm-epsilon 1e-6 "
               "--disable-bias-linear --add-qkv-bias --qk-layernorm --untie-embeddings-and-output-weights "
               "--no-bias-swiglu-fusion --no-rope-fusion --apply-layernorm-1p")
    assert warnings(capsys.readouterr().out) == []
    assert args.position_embedding_type == "rope"  # the legacy alias
    assert args.ffn_hidden_size == 128  # int(4 x 64 x 2/3 / 64) x 64
    config = core_transformer_config_from_args(args)
    assert config.activation_func is F.silu and config.gated_linear_unit and not config.bias_swiglu_fusion
    assert not config.bias_gelu_fusion  # no GeLU in the MLP
    assert (config.num_query_groups, config.normalization, config.layernorm_epsilon) == (2, "RMSNorm", 1e-6)
    assert config.add_bias_linear is False and config.add_qkv_bias and config.qk_layernorm
    assert config.layernorm_zero_centered_gamma and config.rotary_interleaved and not config.apply_rope_fusion
    assert gpt_model_kwargs(args) == {"position_embedding_type": "rope", "rotary_percent": 0.5,
                                      "rotary_base": 500000, "rope_scaling": True, "rope_scaling_factor": 32.0,
                                      "seq_len_interpolation_factor": 4, "transformer_layer_spec": None}


def test_swiglu_width_default_and_explicit():
    assert run("--swiglu --hidden-size 96").ffn_hidden_size == 256  # int(256 / 64) x 64
    assert run("--swiglu --ffn-hidden-size 100").ffn_hidden_size == 100
    assert run("--hidden-size 96").ffn_hidden_size == 384
    with pytest.raises(ArgsError, match=r"^--swiglu with --hidden-size 16: .* is 0; give --ffn-hidden-size"):
        run("--swiglu --hidden-size 16")


def test_squared_relu_is_relu_squared_without_the_gelu_fusion():
    config = core_transformer_config_from_args(run("--squared-relu"))
    assert config.activation_func is squared_relu and not config.gated_linear_unit and not config.bias_gelu_fusion
    import torch

    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0])
    assert torch.equal(squared_relu(x), torch.tensor([0.0, 0.0, 0.0, 0.25, 9.0]))


def test_mqa_with_fewer_groups_than_tensor_parallel_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = run("--group-query-attention --tensor-model-parallel-size 4")  # --num-query-groups 1: MQA
    assert core_transformer_config_from_args(args).num_query_groups == 1  # K/V replicated on the 4 ranks
    args = run("--group-query-attention --num-query-groups 8 --num-attention-heads 8 --tensor-model-parallel-size 4")
    assert core_transformer_config_from_args(args).num_query_groups == 8


def test_num_query_groups_without_gqa_is_ignored_with_a_warning(capsys):
    args = run("--num-query-groups 2")
    assert core_transformer_config_from_args(args).num_query_groups == 4
    assert warnings(capsys.readouterr().out) == [
        "WARNING: --num-query-groups 2 has no effect without --group-query-attention (one key/value head per "
        "attention head); ignored, as in Megatron-LM"]


def test_rotary_flags_without_rope_are_ignored_with_one_warning(capsys):
    args = run("--rotary-base 500000 --rotary-percent 0.5 --position-embedding-type alibi")
    assert gpt_model_kwargs(args)["position_embedding_type"] == "alibi"
    assert warnings(capsys.readouterr().out) == [
        "WARNING: --rotary-base, --rotary-percent have no effect with --position-embedding-type alibi (only rope "
        "reads them); ignored, as in Megatron-LM"]
    run("--position-embedding-type rope --rope-scaling-factor 16")
    assert warnings(capsys.readouterr().out) == [
        "WARNING: --rope-scaling-factor has no effect without --use-rope-scaling; ignored, as in Megatron-LM"]


@pytest.mark.parametrize("kind", ["rope", "alibi", "none"])
def test_only_the_learned_table_bounds_the_sequence(kind):
    args = run(f"--position-embedding-type {kind} --max-position-embeddings 8")
    assert args.seq_length == 32 and args.max_position_embeddings == 8
    with pytest.raises(ArgsError, match=r"--max-position-embeddings \(8\) must be >= --seq-length \(32\)"):
        run("--max-position-embeddings 8")


ROPE = "--position-embedding-type rope"
# (id, flags, environment WORLD_SIZE, the message starts with)
BAD = [
    ("relative", "--position-embedding-type relative", 1,
     "--position-embedding-type relative: T5-style relative attention biases"),
    ("mrope", "--position-embedding-type mrope", 1, "--position-embedding-type mrope: multimodal rotary embeddings"),
    ("percent-zero", f"{ROPE} --rotary-percent 0", 1, "--rotary-percent must be in (0, 1], got 0.0"),
    ("percent-above-one", f"{ROPE} --rotary-percent 1.5", 1, "--rotary-percent must be in (0, 1], got 1.5"),
    ("percent-odd", f"{ROPE} --rotary-percent 0.5625", 1,
     "--rotary-percent 0.5625 of --kv-channels 16 rotates int(16 x 0.5625) = 9 channels per head"),
    ("percent-none-left", f"{ROPE} --rotary-percent 0.05", 1,
     "--rotary-percent 0.05 of --kv-channels 16 rotates int(16 x 0.05) = 0 channels"),
    ("rotary-base", f"{ROPE} --rotary-base 0", 1, "--rotary-base must be > 0, got 0"),
    ("interpolation", f"{ROPE} --rotary-seq-len-interpolation-factor -2", 1,
     "--rotary-seq-len-interpolation-factor must be > 0"),
    ("rope-scaling-without-rope", "--use-rope-scaling", 1,
     "--use-rope-scaling needs --position-embedding-type rope (got learned_absolute)"),
    ("two-activations", "--swiglu --squared-relu", 1, "--swiglu and --squared-relu each choose the MLP activation"),
    ("openai-gelu-swiglu", "--swiglu --openai-gelu", 1, "--swiglu and --openai-gelu each choose"),
    ("groups-split-heads", "--group-query-attention --num-query-groups 3", 1,
     "--num-attention-heads (4) must be divisible by --num-query-groups (3)"),
    ("groups-zero", "--group-query-attention --num-query-groups 0", 1, "--num-query-groups must be >= 1, got 0"),
    ("groups-and-tp", "--group-query-attention --num-query-groups 6 --num-attention-heads 12 --hidden-size 96 "
     "--tensor-model-parallel-size 4", 4,
     "--num-query-groups (6) and --tensor-model-parallel-size (4): one must divide the other"),
    ("heads-and-tp", "--num-attention-heads 6 --hidden-size 96 --tensor-model-parallel-size 4", 4,
     "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)"),
]


@pytest.mark.parametrize("flags, world, message", [row[1:] for row in BAD], ids=[row[0] for row in BAD])
def test_bad_architecture_names_the_flags(monkeypatch, flags, world, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ArgsError) as error:
        run(flags)
    assert str(error.value).startswith(message), str(error.value)


def test_qkv_bias_without_the_other_biases_is_qwen2s_layout():
    config = core_transformer_config_from_args(run("--disable-bias-linear --add-qkv-bias"))
    assert config.add_bias_linear is False and config.add_qkv_bias is True


def test_unknown_position_embedding_type_is_argparses_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(argv=[*BASE, "--position-embedding-type", "sinusoidal"])
    assert re.search(r"invalid choice: 'sinusoidal'", capsys.readouterr().err)


# ----------------------------------------------------------------------------- T5 (pretrain_t5.py)

T5 = "--decoder-seq-length 16 --vocab-extra-ids 100"


def run_t5(flags=""):
    """validate_args as pretrain_t5.py calls it (its args_defaults carry model_family "T5")."""
    from pretrain_t5 import T5_ARGS_DEFAULTS

    from pretrain_t5 import add_t5_args

    defaults = {**T5_ARGS_DEFAULTS, "tokenizer_type": "NullTokenizer"}  # BASE's tokenizer, no warning
    return parse_and_validate_args(add_t5_args, argv=[*BASE, *flags.split()], args_defaults=defaults)


def test_t5_takes_relative_positions_and_its_flags_without_warnings(capsys):
    args = run_t5(f"{T5} --position-embedding-type relative --relative-attention-num-buckets 16 --mask-prob 0.2 "
                  "--short-seq-prob 0.05 --relative-attention-max-distance 64")
    assert (args.model_family, args.position_embedding_type, args.decoder_seq_length) == ("T5", "relative", 16)
    assert (args.relative_attention_num_buckets, args.relative_attention_max_distance, args.mask_prob) == (16, 64, 0.2)
    assert warnings(capsys.readouterr().out) == []
    assert run_t5(f"{T5} --encoder-seq-length 24 --seq-length 24").seq_length == 24


def test_gpt_still_refuses_relative_and_warns_on_the_t5_flags(capsys):
    with pytest.raises(ArgsError, match="--position-embedding-type relative: T5-style"):
        run("--position-embedding-type relative")
    run("--decoder-seq-length 16")
    assert any("--decoder-seq-length" in line for line in warnings(capsys.readouterr().out))


@pytest.mark.parametrize("flags, message", [
    ("--vocab-extra-ids 100", r"T5 needs --decoder-seq-length >= 2"),
    ("--decoder-seq-length 16", r"give --vocab-extra-ids \(e.g. 100"),
    (f"{T5} --decoder-seq-length 64", r"--max-position-embeddings \(32\) must be >= --decoder-seq-length \(64\)"),
    (f"{T5} --position-embedding-type rope", "T5 takes learned_absolute .* or relative"),
    (f"{T5} --position-embedding-type relative --relative-attention-num-buckets 0",
     "--relative-attention-num-buckets must be >= 1"),
    (f"{T5} --decoder-num-layers 3", "--decoder-num-layers 3 with --num-layers 2: .* not supported yet"),
    ("--decoder-seq-length 16 --vocab-extra-ids 3", r"--vocab-extra-ids 3: .* can have 4 masked spans"),
    ("--decoder-seq-length 5 --vocab-extra-ids 100", r"--decoder-seq-length 5 is too short: .* give >= 6 "
                                                     r"\(1 \+ 2 x 4 = 9 always fits"),
    (f"{T5} --mask-prob 1.5", r"--mask-prob must be in \(0, 1\), got 1.5"),
    (f"{T5} --mean-noise-span-length 0.5", r"--mean-noise-span-length must be >= 1 .* got 0.5"),
], ids=["no-decoder-length", "no-sentinels", "short-position-table", "rope", "buckets", "decoder-layers",
        "few-sentinels", "short-decoder", "mask-prob", "mean-span"])
def test_t5_errors(flags, message):
    with pytest.raises(ArgsError, match=message):
        run_t5(flags)


def test_t5_pipeline_needs_the_split_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ArgsError, match="T5 with --pipeline-model-parallel-size 2 needs "
                                        "--pipeline-model-parallel-split-rank S"):
        run_t5(f"{T5} --pipeline-model-parallel-size 2")
    assert run_t5(f"{T5} --pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 1") \
        .pipeline_model_parallel_split_rank == 1


# ----------------------------------------------------------------------------- BERT (pretrain_bert.py)

def run_bert(flags: str, data: bool = True):
    """validate_args as pretrain_bert.py calls it (its args_defaults carry model_family "BERT"),
    on a --data-path x that exists (empty files: validation only checks that they are there)."""
    base = [word for word in BASE if word != "--mock-data"] + (["--data-path", "x"] if data else ["--mock-data"])
    defaults = {"model_family": "BERT", "tokenizer_type": "NullTokenizer"}
    return parse_and_validate_args(argv=[*base, *flags.split()], args_defaults=defaults)


@pytest.mark.parametrize("flags, data, message", [
    ("--mask-prob 0", True, r"--mask-prob must be in \(0, 1\), got 0.0"),
    ("--short-seq-prob 1.5", True, r"--short-seq-prob must be in \[0, 1\], got 1.5"),
    ("", False, r"--mock-data: the BERT dataset has no mock data; give --data-path"),
], ids=["mask-prob", "short-seq-prob", "mock-data"])
def test_bert_errors_before_any_data_is_read(flags, data, message, monkeypatch, tmp_path):
    for suffix in ("bin", "idx"):
        (tmp_path / f"x.{suffix}").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArgsError, match=message):
        run_bert(flags, data)
    run_bert("--mask-prob 0.2 --short-seq-prob 0")  # in range: accepted


# ---------------------------------------------------------------- the older spellings of Accelerate's guide

def _validated(**attrs):
    """args as Accelerate sets them: parsed, then attributes set (other_megatron_args), then validated."""
    from megatron.training.arguments import validate_args

    args = parse_args(argv=BASE)
    for key, value in attrs.items():
        setattr(args, key, value)
    return validate_args(args)


@pytest.mark.parametrize("given, kind", [("rotary", "rope"), ("absolute", "learned_absolute"), ("alibi", "alibi")])
def test_the_guides_position_embedding_spellings(given, kind):
    assert _validated(position_embedding_type=given).position_embedding_type == kind
    assert gpt_model_kwargs(_validated(position_embedding_type=given))["position_embedding_type"] == kind


def test_attention_head_type_multiquery_is_one_query_group():
    args = _validated(attention_head_type="multiquery")
    assert args.group_query_attention and args.num_query_groups == 1
    assert core_transformer_config_from_args(args).num_query_groups == 1
    multihead = _validated(attention_head_type="multihead")
    assert not multihead.group_query_attention and core_transformer_config_from_args(multihead).num_query_groups == 4
    assert run("--attention-head-type multiquery").num_query_groups == 1  # also a flag


@pytest.mark.parametrize("attrs, message", [
    (dict(attention_head_type="grouped"), "--attention-head-type grouped: use multihead or multiquery"),
    (dict(attention_head_type="multiquery", group_query_attention=True, num_query_groups=2),
     "--attention-head-type multiquery is one query group; --num-query-groups 2 asks for more"),
    (dict(attention_head_type="multihead", group_query_attention=True), "contradicts --group-query-attention"),
])
def test_attention_head_type_errors(attrs, message):
    with pytest.raises(ArgsError, match=re.escape(message)):
        _validated(**attrs)
