"""Checkpoints written by Megatron-LM (core_v0.13-0.16, `--ckpt-format torch`) load here, and
what we write on CPU loads in Megatron-LM on a GPU.

A Megatron file holds `args` from Megatron's parser, with megatron-core's AttnBackend enum (and,
in core_v0.13, a rerun_state_machine entry of RerunMode/RerunState/RerunDiagnostic enums), a
megatron-core GPTModel's state dict with `*._extra_state` entries, checkpoint_version 3.0 and no
optimizer or RNG state (--no-save-optim --no-save-rng). Two fixtures: one made here by defining
those enums under megatron-core's module names while the file is written (so it runs without
megatron-core), and one written by megatron-core 0.16.1 itself (skipped when it is missing),
whose logits we reproduce.
"""

import argparse
import contextlib
import enum
import io
import signal
import sys
import types
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron.training.checkpoint_rng import PHILOX_STATE_BYTES, get_rng_state
from megatron.training.checkpoint_safety import CheckpointError, ForeignObject, load_file
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.core import device, tensor_parallel
from megatron.core.enums import ModelType
from megatron.training.training import pretrain
from tests.helpers.checkpoints import TinyGPT, build, make_args
from tests.helpers.mcore_reference import run_mcore

SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--max-position-embeddings", "16"]
RUN = ["--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-3",
       "--num-workers", "0", "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", "255", "--hidden-dropout", "0", "--attention-dropout", "0",
       "--ckpt-format", "torch"]  # Megatron-LM's legacy files
LOAD_WEIGHTS_ONLY = ["--finetune", "--no-load-optim", "--no-load-rng"]


@contextlib.contextmanager
def megatron_core_enums():
    """megatron-core's enums, defined here under its module names while a file is written.

    Pickle refers to a class by module and name; these make a file refer to
    megatron.core.transformer.enums.AttnBackend etc. exactly as Megatron's does, without
    megatron-core. The modules are removed again afterwards.
    """
    enums = types.ModuleType("megatron.core.transformer.enums")
    rerun = types.ModuleType("megatron.core.rerun_state_machine")
    enums.AttnBackend = enum.Enum("AttnBackend", [("flash", 1), ("fused", 2), ("unfused", 3), ("local", 4),
                                                  ("auto", 5)], module=enums.__name__, qualname="AttnBackend")
    rerun.RerunMode = enum.Enum("RerunMode", [("DISABLED", "disabled")], module=rerun.__name__,
                                qualname="RerunMode", type=str)
    rerun.RerunState = enum.Enum("RerunState", [("NOT_RUNNING_YET", 0)], module=rerun.__name__,
                                 qualname="RerunState")
    rerun.RerunDiagnostic = enum.Enum("RerunDiagnostic", [("TRANSIENT_ERROR", "transient_error")],
                                      module=rerun.__name__, qualname="RerunDiagnostic", type=str)
    modules = {"megatron.core.transformer": types.ModuleType("megatron.core.transformer"),
               enums.__name__: enums, rerun.__name__: rerun}
    sys.modules.update(modules)
    try:
        yield types.SimpleNamespace(AttnBackend=enums.AttnBackend, **vars(rerun))
    finally:
        for name in modules:
            del sys.modules[name]


def megatron_args(enums, **shape) -> argparse.Namespace:
    """A Namespace with the field names and types of Megatron-LM's parsed args (a subset)."""
    values = dict(num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
                  kv_channels=8, num_query_groups=4, group_query_attention=False,
                  max_position_embeddings=16, seq_length=16, padded_vocab_size=256, vocab_size=None,
                  make_vocab_size_divisible_by=128, tokenizer_type="NullTokenizer",
                  position_embedding_type="learned_absolute", normalization="LayerNorm",
                  norm_epsilon=1e-5, apply_layernorm_1p=False, swiglu=False, squared_relu=False,
                  add_bias_linear=True, add_qkv_bias=False, untie_embeddings_and_output_weights=False,
                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                  virtual_pipeline_model_parallel_size=None, use_distributed_optimizer=False,
                  transformer_impl="local", spec=["local"], ckpt_format="torch",
                  attention_backend=enums.AttnBackend.auto if enums else None, cuda_graph_scope=[],
                  exit_signal=signal.SIGTERM, params_dtype=torch.float32,
                  main_grads_dtype=torch.float32, main_params_dtype=torch.float32,
                  exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                  consumed_train_samples=640, consumed_valid_samples=0, skipped_train_samples=0,
                  iteration=10, no_save_optim=True, no_save_rng=True, rerun_mode="disabled")
    values.update(shape)
    return argparse.Namespace(**values)


