"""tools/checkpoint/convert.py with --loader hf / --saver hf on tiny random transformers models.

Each model is saved by transformers (save_pretrained), converted HF -> ours at TP = 2 PP = 2 ->
HF, each step verified by convert.py's logits comparison. The result must be the source bit for
bit (every tensor torch.equal, config.json and generation_config.json equal) and load with
AutoModelForCausalLM.from_pretrained offline. The TP = 2 PP = 2 checkpoint itself runs in 4 gloo
processes (each rank builds its stage from the file's args, loads its own file, the first stage
sends its activations to the last, the last gathers the vocabulary shards): its logits must
equal HF's to fp32 rounding.
"""

import argparse
import json
import os

import pytest
import torch

from megatron.training.checkpoint_safety import CheckpointError, load_file
from megatron.training.checkpointing import get_checkpoint_name
from megatron.convert import megatron_format
from tests.helpers.convert import llama31_rope, run_convert, save_hf
from tests.helpers.saver_faults import break_hf_saver_rule, first_query_and_key_heads_swapped
from tests.parallel.harness import DistributedPool, init_parallel
from tools.checkpoint import convert, loader_hf, saver_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, HIDDEN, HEADS, FFN, LAYERS, POSITIONS = 200, 32, 4, 64, 4, 64
TOKENS = torch.Generator().manual_seed(5)
BATCH = torch.randint(0, VOCAB, (2, 12), generator=TOKENS)


def _llama_family(kind, **overrides):
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config}[kind]
    kwargs = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=POSITIONS,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return config_class(**{**kwargs, **overrides})


def _gpt2(**overrides):
    kwargs = dict(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                  activation_function="gelu_new", bos_token_id=1, eos_token_id=1)
    return transformers.GPT2Config(**{**kwargs, **overrides})


def _gpt_neox(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, max_position_embeddings=POSITIONS, use_parallel_residual=False,
                  bos_token_id=0, eos_token_id=1)
    return transformers.GPTNeoXConfig(**{**kwargs, **overrides})


# Per HF family every RoPE variant and option the mapping (megatron/convert/huggingface.py) accepts:
# tied / untied output, MHA / GQA / MQA, biases, an explicit head_dim, partial rotary, Llama 3.1 scaling.
MODELS = {  # noqa: E731
    "gpt2": lambda: _gpt2(),
    "gpt2-untied-erf-gelu": lambda: _gpt2(n_layer=2, tie_word_embeddings=False, activation_function="gelu"),
    "llama-gqa": lambda: _llama_family("llama"),
    "llama-tied": lambda: _llama_family("llama", tie_word_embeddings=True, num_key_value_heads=4),
    "llama3.1-rope-scaling": lambda: _llama_family("llama", num_hidden_layers=2, rope_parameters=llama31_rope()),
    "llama3.2-tied-mqa-rope-scaling": lambda: _llama_family(
        "llama", num_hidden_layers=2, tie_word_embeddings=True, num_key_value_heads=1,
        rope_parameters=llama31_rope(factor=32.0)),
    "llama-biases-head-dim": lambda: _llama_family("llama", num_hidden_layers=2, num_key_value_heads=4,
                                                   attention_bias=True, mlp_bias=True, head_dim=16),
    "mistral": lambda: _llama_family("mistral", sliding_window=32),
    "mistral-tied-rope-scaling": lambda: _llama_family("mistral", num_hidden_layers=2, sliding_window=32,
                                                       tie_word_embeddings=True, rope_parameters=llama31_rope()),
    "qwen2": lambda: _llama_family("qwen2", num_key_value_heads=1),
    "qwen2-tied-rope-scaling": lambda: _llama_family("qwen2", num_hidden_layers=2, tie_word_embeddings=True,
                                                     rope_parameters=llama31_rope()),
    "gpt-neox-partial-rotary": lambda: _gpt_neox(rotary_pct=0.5),
    "gpt-neox-tied-tanh-rope-scaling": lambda: _gpt_neox(
        num_hidden_layers=2, tie_word_embeddings=True, hidden_act="gelu_new",
        rope_parameters=dict(llama31_rope(), partial_rotary_factor=1.0)),
}
# Models with Llama 3.1's RoPE -> how much sharper their attention is made (_save_hf), enough that HF's
# logits without the scaling differ from HF's by over 50 times the 1e-5 of the logits checks.
ROPE_SCALED = {name: 60.0 if name.startswith("gpt-neox") else 20.0 for name in MODELS
               if name.endswith("rope-scaling")}


