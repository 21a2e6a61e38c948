"""tools/checkpoint/convert.py on our checkpoints: TP=2 PP=2 -> TP=1 PP=1 -> TP=4, verified by logits.

The source checkpoints are written in-process from a TP = 1 Llama-style model (RMSNorm, SwiGLU,
RoPE, GQA, untied, no biases): each (tp, pp) rank's model is built at that rank (parallel_state
patched) and each of its tensors cut from the whole one with *that model's own* partition
attributes, so the converter's name-based layout rules are checked against the layers' layouts.
"""

import argparse
import os
import shutil
import subprocess
import sys
import unittest.mock

import pytest
import torch

import pretrain_gpt
from megatron.training.arguments import core_transformer_config_from_args, gpt_model_kwargs, parse_and_validate_args
from megatron.training.checkpoint_manifest import write_manifest
from megatron.training.checkpoint_safety import load_file
from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename
from megatron.convert import megatron_format
from megatron.convert.layout_rules import renumber
from megatron.core import parallel_state
from megatron.core.atomic_io import atomic_write
from megatron.core.tensor_parallel.layout import shard_for_rank
from megatron.model import GPTModel
from tests.helpers.launch import torchrun
from tests.helpers.training import logged_losses
from tools.checkpoint import convert, saver_megatron

COMMON = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
          "--lr", "1e-3", "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--eval-iters", "0",
          "--ckpt-format", "torch"]  # the converter reads and writes the torch format
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--group-query-attention",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
# name: (flags, virtual stages of the TP=2 PP=2 source)
MODELS = {
    "llama-gqa2": ([*COMMON, *LLAMA, "--num-query-groups", "2"], 1),
    "llama-mqa": ([*COMMON, *LLAMA, "--num-query-groups", "1"], 1),  # K/V replicated on every rank
    "gpt2-tied-vpp2": (COMMON, 2),  # LayerNorm, biases, learned positions, tied output, model0/model1 files
}
TRUE_VOCAB = 256  # NullTokenizer: 255 ids and its eod


def _args(flags, vp: int = 1) -> argparse.Namespace:
    args = parse_and_validate_args(argv=[*flags, "--train-iters", "1"])
    args.padded_vocab_size = 256  # 256 ids padded to a multiple of 128 x TP, TP <= 2
    if vp > 1:
        args.virtual_pipeline_model_parallel_size = vp
        args.num_layers_per_virtual_pipeline_stage = args.num_layers // (2 * vp)
    return args


def _patched(tp: int, tp_rank: int, pp: int, pp_rank: int, vp: int, vp_rank: int):
    patches = {"get_tensor_model_parallel_world_size": tp, "get_tensor_model_parallel_rank": tp_rank,
               "get_pipeline_model_parallel_world_size": pp, "get_pipeline_model_parallel_rank": pp_rank,
               "get_virtual_pipeline_model_parallel_world_size": vp if vp > 1 else None,
               "get_virtual_pipeline_model_parallel_rank": vp_rank if vp > 1 else None,
               "is_rank_in_embedding_group": False}  # no tied-embedding all-reduce: the weights are copied in
    return unittest.mock.patch.multiple(parallel_state, **{k: (lambda v=v: v) for k, v in patches.items()})


def _model(args: argparse.Namespace, pre: bool = True, post: bool = True) -> GPTModel:
    return GPTModel(core_transformer_config_from_args(args), vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre, post_process=post,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    **gpt_model_kwargs(args))


def write_checkpoint(save_dir, args: argparse.Namespace, whole, tp: int, pp: int, vp: int = 1,
                     iteration: int = 2) -> None:
    """Our checkpoint of the whole state dict at (tp, pp, vp), as each rank's own model would hold it."""
    args = argparse.Namespace(**vars(args))
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size = tp, pp, tp * pp
    if vp == 1:
        args.virtual_pipeline_model_parallel_size = args.num_layers_per_virtual_pipeline_stage = None
    base_dir = get_checkpoint_name(str(save_dir), iteration, return_base_dir=True)
    files = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            saved = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
            for chunk in range(vp):
                with _patched(tp, tp_rank, pp, pp_rank, vp, chunk):
                    rank_model = _model(args, pre=pp_rank == 0 and chunk == 0,
                                        post=pp_rank == pp - 1 and chunk == vp - 1)
                offset = (chunk * pp + pp_rank) * args.num_layers // (pp * vp)
                # a tied model's last stage holds a copy of the word embeddings as output_layer.weight
                state = {name: shard_for_rank(whole.get(renumber(name, offset), whole[megatron_format.EMBEDDING]),
                                              param, tp, tp_rank).clone()
                         for name, param in rank_model.state_dict(keep_vars=True).items()}
                saved["model" if vp == 1 else f"model{chunk}"] = state
            path = get_checkpoint_name(str(save_dir), iteration, pipeline_parallel=pp > 1, tensor_rank=tp_rank,
                                       pipeline_rank=pp_rank, expert_parallel=False, expert_rank=0)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            files[os.path.relpath(path, base_dir)] = atomic_write(path, lambda f: torch.save(saved, f), checksum=True)
    write_manifest(base_dir, iteration, files)
    atomic_write(get_checkpoint_tracker_filename(str(save_dir)), lambda f: f.write(str(iteration).encode()))