def rerun_state(enums) -> dict:
    """What core_v0.13's RerunStateMachine.state_dict() holds in a torch-format checkpoint."""
    return {"mode": enums.RerunMode.DISABLED,
            "sharded": {"state": enums.RerunState.NOT_RUNNING_YET, "current_iteration": -1,
                        "rerun_requested": False, "checkpoint_requested": False,
                        "restart_again_requested": False, "continue_requested": False,
                        "error_injector_checkpoint": {"error_injection_rate": 0,
                                                      "error_injection_type": enums.RerunDiagnostic.TRANSIENT_ERROR,
                                                      "injected_error_type": None},
                        "failed_validation_call": None, "initial_result": None, "suspicious_node": None,
                        "suspicious_device": None, "data_iterator_checkpoints": None,
                        "large_value_counts": {}, "max_values": {}}}


def with_extra_state(model_state: dict) -> dict:
    """megatron-core's linear layers add `<layer>._extra_state`: None (local spec) or an empty
    buffer (Transformer Engine: a BytesIO, or in newer versions an empty uint8 tensor)."""
    state = dict(model_state)
    layers = sorted({key.rsplit(".", 1)[0] for key in model_state if "linear_" in key})
    for i, layer in enumerate(layers):
        state[f"{layer}._extra_state"] = [None, io.BytesIO(), torch.empty(0, dtype=torch.uint8)][i % 3]
    state["output_layer._extra_state"] = None
    return state


def write_megatron_checkpoint(directory: Path, model_state: dict, extra_model_entries=None) -> Path:
    path = directory / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    with megatron_core_enums() as enums:
        state = {"args": megatron_args(enums), "checkpoint_version": 3.0, "iteration": 10,
                 "model": {**with_extra_state(model_state), **(extra_model_entries or {})},
                 "rerun_state_machine": rerun_state(enums), "num_floating_point_operations_so_far": 3.5e12}
        torch.save(state, path)
    (directory / "latest_checkpointed_iteration.txt").write_text("10")
    return path


def recorded_run(argv):
    """pretrain() with pretrain_gpt's recipe; returns (result, the model it built and loaded)."""
    models = []

    def provider(pre_process=True, post_process=True):
        models.append(pretrain_gpt.model_provider(pre_process, post_process))
        return models[-1]

    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider, provider, ModelType.encoder_or_decoder,
                      pretrain_gpt.forward_step, argv=argv)
    return result, models[0]


