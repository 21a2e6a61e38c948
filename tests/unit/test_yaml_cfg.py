"""--yaml-cfg: Megatron-LM's experimental YAML config (settings at the top level, megatron-core's
TransformerConfig / ModelParallelConfig names under language_model: / model_parallel:, ${NAME} from the
environment) read into the flags' values; the command line's flags win; bad files are one line."""

import pytest

from megatron.training.arguments import parse_args
from megatron.training.arguments_validation import ArgsError, validate_args

# written as Megatron-LM's examples write it (YAML 1.1: 1.e-5 is a float, 1e-4 a string)
MEGATRON_YAML = """\
# WARNING: Yaml configs is currently an experimental feature
language_model:
  num_layers: 2
  hidden_size: 64
  num_attention_heads: 4
  num_query_groups: null
  ffn_hidden_size: null
  kv_channels: null
  hidden_dropout: 0.0
  attention_dropout: 0.0
  layernorm_epsilon: 1.e-5
  layernorm_zero_centered_gamma: True
  add_bias_linear: False
  activation_func: swiglu
  gated_linear_unit: True
  num_moe_experts: null
  normalization: "RMSNorm"
  init_method: null
  perform_initialization: True
  bias_dropout_fusion: True
  fp8: null
model_parallel:
  tensor_model_parallel_size: 1
  pipeline_model_parallel_size: 1
  virtual_pipeline_model_parallel_size: null
  sequence_parallel: False
  bf16: False
  batch_p2p_comm: True
  tp_comm_split_ag: True
micro_batch_size: 2
global_batch_size: 4
max_position_embeddings: 32
seq_length: 32
position_embedding_type: rope
rotary_percent: 0.5
lr: 1e-4
adam_eps: 1.e-08
train_iters: 5
no_save_optim: null
mock_data: True
tokenizer_type: NullTokenizer
vocab_size: 100
data_cache_path: ${TEST_CACHE_DIR}/cache
profile_ranks: [0]
"""


def _write(tmp_path, text, name="gpt_config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_megatrons_layout_reads_into_the_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_CACHE_DIR", "/scratch/me")
    path = _write(tmp_path, MEGATRON_YAML)
    args = validate_args(parse_args(argv=["--yaml-cfg", path]))
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size) == (2, 64, 4, 128)
    assert (args.swiglu, args.normalization, args.norm_epsilon, args.apply_layernorm_1p) == (True, "RMSNorm", 1e-5,
                                                                                             True)
    assert (args.add_bias_linear, args.position_embedding_type, args.rotary_percent) == (False, "rope", 0.5)
    assert (args.lr, args.adam_eps, args.train_iters, args.global_batch_size) == (1e-4, 1e-8, 5, 4)
    assert args.no_save_optim is None and args.num_query_groups == 1  # null: the flag's default
    assert args.data_cache_path == "/scratch/me/cache" and args.profile_ranks == [0]


def test_the_command_line_overrides_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_CACHE_DIR", "/x")
    path = _write(tmp_path, MEGATRON_YAML)
    args = parse_args(argv=["--yaml-cfg", path, "--num-layers", "3", "--lr", "0.5", "--global-batch-size", "4"])
    assert (args.num_layers, args.lr, args.hidden_size) == (3, 0.5, 64)


@pytest.mark.parametrize("change, message", [
    (("layernorm_epsilon: 1.e-5", "layernorm_epsilon: tiny"), "language_model.layernorm_epsilon: 'tiny' is not a "
                                                               "value of --norm-epsilon"),
    (("normalization: \"RMSNorm\"", "normalization: FancyNorm"), "--normalization: 'FancyNorm' is not one of "
                                                                 "LayerNorm, RMSNorm"),
    (("batch_p2p_comm: True", "batch_p2p_comm: False"),
     "model_parallel.batch_p2p_comm: False is not supported here"),
    (("micro_batch_size: 2", "micro_batch_size: 2\nstep_batch_size_schedule: '0:32 90B:64'"),
     "step_batch_size_schedule: '0:32 90B:64' is not supported here"),
    (("mock_data: True", "mock_data: True\nno_such_setting: 3"), "no_such_setting: not a setting of this framework"),
    (("activation_func: swiglu", "activation_func: relu6"), "activation_func: 'relu6' is not one of swiglu"),
    (("data_cache_path: ${TEST_CACHE_DIR}", "data_cache_path: ${NOT_SET_ANYWHERE}"),
     "the environment variable NOT_SET_ANYWHERE is not set"),
    (("model_parallel:", "model_parallel: [1, 2]\nunused:"), "model_parallel must be a mapping of settings"),
    (("hidden_size: 64", "hidden_size: [64"), "not YAML"),
])
def test_a_bad_file_is_one_line_naming_file_and_key(tmp_path, monkeypatch, change, message):
    monkeypatch.setenv("TEST_CACHE_DIR", "/x")
    path = _write(tmp_path, MEGATRON_YAML.replace(*change))
    with pytest.raises(ArgsError) as refused:
        parse_args(argv=["--yaml-cfg", path])
    text = str(refused.value)
    assert text.startswith(f"--yaml-cfg {path}") and message in text and "\n" not in text, text


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(ArgsError, match=r"--yaml-cfg .*nothing\.yaml: cannot read it"):
        parse_args(argv=["--yaml-cfg", str(tmp_path / "nothing.yaml")])


def test_a_refused_feature_is_refused_as_its_flag_is(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_CACHE_DIR", "/x")
    path = _write(tmp_path, MEGATRON_YAML.replace("fp8: null", "fp8: hybrid"))
    with pytest.raises(ArgsError, match="--fp8-format hybrid: .* is not supported yet"):
        validate_args(parse_args(argv=["--yaml-cfg", path]))