@pytest.fixture(scope="module", params=list(MODELS))
def source(request, tmp_path_factory):
    """(folder holding tp2_pp2/, the whole state dict, args, flags) of a seeded random model."""
    flags, vp = MODELS[request.param]
    args = _args(flags)
    torch.manual_seed(7)
    whole = {k: v.detach().clone() for k, v in _model(args).state_dict().items()}
    root = tmp_path_factory.mktemp(request.param)
    write_checkpoint(root / "tp2_pp2", _args(flags, vp), whole, tp=2, pp=2, vp=vp)
    return root, whole, args, flags


def _convert(load_dir, save_dir, tp, pp, *extra):
    convert.main(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir", str(load_dir),
                  "--save-dir", str(save_dir), "--target-tensor-parallel-size", str(tp),
                  "--target-pipeline-parallel-size", str(pp), "--megatron-path", "ignored", *extra])


def _read_whole(save_dir):
    args, tensors = saver_megatron.read_back(str(save_dir))
    return args, dict(tensors)


def test_tp2pp2_to_tp1_to_tp4_keeps_every_weight(source, capsys):
    root, whole, args, _ = source
    _convert(root / "tp2_pp2", root / "tp1", 1, 1)
    _convert(root / "tp1", root / "tp4", 4, 1)
    out = capsys.readouterr().out
    assert out.count("-> OK") == 2 and "WARNING" not in out, out
    args1, tp1 = _read_whole(root / "tp1")
    assert (args1.tensor_model_parallel_size, args1.pipeline_model_parallel_size) == (1, 1)
    assert args1.padded_vocab_size == 256
    assert tp1.keys() == whole.keys() and all(torch.equal(tp1[k], whole[k]) for k in whole)
    args4, tp4 = _read_whole(root / "tp4")
    assert (args4.tensor_model_parallel_size, args4.padded_vocab_size) == (4, 512)  # 256 padded to 128 x 4
    assert sorted(os.listdir(root / "tp4" / "iter_0000002")) == [
        "checksums.json", "mp_rank_00", "mp_rank_01", "mp_rank_02", "mp_rank_03"]
    for name, tensor in whole.items():
        if name in (megatron_format.EMBEDDING, "output_layer.weight"):
            assert torch.equal(tp4[name][:TRUE_VOCAB], tensor) and not tp4[name][TRUE_VOCAB:].any()
        else:
            assert torch.equal(tp4[name], tensor), name
    assert ("output_layer.weight" in tp4) == args.untie_embeddings_and_output_weights
    # Each TP=4 file holds what that rank's own model holds (the layers' layouts, not the converter's rules).
    args_512 = argparse.Namespace(**{**vars(args), "padded_vocab_size": 512})
    write_checkpoint(root / "tp4_reference", args_512, tp4, tp=4, pp=1)
    _assert_same_files(root / "tp4_reference", root / "tp4", [f"mp_rank_0{r}" for r in range(4)])
    # Back from TP=4 to TP=2 PP=2: what each rank's model holds, shard for shard (the saver writes
    # no virtual stages: the reference is the source model written at TP=2 PP=2 without them).
    _convert(root / "tp4", root / "tp2_pp2_again", 2, 2)
    write_checkpoint(root / "tp2_pp2_reference", args, whole, tp=2, pp=2)
    _assert_same_files(root / "tp2_pp2_reference", root / "tp2_pp2_again",
                       [f"mp_rank_0{t}_00{p}" for t in range(2) for p in range(2)])


def _assert_same_files(expected_dir, actual_dir, rank_dirs):
    for rank_dir in rank_dirs:
        a = load_file(str(expected_dir / "iter_0000002" / rank_dir / "model_optim_rng.pt"))
        b = load_file(str(actual_dir / "iter_0000002" / rank_dir / "model_optim_rng.pt"))
        chunks = sorted(k for k in a if k.startswith("model"))
        assert chunks == sorted(k for k in b if k.startswith("model")), rank_dir
        for chunk in chunks:
            assert a[chunk].keys() == b[chunk].keys(), (rank_dir, chunk)
            assert all(torch.equal(a[chunk][k], b[chunk][k]) for k in a[chunk]), (rank_dir, chunk)