@pytest.fixture(scope="module")
def our_weights(tmp_path_factory):
    """A GPT state dict in megatron-core's naming, from a model of SHAPE (random weights)."""
    ckpt = tmp_path_factory.mktemp("ours")
    pretrain_gpt.main([*SHAPE, *RUN, "--train-iters", "1", "--save", str(ckpt), "--save-interval", "1"])
    return load_file(str(ckpt / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"))["model"]


def test_megatron_checkpoint_loads_for_finetuning(tmp_path, our_weights, capsys):
    ckpt = tmp_path / "megatron"
    path = write_megatron_checkpoint(ckpt, our_weights)
    with pytest.raises(ModuleNotFoundError, match="megatron.core.transformer"):
        torch.load(path, weights_only=False)  # what loading it did before: megatron-core's enum
    for flags in (LOAD_WEIGHTS_ONLY, ["--finetune"], ["--use-checkpoint-args", *LOAD_WEIGHTS_ONLY]):
        shape = [] if "--use-checkpoint-args" in flags else SHAPE  # the shape from Megatron's args
        result, model = recorded_run([*shape, *RUN, "--train-iters", "1", "--skip-train", "--load", str(ckpt),
                                      *flags])
        loaded = model.state_dict()
        for name, value in our_weights.items():
            assert torch.equal(loaded[name], value), name
        assert result.iteration == 0
    assert "megatron.core.transformer" not in sys.modules  # nothing was imported
    out = capsys.readouterr().out
    assert f"successfully loaded checkpoint from {ckpt} [ t 1/1, p 1/1 ] at iteration 0" in out
    assert "overriding num_layers = None with 2 from the checkpoint" in out
    for trust in (False, True):  # --trust-checkpoint-pickles too reads megatron-core's enums as placeholders
        saved = load_file(str(path), trust_pickles=trust, log=lambda line: None)
        backend, mode = saved["args"].attention_backend, saved["rerun_state_machine"]["mode"]
        assert isinstance(backend, ForeignObject) and (backend.name, mode.name) == ("auto", "DISABLED")
        assert saved["args"].exit_signal is signal.SIGTERM and saved["args"].params_dtype is torch.float32
    assert "megatron.core.transformer" not in sys.modules


def test_megatron_checkpoint_needs_the_flags_that_skip_optimizer_and_rng(tmp_path, our_weights):
    ckpt = tmp_path / "megatron"
    write_megatron_checkpoint(ckpt, our_weights)
    with pytest.raises(CheckpointError, match="has no optimizer state .*pass --no-load-optim or --finetune"):
        pretrain_gpt.main([*SHAPE, *RUN, "--train-iters", "1", "--skip-train", "--load", str(ckpt)])
    with pytest.raises(CheckpointError, match="has no RNG state .*pass --no-load-rng or"):
        pretrain_gpt.main([*SHAPE, *RUN, "--train-iters", "1", "--skip-train", "--load", str(ckpt),
                           "--no-load-optim"])


@pytest.mark.parametrize("extra, words", [
    ({"decoder.layers.0.mlp.linear_fc1._extra_state": io.BytesIO(b"fp8 scaling")},
     "holds extra state with data that this model has no place for (Transformer Engine FP8 state?): "
     "decoder.layers.0.mlp.linear_fc1._extra_state"),
    ({"decoder.layers.0.mlp.linear_fc1._extra_state": torch.ones(4, dtype=torch.uint8)},
     "model has no place for (Transformer Engine FP8 state?): decoder.layers.0.mlp.linear_fc1._extra_state"),
    ({"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": torch.ones(32)},
     "does not fit the model: keys the model does not have: "
     "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"),
], ids=["bytesio-with-data", "tensor-with-data", "transformer-engine-key"])
def test_anything_else_unexpected_still_fails_naming_the_keys(tmp_path, our_weights, extra, words):
    ckpt = tmp_path / "megatron"
    path = write_megatron_checkpoint(ckpt, our_weights, extra)
    with pytest.raises(CheckpointError) as info:
        pretrain_gpt.main([*SHAPE, *RUN, "--train-iters", "1", "--skip-train", "--load", str(ckpt),
                           *LOAD_WEIGHTS_ONLY])
    assert words in str(info.value) and str(path) in str(info.value)


# ------------------------------------------------------------------ written by megatron-core itself
MCORE_WRITES = '''
import argparse, os, signal, torch, torch.distributed as dist
patch_for_cpu()  # includes the causal mask built on CPU
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 500))
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1234)
config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                           attention_dropout=0.0, use_cpu_initialization=True)
model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=16,
                 share_embeddings_and_output_weights=True).eval()
args = argparse.Namespace(**@ARGS@, attention_backend=AttnBackend.auto, exit_signal=signal.SIGTERM,
                          params_dtype=torch.float32, main_grads_dtype=torch.float32)
# core_v0.13's rerun_state_machine entry (0.14+ leave it out of torch-format files), with
# megatron-core's own RerunMode / RerunState / RerunDiagnostic values
machine = get_rerun_state_machine()
rerun = {"mode": machine.mode, "sharded": {
    "state": machine.state, "current_iteration": machine.current_iteration, "rerun_requested": False,
    "checkpoint_requested": False, "restart_again_requested": False, "continue_requested": False,
    "error_injector_checkpoint": machine.error_injector.state_dict(), "failed_validation_call": None,
    "initial_result": None, "suspicious_node": None, "suspicious_device": None,
    "data_iterator_checkpoints": None, "large_value_counts": {}, "max_values": {}}}
# as generate_state_dict writes it with --ckpt-format torch --no-save-optim --no-save-rng
state = {"args": args, "checkpoint_version": 3.0, "iteration": 10,
         "model": model.state_dict_for_save_checkpoint(), "rerun_state_machine": rerun,
         "num_floating_point_operations_so_far": 3.5e12}
path = os.path.join(@DIR@, "iter_0000010", "mp_rank_00", "model_optim_rng.pt")
os.makedirs(os.path.dirname(path))
torch.save(state, path)
with open(os.path.join(@DIR@, "latest_checkpointed_iteration.txt"), "w") as f:
    f.write("10")
tokens = torch.tensor(@TOKENS@)
with torch.no_grad():
    logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)  # [b, s, v]
emit({"logits": logits.tolist(), "extra": sorted(k for k in state["model"] if k.endswith("_extra_state"))})
'''


def test_checkpoint_written_by_megatron_core_gives_its_logits(tmp_path):
    ckpt = tmp_path / "mcore"
    tokens = [[(7 * i + 3) % 256 for i in range(16)], [(11 * i + 5) % 256 for i in range(16)]]
    args = {key: value for key, value in vars(megatron_args(None)).items()
            if not isinstance(value, (torch.dtype, enum.Enum)) and key != "attention_backend"}
    snippet = (MCORE_WRITES.replace("@ARGS@", repr(args)).replace("@DIR@", repr(str(ckpt)))
               .replace("@TOKENS@", repr(tokens)))
    reference = run_mcore(snippet)
    assert len(reference["extra"]) == 9  # 8 linear layers and the (weightless, tied) output layer
    _, model = recorded_run([*RUN, "--train-iters", "1", "--skip-train", "--load", str(ckpt),
                             "--use-checkpoint-args", *LOAD_WEIGHTS_ONLY])
    saved = load_file(str(ckpt / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"))["model"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name  # bit for bit
    ids = torch.tensor(tokens)
    with torch.no_grad():
        logits = model.eval()(ids, torch.arange(16).expand_as(ids), None)  # [b, s, v]
    torch.testing.assert_close(logits, torch.tensor(reference["logits"]), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ what we write, for Megatron on a GPU
def _tensors_or_none(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _tensors_or_none(item)
    else:
        yield value


@pytest.mark.skipif(device.accelerator_available(), reason="on a GPU the states are CUDA's own")
def test_cpu_checkpoint_has_cuda_rng_states_megatron_accepts(tmp_path):
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    entry = get_rng_state()[0]
    # Megatron: torch.cuda.set_rng_state(cuda_rng_state); tracker.set_states -> each state set on
    # the CUDA generator, whose state is uint8 [16] (uint64 seed, uint64 offset; offset % 4 == 0)
    for state in [entry["cuda_rng_state"], *entry["rng_tracker_states"].values()]:
        assert state is not None and state.dtype == torch.uint8 and state.numel() == PHILOX_STATE_BYTES
        assert int.from_bytes(bytes(state[8:].tolist()), "little") % 4 == 0
    assert set(entry["rng_tracker_states"]) == {"model-parallel-rng"} == set(entry["cpu_rng_tracker_states"])
    assert None not in list(_tensors_or_none(entry))
    # the Philox seed follows the saved CPU state: another state gives another stream
    torch.manual_seed(1)
    assert not torch.equal(get_rng_state()[0]["cuda_rng_state"], entry["cuda_rng_state"])


def test_cuda_states_from_a_gpu_checkpoint_do_not_break_a_cpu_resume(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    args = make_args(ckpt)
    model, optimizer, scheduler = build(args, seed=0)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    save_checkpoint(10, [model], optimizer, scheduler, args=args)
    path = ckpt / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_file(str(path))
    state["rng_state"][0].pop("cpu_rng_tracker_states", None)  # as written on a GPU
    state["rng_state"][0]["rng_tracker_states"] = {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)}
    torch.save(state, path)
    (ckpt / "iter_0000010" / "checksums.json").unlink()
    assert load_checkpoint([TinyGPT(args)], optimizer, scheduler, args=args)[0] == 10
    if not device.accelerator_available():
        assert "were saved on another kind of device than this run's (CPU)" in capsys.readouterr().out
        with tensor_parallel.get_cuda_rng_tracker().fork():  # still a working CPU stream
            torch.rand(2)