def _hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(BATCH).logits


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (HF source dir, our TP2 PP2 checkpoint, HF dir written back)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, config in MODELS.items():
        save_hf(config(), root / name, query_key_scale=ROPE_SCALED.get(name, 1.0))
        run_convert(root / name, root / f"{name}-tp2pp2", "hf", "megatron",
                    "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
        run_convert(root / f"{name}-tp2pp2", root / f"{name}-back", "megatron", "hf")
        out[name] = (root / name, root / f"{name}-tp2pp2", root / f"{name}-back")
    return out


def _json(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_to_tp2pp2_to_hf_is_bit_identical(converted, name):
    source, _, back = converted[name]
    assert sorted(os.listdir(back)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert _json(back / "config.json") == _json(source / "config.json")
    assert _json(back / "generation_config.json") == _json(source / "generation_config.json")
    a = safetensors_torch.load_file(str(source / "model.safetensors"))
    b = safetensors_torch.load_file(str(back / "model.safetensors"))
    assert sorted(a) == sorted(b)
    unequal = [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    assert not unequal
    assert torch.equal(_hf_logits(back), _hf_logits(source))


@pytest.mark.parametrize("name", list(ROPE_SCALED))
def test_llama3_rope_scaling_is_carried_through(converted, name):
    """Llama 3.1's scaling reaches our checkpoint as --use-rope-scaling and comes back as the source's
    rope_parameters; without it HF's logits move by far more than the tolerance of the logits checks."""
    source, ours, back = converted[name]
    args = megatron_format.open_source(str(ours)).args
    expected = _json(source / "config.json")["rope_parameters"]
    assert (args.position_embedding_type, args.use_rope_scaling, args.rope_scaling_factor, args.rotary_base) == \
        ("rope", True, expected["factor"], 500000)
    assert _json(back / "config.json")["rope_parameters"] == expected
    plain = transformers.AutoConfig.from_pretrained(str(source), local_files_only=True)
    plain.rope_parameters = {k: v for k, v in expected.items() if k in ("rope_theta", "partial_rotary_factor")}
    plain.rope_parameters["rope_type"] = "default"
    unscaled = transformers.AutoModelForCausalLM.from_pretrained(str(source), config=plain, local_files_only=True,
                                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        moved = (unscaled(BATCH).logits - _hf_logits(source)).abs().max().item()
    assert moved > 50 * 1e-5, moved


def _stage_logits(checkpoint, tokens):
    """Task: this rank's stage of our TP=2 PP=2 checkpoint; the last stage returns the whole logits."""
    import torch.distributed as dist

    from megatron.training.arguments import core_transformer_config_from_args, gpt_model_kwargs
    from megatron.core import parallel_state
    from megatron.model import GPTModel

    init_parallel(tp=2, pp=2)
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    state = load_file(get_checkpoint_name(str(checkpoint), 0, release=True, pipeline_parallel=True,
                                          tensor_rank=tp_rank, pipeline_rank=pp_rank))
    args = state["args"]
    args.hidden_dropout = args.attention_dropout = 0.0
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    model = GPTModel(core_transformer_config_from_args(args), vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, pre_process=first, post_process=last,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     parallel_output=False, **gpt_model_kwargs(args))
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    hidden_shape = (tokens.shape[1], tokens.shape[0], args.hidden_size)  # [s, b, h]
    with torch.no_grad():
        if first:
            hidden = model(tokens, positions)
            dist.send(hidden.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        received = torch.empty(hidden_shape)
        dist.recv(received, parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(received)
        return model(tokens, positions)  # [b, s, padded vocab], gathered over TP


@pytest.fixture(scope="module")
def pool():
    pool = DistributedPool(4)
    yield pool
    pool.close()


def test_our_tp2pp2_model_gives_hfs_logits(converted, pool):
    for name, (source, ours, _) in converted.items():
        expected = _hf_logits(source)
        per_rank = pool.run(_stage_logits, str(ours), BATCH)
        last = [logits for logits in per_rank if logits is not None]
        assert len(last) == 2  # the two TP ranks of the last stage
        for logits in last:
            difference = (logits[..., :VOCAB] - expected).abs().max().item()
            assert difference <= 1e-5 * max(1.0, expected.abs().max().item()), (name, difference)
            assert torch.all(logits[..., VOCAB:] == 0)  # the padding rows are zero


def test_a_small_max_shard_size_writes_an_index_that_reloads(converted, tmp_path):
    source, ours, _ = converted["llama-gqa"]
    out = tmp_path / "sharded"
    run_convert(ours, out, "megatron", "hf", "--max-shard-size", "10KB")
    index = _json(out / "model.safetensors.index.json")
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == shards
    sizes = [os.path.getsize(out / s) for s in shards]
    assert max(sizes) < 10_000 + 20_000  # each shard at most 10 KB of tensors, or one larger tensor alone
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in
                                                  safetensors_torch.load_file(str(source / "model.safetensors")).values())
    assert torch.equal(_hf_logits(out), _hf_logits(source))
    again = tmp_path / "again"  # sharded input, converted back to one file
    run_convert(out, again, "hf", "hf")
    assert torch.equal(_hf_logits(again), _hf_logits(source))


def test_pytorch_model_bin_input(tmp_path):
    source = tmp_path / "bin"
    model = save_hf(MODELS["gpt2"](), tmp_path / "safetensors")
    model.config.save_pretrained(source)
    torch.save(model.state_dict(), source / "pytorch_model.bin")  # with the tied lm_head copy and attn buffers
    run_convert(source, tmp_path / "ours", "hf", "megatron", "--target-tensor-parallel-size", "2")
    run_convert(tmp_path / "ours", tmp_path / "back", "megatron", "hf")
    assert torch.equal(_hf_logits(tmp_path / "back"), _hf_logits(tmp_path / "safetensors"))


class _Gadget:  # a pickled object of code: the safe loader must refuse it
    pass


def _one_line_error(argv, capsys):
    capsys.readouterr()  # drop what came before (transformers' progress bars)
    with pytest.raises(SystemExit) as exit_info:
        convert.cli(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


def test_bad_input_is_one_line(tmp_path, capsys):
    hf = tmp_path / "hf"
    save_hf(MODELS["llama-gqa"](), hf)
    argv = ["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--save-dir", str(tmp_path / "out")]
    assert "config.json is missing" in _one_line_error([*argv, "--load-dir", str(tmp_path)], capsys)
    bert = tmp_path / "bert"
    transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=FFN)).save_pretrained(bert)
    # BERT has its own mapping (tests/functional/test_convert_bert.py), behind --model-type BERT.
    message = _one_line_error([*argv, "--load-dir", str(bert)], capsys)
    assert "BERT" in message and "--model-type" in message, message
    weights = safetensors_torch.load_file(str(hf / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    safetensors_torch.save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    error = _one_line_error([*argv, "--load-dir", str(hf)], capsys)
    assert "lack 1 tensor(s)" in error and "model.layers.1.self_attn.k_proj.weight" in error
    config = _json(hf / "config.json")
    with open(hf / "config.json", "w") as f:  # transformers' Llama never rotates part of a head
        json.dump({**config, "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": 0.5}}, f)
    error = _one_line_error([*argv, "--load-dir", str(hf)], capsys)
    assert "llama with partial_rotary_factor 0.5 cannot be converted" in error, error
    with open(hf / "config.json", "w") as f:
        json.dump(config, f)
    os.remove(hf / "model.safetensors")
    torch.save({"model.embed_tokens.weight": _Gadget()}, hf / "pytorch_model.bin")
    assert "unpickling it could run code" in _one_line_error([*argv, "--load-dir", str(hf)], capsys)
    assert not (tmp_path / "out").exists()


def test_a_bad_max_shard_size_is_one_line(converted, tmp_path, capsys):
    error = _one_line_error(["--model-type", "GPT", "--loader", "hf", "--saver", "hf", "--load-dir",
                             str(converted["llama-gqa"][0]), "--save-dir", str(tmp_path / "out"),
                             "--max-shard-size", "5 apples"], capsys)
    assert error == "convert.py: error: --max-shard-size '5 apples': not a size (examples: 5GB, 500MB, 10KB, 1000000)"
    assert not os.listdir(tmp_path)


def test_a_swapped_query_and_key_in_the_saver_is_refused(converted, tmp_path, monkeypatch, capsys):
    source, _, _ = converted["llama-gqa"]
    break_hf_saver_rule(monkeypatch, saver_hf, "decoder.layers.1.self_attention.linear_qkv.weight",
                        first_query_and_key_heads_swapped(HIDDEN // HEADS))  # group 0's key head
    with pytest.raises(convert.ConversionError, match="logits differ"):
        run_convert(source, tmp_path / "swapped", "hf", "hf")
    assert "MISMATCH" in capsys.readouterr().out
    assert not (tmp_path / "swapped").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".swapped")]


# ----------------------------------------------------------------------------- pretrain_gpt.py --load-hf

TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--lr", "0", "--seed", "1234",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--seq-length", "16",
         "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1"]
LLAMA_FLAGS = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
               "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", str(FFN), "--swiglu",
               "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--position-embedding-type", "rope",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear",
               "--max-position-embeddings", str(POSITIONS), "--hidden-dropout", "0", "--attention-dropout", "0"]


def test_load_hf_at_tp2_trains_from_the_converted_models_loss_and_saves(converted, tmp_path):
    """--load-hf at TP = 2 (2 gloo processes) logs the first loss of the converted checkpoint run at
    TP = 1 with --load --finetune; with --lr 0 the checkpoint it saves holds the HF weights."""
    from tests.helpers.launch import run_cli, torchrun
    from tests.helpers.training import logged_losses

    source = converted["llama-gqa"][0]
    saved = tmp_path / "saved"
    direct = torchrun(2, ["--load-hf", str(source), "--tensor-model-parallel-size", "2", *TRAIN,
                          "--save", str(saved), "--save-interval", "1", "--ckpt-format", "torch"])
    assert direct.returncode == 0, direct.stderr[-3000:]
    tp1 = tmp_path / "tp1"
    run_convert(source, tp1, "hf", "megatron", "--no-verify")
    first = run_cli(["pretrain_gpt.py", *LLAMA_FLAGS, *TRAIN, "--load", str(tp1), "--finetune",
                     "--ckpt-format", "torch"])  # the converter writes the torch format
    assert first.returncode == 0, first.stderr[-3000:]
    loss, expected = logged_losses(direct.stdout)[1], logged_losses(first.stdout)[1]
    assert abs(loss - expected) <= 1e-5 * abs(expected), (loss, expected)
    # What --save wrote reads back (checksums checked) as the HF model's weights, vocabulary padded for TP = 2.
    written = megatron_format.open_source(str(saved))
    assert (written.iteration, written.tp, written.args.padded_vocab_size) == (1, 2, 256)
    _, hf_tensors = loader_hf.load_checkpoint(argparse.Namespace(load_dir=str(source)))
    expected_tensors = dict(hf_tensors)
    got = dict(megatron_format.read_tensors(written))
    assert sorted(got) == sorted(expected_tensors)
    for name, tensor in got.items():
        assert torch.equal(tensor[:VOCAB], expected_tensors[name][:VOCAB]), name


def test_load_hf_refuses_a_flag_that_disagrees_with_the_hf_config(converted):
    from megatron.training.arguments import parse_args
    from megatron.training.load_hf import apply_hf_args

    source = str(converted["llama-gqa"][0])
    argv = ["--load-hf", source, "--num-layers", "3", "--swiglu", "--hidden-dropout", "0.2", *TRAIN]
    with pytest.raises(CheckpointError) as error:
        apply_hf_args(parse_args(argv=argv), argv)
    assert str(error.value) == (f"--load-hf {source}: the HF config gives --num-layers {LAYERS} but the command line "
                                "has --num-layers 3 (leave the flag out to take the HF config's)")
    argv = ["--load-hf", source, "--swiglu", "--hidden-dropout", "0.2", "--tensor-model-parallel-size", "2", *TRAIN]
    args = parse_args(argv=argv)
    apply_hf_args(args, argv)  # flags that agree, and dropout (the run's choice), are kept; the rest filled in
    assert (args.num_layers, args.num_query_groups, args.normalization, args.hidden_dropout) == (LAYERS, 2, "RMSNorm", 0.2)
    assert args.untie_embeddings_and_output_weights and not args.add_bias_linear and args.padded_vocab_size == 256


@pytest.mark.parametrize("name", list(MODELS))
def test_a_config_built_from_our_args_gives_the_same_model(converted, name, tmp_path):
    """A checkpoint without the source's config.json (trained here): saver_hf builds one from our args."""
    source = converted[name][0]
    meta, tensors = loader_hf.load_checkpoint(argparse.Namespace(load_dir=str(source)))
    meta.args.hf_config = meta.args.hf_generation_config = None
    out = tmp_path / "out"
    out.mkdir()
    saver_hf.save_checkpoint(meta, tensors, argparse.Namespace(max_shard_size="5GB", tokenizer_dir=None,
                                                               loader="megatron", load_dir=None), str(out))
    written, original = _json(out / "config.json"), _json(source / "config.json")
    # Our attention has no sliding window: a Mistral we trained is a Llama.
    expected = "llama" if original["model_type"] == "mistral" else original["model_type"]
    assert written["model_type"] == expected
    if "rope_parameters" in original:  # the same RoPE, Llama 3.1's scaling included
        assert written["rope_parameters"] == original["rope_parameters"]
    assert torch.equal(_hf_logits(out), _hf_logits(source))