def test_the_saver_writes_virtual_stages_as_each_chunk_holds_them(source, capsys):
    """TP=2 PP=2 -> TP=2 PP=2 with two chunks of one layer per stage: each file's model0/model1
    equal what that rank's chunk models hold (chunk v of stage p = layers (v * 2 + p))."""
    root, whole, args, flags = source
    _convert(root / "tp2_pp2", root / "tp2_pp2_vp2", 2, 2, "--target-num-layers-per-virtual-pipeline-stage", "1")
    assert "(2 virtual stages of 1 layers)" in capsys.readouterr().out
    saved_args, tensors = _read_whole(root / "tp2_pp2_vp2")
    assert (saved_args.virtual_pipeline_model_parallel_size, saved_args.num_layers_per_virtual_pipeline_stage) == (2, 1)
    assert tensors.keys() == whole.keys() and all(torch.equal(tensors[k], whole[k]) for k in whole)
    write_checkpoint(root / "tp2_pp2_vp2_reference", _args(flags, vp=2), whole, tp=2, pp=2, vp=2)
    _assert_same_files(root / "tp2_pp2_vp2_reference", root / "tp2_pp2_vp2",
                       [f"mp_rank_0{t}_00{p}" for t in range(2) for p in range(2)])
    with pytest.raises(SystemExit):
        convert.cli(["--model-type", "GPT", "--load-dir", str(root / "tp2_pp2"), "--save-dir", str(root / "vp3"),
                     "--target-pipeline-parallel-size", "2", "--target-num-layers-per-virtual-pipeline-stage", "3"])
    assert "4 layers do not split into 2 pipeline stages of chunks of 3 layers" in capsys.readouterr().err


def _first_loss(load_dir, flags):
    result = pretrain_gpt.main([*flags, "--load", str(load_dir), "--finetune",
                                "--train-iters", "1"], record_history=True)
    return result.history[0].losses["lm loss"]


def test_converted_checkpoint_trains_from_the_sources_loss(source, tmp_path, capsys):
    root, whole, args, flags = source
    target = root / "tp1_for_training"
    _convert(root / "tp2_pp2", target, 1, 1)
    write_checkpoint(tmp_path / "golden", args, whole, tp=1, pp=1)  # the source model, written directly
    converted, golden = _first_loss(target, flags), _first_loss(tmp_path / "golden", flags)
    assert capsys.readouterr().out.count("successfully loaded checkpoint") == 2
    assert converted == golden


def test_swapped_query_and_key_rows_are_refused(source, monkeypatch, capsys):
    root, _, args, _ = source
    add = megatron_format.StageWriter.add
    hn = args.hidden_size // args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    per_group = args.num_attention_heads // groups

    def swapping(self, chunk, name, tensor):
        if name == "decoder.layers.1.self_attention.linear_qkv.weight":  # group 0: its first query head <-> its key
            qkv = tensor.clone()
            q, k = slice(0, hn), slice(per_group * hn, (per_group + 1) * hn)
            qkv[q], qkv[k] = tensor[k], tensor[q]
            tensor = qkv
        return add(self, chunk, name, tensor)

    monkeypatch.setattr(megatron_format.StageWriter, "add", swapping)
    save_dir = root / "swapped"
    with pytest.raises(convert.ConversionError, match="logits differ"):
        _convert(root / "tp2_pp2", save_dir, 1, 1)
    assert "MISMATCH" in capsys.readouterr().out
    assert not save_dir.exists()
    assert not [p for p in os.listdir(root) if p.startswith(".swapped")]  # no temporary folder left
    _convert(root / "tp2_pp2", save_dir, 1, 1, "--no-verify")  # unchecked, the wrong mapping goes through
    assert "verification" not in capsys.readouterr().out and save_dir.is_dir()


@pytest.mark.parametrize("argv, message", [
    (["--model-type", "GPT", "--save-dir", "x"], "convert.py: error: --load-dir is required"),
    (["--model-type", "GPT", "--loader", "nosuch", "--load-dir", "a", "--save-dir", "b"],
     "convert.py: error: --loader nosuch: no such loader (available: core, hf, legacy, lora, megatron, peft)"),
    (["--model-type", "RETRO", "--load-dir", "a", "--save-dir", "b"],
     "convert.py: error: --model-type RETRO: not supported (supported: GPT, BERT, T5)"),
    (["--model-type", "GPT", "--saver", "os", "--load-dir", "a", "--save-dir", "b"],
     "convert.py: error: --saver os: module os is not a saver plugin (it has no add_arguments, save_checkpoint, "
     "read_back)"),
], ids=["no-load-dir", "unknown-loader", "retro", "not-a-plugin"])
def test_bad_input_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        convert.cli(argv)
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.strip() == message


