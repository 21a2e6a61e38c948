"""tools/checkpoint/convert.py with a tiny random HF MixtralForCausalLM (4 experts, top-2).

HF -> ours at TP = 1 computes HF's logits; HF -> ours at TP = 2, PP = 2, EP = 2 -> HF gives the
source back bit for bit; our files at EP > 1 are Megatron's mp_rank_TT[_PPP]_EEE with the local
experts of each EP rank (megatron/convert/expert_files.py); in 4 gloo processes, each rank of TP = 2
EP = 2 and of EP = 4 loads its own file strictly into the MoE GPTModel and the logits are HF's.
"""

import argparse
import json
import os

import pytest
import torch

from megatron.training.checkpoint_safety import load_file
from megatron.training.checkpointing import get_checkpoint_name
from megatron.convert import huggingface, megatron_format, verify
from tests.helpers.convert import run_convert
from tests.parallel.harness import DistributedPool, init_parallel
from tools.checkpoint import convert, loader_hf, loader_megatron, saver_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS, EXPERTS, TOPK, POSITIONS = 300, 64, 4, 2, 96, 2, 4, 2, 64
BATCH = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))


def _config():
    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, num_local_experts=EXPERTS,
        num_experts_per_tok=TOPK, max_position_embeddings=POSITIONS, bos_token_id=0, eos_token_id=1)


def _hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(BATCH).logits