def test_the_script_reports_bad_input_in_one_line(tmp_path):
    script = os.path.join(os.path.dirname(convert.__file__), "convert.py")
    run = subprocess.run([sys.executable, script, "--model-type", "GPT", "--loader", "nosuch", "--load-dir",
                          str(tmp_path), "--save-dir", str(tmp_path / "out")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip() == ("convert.py: error: --loader nosuch: no such loader "
                                  "(available: core, hf, legacy, lora, megatron, peft)")


def test_a_target_size_that_does_not_split_is_refused(source, capsys):
    root, _, _, _ = source
    with pytest.raises(SystemExit) as exit_info:
        convert.cli(["--model-type", "GPT", "--load-dir", str(root / "tp2_pp2"), "--save-dir", str(root / "tp3"),
                     "--target-tensor-parallel-size", "3"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4 attention heads do not split over 3 TP ranks" in err[0]
    assert not (root / "tp3").exists()


def test_tp4_pp2_to_tp2_pp1_to_tp1_pp4_interleaved_continues_the_unconverted_run(tmp_path):
    """A real TP=4 PP=2 run (8 gloo processes, 8 layers, GQA with 2 groups: K/V replicated at TP=4)
    saves at iterations 2 and 3. Its iteration-2 checkpoint, converted TP=4 PP=2 -> TP=2 PP=1 ->
    TP=1 PP=4 with 2 virtual stages of 1 layer, trains iteration 3 at that layout:
    the loss equals the one the unconverted run logged at 3, and the weights after that step equal
    its iteration-3 weights. Plain SGD (no momentum) and a constant learning rate: the converter
    carries no optimizer or scheduler state (as Megatron-LM's), so the comparison holds for any
    optimizer whose state is empty."""
    flags = [*MODELS["llama-gqa2"][0], "--num-layers", "8", "--micro-batch-size", "1", "--global-batch-size", "8",
             "--optimizer", "sgd", "--sgd-momentum", "0", "--lr-decay-style", "constant", "--log-interval", "1"]
    unconverted = tmp_path / "tp4_pp2"
    run = torchrun(8, [*flags, "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                       "--train-iters", "3", "--save", str(unconverted), "--save-interval", "1"])
    assert run.returncode == 0, run.stderr[-3000:]
    logged = logged_losses(run.stdout)[3]
    at2 = tmp_path / "tp4_pp2_at2"
    shutil.copytree(unconverted, at2)
    atomic_write(get_checkpoint_tracker_filename(str(at2)), lambda f: f.write(b"2"))
    _convert(at2, tmp_path / "tp2_pp1", 2, 1)
    # (TP=1 PP=4 without virtual stages is the same converter path: test_tp2pp2_to_tp1_to_tp4_keeps_every_weight)
    _convert(tmp_path / "tp2_pp1", tmp_path / "tp1_pp4_vp2", 1, 4, "--target-num-layers-per-virtual-pipeline-stage",
             "1")
    _, expected = _read_whole(unconverted)  # its iteration-3 weights, merged to TP=1
    for name, virtual in (("tp1_pp4_vp2", ["--num-layers-per-virtual-pipeline-stage", "1"]),):
        out = tmp_path / f"{name}_trained"
        run = torchrun(4, [*flags, "--pipeline-model-parallel-size", "4", *virtual, "--train-iters", "3",
                           "--load", str(tmp_path / name), "--no-load-optim", "--no-load-rng",
                           "--save", str(out), "--save-interval", "3"])
        assert run.returncode == 0, (name, run.stderr[-3000:])
        assert list(logged_losses(run.stdout)) == [3], name
        assert logged_losses(run.stdout)[3] == pytest.approx(logged, rel=2e-6), name  # logged to 7 digits
        args, trained = _read_whole(out)
        assert trained.keys() == expected.keys(), name
        assert (args.padded_vocab_size, expected[megatron_format.EMBEDDING].shape[0]) == (256, 512)  # TP=1 / TP=4
        for key, tensor in expected.items():
            tensor = tensor[:TRUE_VOCAB] if megatron_format.is_vocab_tensor(key) else tensor
            torch.testing.assert_close(trained[key], tensor, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} {key}: {m}")