def _close(ours, theirs):
    return (ours[..., :VOCAB] - theirs).abs().max().item() <= 1e-5 * max(1.0, theirs.abs().max().item())


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(the HF model, its directory (per-expert files), the same saved with fused experts)."""
    root = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config()).eval()
    with torch.no_grad():  # norms away from 1, so that a mix-up shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(root / "hf")
    model.save_pretrained(root / "hf-fused", save_original_format=False)  # transformers 5's own names
    return model, root / "hf", root / "hf-fused"


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    """name -> our checkpoint (or HF directory) converted from the HF model."""
    _, hf, fused = hf_model
    root = tmp_path_factory.mktemp("converted")
    out = {name: root / name for name in ("tp1", "tp2pp2ep2", "back", "ep2", "ep4", "ep2-etp1")}
    run_convert(hf, out["tp1"], "hf", "megatron")
    run_convert(fused, out["tp2pp2ep2"], "hf", "megatron", "--target-tensor-parallel-size", "2",
                "--target-pipeline-parallel-size", "2", "--target-expert-parallel-size", "2")
    run_convert(out["tp2pp2ep2"], out["back"], "megatron", "hf")
    run_convert(out["tp1"], out["ep2"], "megatron", "megatron", "--target-tensor-parallel-size", "2",
                "--target-expert-parallel-size", "2")
    run_convert(out["ep2"], out["ep4"], "megatron", "megatron", "--target-tensor-parallel-size", "1",
                "--target-expert-parallel-size", "4")
    run_convert(out["ep2"], out["ep2-etp1"], "megatron", "megatron", "--target-expert-tensor-parallel-size", "1")
    return out


def test_the_file_names_are_per_expert_and_the_fused_ones_are_read(hf_model):
    _, hf, fused = hf_model
    names = set(safetensors_torch.load_file(str(hf / "model.safetensors")))
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names
    one, two = (dict(loader_hf.load_checkpoint(argparse.Namespace(load_dir=str(d)))[1]) for d in (hf, fused))
    assert sorted(one) == sorted(two) and all(torch.equal(one[k], two[k]) for k in one)
    assert one["decoder.layers.0.mlp.router.weight"].shape == (EXPERTS, HIDDEN)
    assert one["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (2 * FFN, HIDDEN)


def test_our_tp1_model_gives_hfs_logits(hf_model, converted):
    model, _, _ = hf_model
    meta, tensors = loader_megatron.load_checkpoint(argparse.Namespace(load_dir=str(converted["tp1"])))
    assert (meta.args.num_experts, meta.args.moe_router_topk, meta.args.moe_ffn_hidden_size) == (EXPERTS, TOPK, FFN)
    assert not meta.args.moe_router_pre_softmax  # softmax over the top-k logits = HF's renormalised top-k
    ours = verify.logits_of(verify.build_serial_model(meta.args, tensors), BATCH)
    with torch.no_grad():
        theirs = model(BATCH).logits
    assert _close(ours, theirs)


def test_hf_to_tp2_pp2_ep2_to_hf_is_bit_identical(hf_model, converted):
    _, hf, _ = hf_model
    back = converted["back"]
    assert sorted(os.listdir(back)) == ["config.json", "generation_config.json", "model.safetensors"]
    with open(back / "config.json") as a, open(hf / "config.json") as b:
        assert json.load(a) == json.load(b)
    a = safetensors_torch.load_file(str(hf / "model.safetensors"))
    b = safetensors_torch.load_file(str(back / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert not [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    assert torch.equal(_hf_logits(back), _hf_logits(hf))


def test_ep_files_use_megatrons_names_and_hold_their_local_experts(hf_model, converted):
    _, hf, _ = hf_model
    ours = converted["tp2pp2ep2"]
    base = get_checkpoint_name(str(ours), 0, release=True, return_base_dir=True)
    expected = sorted(f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2))
    assert sorted(d for d in os.listdir(base) if d.startswith("mp_rank")) == expected
    w = safetensors_torch.load_file(str(hf / "model.safetensors"))
    for t in range(2):
        for e in range(2):
            path = get_checkpoint_name(str(ours), 0, release=True, pipeline_parallel=True, tensor_rank=t,
                                       pipeline_rank=1, expert_parallel=True, expert_rank=e)
            state = load_file(path)
            assert (state["args"].expert_model_parallel_size, state["args"].expert_tensor_parallel_size) == (2, 2)
            model = state["model"]  # stage 1 holds layer 1 as its local layer 0
            experts = sorted({k.split(".")[6] for k in model if ".local_experts." in k})
            assert experts == ["0", "1"]
            assert torch.equal(model["decoder.layers.0.mlp.router.weight"],
                               w["model.layers.1.block_sparse_moe.gate.weight"])
            for i in range(2):  # global expert e * 2 + i, its rows [gate_t; up_t] of ETP rank t
                theirs = f"model.layers.1.block_sparse_moe.experts.{e * 2 + i}."
                rows = slice(t * FFN // 2, (t + 1) * FFN // 2)
                gate_up = torch.cat([w[theirs + "w1.weight"][rows], w[theirs + "w3.weight"][rows]])
                local = f"decoder.layers.0.mlp.experts.local_experts.{i}."
                assert torch.equal(model[local + "linear_fc1.weight"], gate_up)
                assert torch.equal(model[local + "linear_fc2.weight"], w[theirs + "w2.weight"][:, rows])


def test_expert_tensor_parallel_1_at_tp2_keeps_whole_experts_in_every_file(converted):
    out = converted["ep2-etp1"]
    source = megatron_format.open_source(str(out))
    assert (source.tp, source.experts.ep, source.experts.etp) == (2, 2, 1)
    for t in range(2):
        model = load_file(get_checkpoint_name(str(out), 0, release=True, pipeline_parallel=False, tensor_rank=t,
                                              pipeline_rank=0, expert_parallel=True, expert_rank=1))["model"]
        assert model["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"].shape == (2 * FFN, HIDDEN)
    tensors = dict(megatron_format.read_tensors(source))
    expected = dict(megatron_format.read_tensors(megatron_format.open_source(str(converted["tp1"]))))
    assert sorted(tensors) == sorted(expected)
    assert all(torch.equal(tensors[k][:VOCAB], expected[k][:VOCAB]) for k in expected)


def test_targets_the_experts_do_not_split_into_are_refused(converted, tmp_path, capsys):
    for flags, message in ((["--target-expert-parallel-size", "3"], "4 experts do not split over 3 EP ranks"),
                           (["--target-tensor-parallel-size", "1", "--target-expert-tensor-parallel-size", "2"],
                            "does not divide the TP size 1")):
        with pytest.raises(SystemExit):
            convert.cli(["--model-type", "GPT", "--load-dir", str(converted["ep2"]), "--save-dir",
                         str(tmp_path / "out"), *flags])
        assert message in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_a_config_built_from_our_args_is_mixtral(hf_model, tmp_path):
    _, hf, _ = hf_model
    meta, tensors = loader_hf.load_checkpoint(argparse.Namespace(load_dir=str(hf)))
    meta.args.hf_config = meta.args.hf_generation_config = None  # as if trained here
    meta.args.ffn_hidden_size = 4 * HIDDEN  # the dense size a run leaves at its default: unused, every layer is MoE
    saver_hf.save_checkpoint(meta, tensors, argparse.Namespace(max_shard_size="5GB", tokenizer_dir=None,
                                                               loader="megatron", load_dir=None), str(tmp_path))
    with open(tmp_path / "config.json") as f:
        written = json.load(f)
    assert (written["model_type"], written["num_local_experts"], written["num_experts_per_tok"]) == \
        ("mixtral", EXPERTS, TOPK)
    assert torch.equal(_hf_logits(tmp_path), _hf_logits(hf))


def test_state_dict_mapping_takes_and_gives_the_modules_fused_names(hf_model):
    model, _, _ = hf_model
    hf = model.state_dict()
    ours = huggingface.state_dict_from_hf(hf, model.config)
    assert "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight" in ours
    back = huggingface.state_dict_to_hf(ours, model.config)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


# ----------------------------------------------------------------------------- multi-process


def _rank_logits(checkpoint, ep, etp, tokens, hf_dir=None):
    """Task (4 ranks, PP = 1): this rank's file of our checkpoint loaded strictly; the whole logits.
    With hf_dir: --load-hf's weights of this rank (megatron/training/load_hf.py) must be the file's."""
    from megatron.training.arguments import core_transformer_config_from_args, gpt_model_kwargs
    from megatron.core import parallel_state, tensor_parallel
    from megatron.model import GPTModel

    init_parallel(tp=4 // ep, ep=ep, etp=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)  # the trackers sequence parallelism forks (dropout 0)
    state = load_file(get_checkpoint_name(str(checkpoint), 0, release=True))  # this rank's file (parallel_state)
    args = state["args"]
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (ep, etp or 4 // ep)
    assert parallel_state.get_expert_model_parallel_world_size() == ep
    args.hidden_dropout = args.attention_dropout = 0.0
    model = GPTModel(core_transformer_config_from_args(args), vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, parallel_output=False,
                     share_embeddings_and_output_weights=False, **gpt_model_kwargs(args))
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    if hf_dir is not None:  # pretrain_gpt.py --load-hf's reader fills a fresh model with the same tensors
        from megatron.training.load_hf import load_hf_weights

        fresh = GPTModel(core_transformer_config_from_args(args), vocab_size=args.padded_vocab_size,
                         max_sequence_length=args.max_position_embeddings, parallel_output=False,
                         share_embeddings_and_output_weights=False, **gpt_model_kwargs(args))
        args.load_hf = hf_dir
        load_hf_weights([fresh], args, VOCAB)
        assert all(torch.equal(t, state["model"][k]) for k, t in fresh.state_dict().items()), "--load-hf"
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))  # [b, s, padded vocab]


def test_each_rank_at_tp2_ep2_etp2_or_1_and_at_ep4_loads_its_file_and_gives_hfs_logits(hf_model, converted):
    model, hf, _ = hf_model
    with torch.no_grad():
        theirs = model(BATCH).logits
    pool = DistributedPool(4)
    try:
        for name, ep, etp in (("ep2", 2, None), ("ep4", 4, None), ("ep2-etp1", 2, 1)):
            for logits in pool.run(_rank_logits, str(converted[name]), ep, etp, BATCH, str(hf)):
                assert _close(logits, theirs), name
    finally:
        pool.close()


def test_llama31_rope_scaling_converts_both_ways(tmp_path):
    """A Mixtral with Llama 3.1's RoPE (the converter once refused it): HF -> ours -> HF is bit-identical,
    ours computes HF's logits, and a config built from our args keeps the scaling."""
    from tests.helpers.convert import llama31_rope, save_hf

    config = _config()
    config.rope_parameters = llama31_rope()
    save_hf(config, tmp_path / "hf", query_key_scale=20.0)  # sharp attention: the scaling shows in the logits
    run_convert(tmp_path / "hf", tmp_path / "ours", "hf", "megatron")
    run_convert(tmp_path / "ours", tmp_path / "back", "megatron", "hf")
    theirs = _hf_logits(tmp_path / "hf")
    meta, tensors = loader_megatron.load_checkpoint(argparse.Namespace(load_dir=str(tmp_path / "ours")))
    assert (meta.args.use_rope_scaling, meta.args.rope_scaling_factor) == (True, 8.0)
    assert _close(verify.logits_of(verify.build_serial_model(meta.args, tensors), BATCH), theirs)
    a = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    b = safetensors_torch.load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    with open(tmp_path / "hf" / "config.json") as f, open(tmp_path / "back" / "config.json") as g:
        source = json.load(f)
        assert json.load(g) == source
    meta, tensors = loader_hf.load_checkpoint(argparse.Namespace(load_dir=str(tmp_path / "hf")))
    meta.args.hf_config = meta.args.hf_generation_config = None  # as if trained here
    (tmp_path / "built").mkdir()
    saver_args = argparse.Namespace(max_shard_size="5GB", tokenizer_dir=None, loader="megatron", load_dir=None)
    saver_hf.save_checkpoint(meta, tensors, saver_args, str(tmp_path / "built"))
    with open(tmp_path / "built" / "config.json") as f:
        assert json.load(f)["rope_parameters"] == source["rope_parameters"]
    assert torch.equal(_hf_logits(tmp_path / "built"), theirs)
    plain = transformers.AutoConfig.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    unscaled = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), config=plain,
                                                                 local_files_only=True).eval()
    with torch.no_grad():
        assert (unscaled(BATCH).logits - theirs).abs().max().item() > 50 * 1e-5
