"""Megatron-LM's own torch_dist checkpoints: megatron-core 0.16.1 saves a llama-like GPT at TP 2 x PP 2
with dist_checkpointing.save (and a common state like Megatron-LM's save_checkpoint), convert.py
--loader mcore reads it and our model gives megatron-core's logits; the same for a Mixtral-like MoE
GPT at TP 2 x PP 2 x EP 2 (SequentialMLP experts, a shared expert). A hybrid "M*-" MambaModel, which
megatron-core cannot run on CPU, is saved as torch_dist and as torch files, and both convert to the
same tensors (SAVE_HYBRID says how it is built without mamba_ssm).

megatron-core's save on CPU needs two patches (in the snippet): torch.cuda.synchronize is made a no-op
(filesystem_async.preload_tensors calls it) and filesystem_async._process_memory returns 0 (it needs psutil).
"""

import json

import pytest
import torch

from megatron.training.checkpoint_safety import CheckpointError
from megatron.convert import verify
from tests.helpers.convert import legacy_args
from tests.helpers.mcore_reference import run_mcore
from tools.checkpoint import convert, saver_megatron

TOKENS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]

# Both snippets start their workers the same way. A worker that fails puts its error on the queue, so
# the queue's timeout only guards against a hang (a generous bound, not a timing assumption).
LAUNCH = r'''import multiprocessing as mp
ctx = mp.get_context("fork")
queue = ctx.Queue()
rendezvous = tempfile.mktemp(prefix="mcore-pg-")
world = CFG["world"]
procs = [ctx.Process(target=worker, args=(r, world, rendezvous, CFG, OUT, queue)) for r in range(world)]
for p in procs: p.start()
HANG = 900
'''

SAVE = r'''
import argparse, json, os, sys, tempfile
import torch, torch.nn.functional as F
CFG = json.loads(os.environ["CFG"])
OUT = os.environ["OUTDIR"]

def worker(rank, world, rendezvous, cfg, out, queue):
    try:
        _worker(rank, world, rendezvous, cfg, out, queue)
    except BaseException as error:
        import traceback; traceback.print_exc(); queue.put(repr(error)); raise


def _worker(rank, world, rendezvous, cfg, out, queue):
    patch_for_cpu()
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    filesystem_async._process_memory = lambda: 0  # a log line's memory reading needs psutil, not installed here
    torch.cuda.synchronize = lambda *a, **k: None  # filesystem_async.preload_tensors calls it; nothing to wait for on CPU
    from megatron.core import parallel_state, dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.distributed.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=world)
    a = argparse.Namespace(**cfg["args"])
    a.params_dtype = torch.float32
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    moe = cfg.get("moe", {})  # TransformerConfig's MoE fields (the experts' EP / ETP among them)
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=moe.get("expert_model_parallel_size", 1),
                                             expert_tensor_parallel_size=moe.get("expert_tensor_parallel_size"))
    model_parallel_cuda_manual_seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups if a.group_query_attention else None,
        ffn_hidden_size=a.ffn_hidden_size, kv_channels=a.kv_channels, normalization=a.normalization,
        layernorm_epsilon=a.norm_epsilon, add_bias_linear=a.add_bias_linear, gated_linear_unit=a.swiglu,
        activation_func=F.silu if a.swiglu else F.gelu, hidden_dropout=0.0, attention_dropout=0.0,
        apply_rope_fusion=False, bias_activation_fusion=False, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, **moe)
    if moe:  # SequentialMLP experts (no grouped GEMM without TE)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=a.normalization)
    else:
        spec = get_gpt_layer_local_spec(normalization=a.normalization)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    model = GPTModel(config, spec, vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
                     position_embedding_type=a.position_embedding_type, pre_process=first, post_process=last,
                     share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights).eval()
    with torch.no_grad():  # norms away from 1 / 0, so a norm mapped to the wrong place shows
        for key, param in model.named_parameters():
            if "norm" in key or key.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.3)
    if pp > 1 and not a.untie_embeddings_and_output_weights:
        raise SystemExit("tied embeddings at PP > 1 need the embedding group's all-reduce")
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    for folder, metadata in cfg.get("saves", [[".", None]]):  # (subfolder, sharded_state_dict's metadata)
        state = {"args": a, "checkpoint_version": 3.0, "iteration": 7,
                 "model": model.sharded_state_dict(metadata=metadata),
                 "num_floating_point_operations_so_far": 0.0, "opt_param_scheduler": {"num_steps": 7}}
        state["rng_state"] = ShardedObject("rng_state", [{"random_rng_state": torch.get_rng_state()}], (pp, tp),
                                           (parallel_state.get_pipeline_model_parallel_rank(),
                                            parallel_state.get_tensor_model_parallel_rank()),
                                           replica_id=parallel_state.get_data_parallel_rank())
        base = os.path.join(out, folder, "iter_0000007")
        if rank == 0:
            os.makedirs(base, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(state, base)
        if rank == 0:
            with open(os.path.join(out, folder, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("7")
    # logits on the fixed batch: the stages run in turn (PP) by sending activations
    tokens = torch.tensor(cfg["tokens"])
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        if not first:
            hidden = torch.empty(tokens.shape[1], tokens.shape[0], a.hidden_size)
            torch.distributed.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        output = model(tokens, positions, None)
        if not last:
            torch.distributed.send(output.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
    if last and parallel_state.get_data_parallel_rank() == 0:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        logits = gather_from_tensor_model_parallel_region(output)
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            queue.put(logits.tolist())
    torch.distributed.barrier()

''' + LAUNCH + r'''logits = queue.get(timeout=HANG)
assert isinstance(logits, list), logits
for p in procs:
    p.join()
    assert p.exitcode == 0, p.exitcode
emit(logits)
'''


@pytest.fixture(scope="module")
def llama_tp2_pp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("mcore_dist") / "llama"
    args = legacy_args("llama")
    raw = {k: v for k, v in vars(args).items() if isinstance(v, (type(None), bool, int, float, str))}
    raw.update(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, world_size=4,
               transformer_impl="local", use_legacy_models=False, ckpt_format="torch_dist")
    cfg = {"args": raw, "seed": 5, "world": 4, "tokens": TOKENS}
    logits = run_mcore(SAVE, env={"CFG": json.dumps(cfg), "OUTDIR": str(out)})
    return out, torch.tensor(logits)


# a Mixtral-like MoE: every layer MoE (so the experts are one global tensor [layers, experts, ...]), 4
# SequentialMLP experts, top-2, a shared expert; experts over EP 2 at ETP 1 beside the dense TP 2, PP 2
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24, "moe_shared_expert_intermediate_size": 16,
       "moe_layer_freq": 1, "moe_aux_loss_coeff": 0.0, "moe_token_dispatcher_type": "alltoall",
       "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}


# the model saved three ways: Megatron-LM's default (every layer in one tensor, [layers, experts, ...]
# for the experts), one key per layer ([experts, ...]), and singleton_local_shards (one key per layer
# and expert, fc1's gate and up halves apart: ..experts.experts.<e>.linear_fc1.weight_w / _v)
MOE_SAVES = [["stacked", None], ["per_layer", {"non_homogeneous_layers": True}],
             ["singleton", {"singleton_local_shards": True}]]


@pytest.fixture(scope="module")
def moe_tp2_pp2_ep2(tmp_path_factory):
    out = tmp_path_factory.mktemp("mcore_dist") / "moe"
    args = legacy_args("llama")
    raw = {k: v for k, v in vars(args).items() if isinstance(v, (type(None), bool, int, float, str))}
    raw.update(MOE, num_layers=2, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, world_size=4,
               transformer_impl="local", use_legacy_models=False, ckpt_format="torch_dist")
    moe = {"num_moe_experts" if k == "num_experts" else k: v for k, v in MOE.items()}
    cfg = {"args": raw, "seed": 6, "world": 4, "tokens": TOKENS, "moe": moe, "saves": MOE_SAVES}
    logits = run_mcore(SAVE, env={"CFG": json.dumps(cfg), "OUTDIR": str(out)})
    return out, torch.tensor(logits)


def _converted_logits(load_dir, save_dir, capsys):
    convert.main(["--model-type", "GPT", "--loader", "mcore", "--saver", "megatron", "--load-dir", str(load_dir),
                  "--save-dir", str(save_dir), "--target-tensor-parallel-size", "1",
                  "--target-pipeline-parallel-size", "1"])
    assert "-> OK" in capsys.readouterr().out
    target_args, tensors = saver_megatron.read_back(str(save_dir))
    return verify.logits_of(verify.build_serial_model(target_args, tensors), torch.tensor(TOKENS))


@pytest.mark.parametrize("saved", [folder for folder, _ in MOE_SAVES])
def test_megatron_lm_moe_torch_dist_converts_to_megatron_core_logits(moe_tp2_pp2_ep2, saved, tmp_path, capsys):
    from megatron.convert.mcore_dist import MegatronLMDist
    from megatron.dist_checkpointing import read_dcp_metadata

    load_dir, reference = moe_tp2_pp2_ep2[0] / saved, moe_tp2_pp2_ep2[1]
    base = load_dir / "iter_0000007"
    fc1 = {"stacked": [("decoder.layers.mlp.experts.experts.linear_fc1.weight", [2, 4, 48, 32])],
           "per_layer": [("decoder.layers.1.mlp.experts.experts.linear_fc1.weight", [4, 48, 32])],
           "singleton": [(f"decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_{h}", [24, 32]) for h in "wv"]}
    stored = read_dcp_metadata(str(base / ".metadata")).state_dict_metadata
    assert [list(stored[key].size) for key, _ in fc1[saved]] == [shape for _, shape in fc1[saved]]
    names = MegatronLMDist(str(base)).names()
    experts = [n for n in names if n.startswith("decoder.layers.1.mlp.experts.")]
    assert experts == [f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc{fc}.weight"
                       for e in range(4) for fc in (1, 2)]
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in names
    assert "decoder.layers.1.mlp.router.weight" in names
    torch.testing.assert_close(_converted_logits(load_dir, tmp_path / "ours", capsys), reference,
                               rtol=1e-5, atol=1e-5)


def test_megatron_lm_torch_dist_converts_to_megatron_core_logits(llama_tp2_pp2, tmp_path, capsys):
    load_dir, reference = llama_tp2_pp2
    torch.testing.assert_close(_converted_logits(load_dir, tmp_path / "ours", capsys), reference,
                               rtol=1e-5, atol=1e-5)


def test_damaged_piece_is_one_line(llama_tp2_pp2, tmp_path):
    import shutil

    from megatron.convert.mcore_dist import MegatronLMDist

    copy = tmp_path / "copy"
    shutil.copytree(llama_tp2_pp2[0], copy)
    base = copy / "iter_0000007"
    (base / "__0_0.distcp").write_bytes(b"not a DCP piece")
    with pytest.raises(CheckpointError, match="cannot read") as error:
        dict(MegatronLMDist(str(base)).tensors())
    assert "\n" not in str(error.value)
    (base / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"\.metadata .*nothing from the file was run") as error:
        MegatronLMDist(str(base))
    assert "\n" not in str(error.value)


# A hybrid "M*-" MambaModel at TP 2, saved twice: as torch_dist and as Megatron-LM's torch format
# (each rank's model.state_dict() in iter_0000007/mp_rank_0T/model_optim_rng.pt). megatron-core's Mamba
# needs mamba_ssm / causal_conv1d / einops, none of them here, only in its forward and its gated norm's class:
# the snippet builds the mixer with a stand-in for mamba_ssm's gated RMSNorm (a weight, sharded as
# megatron-core's ExtendedRMSNorm shards it) and saves without running the model, so there are no
# megatron-core logits; the torch_dist folder must convert to the same tensors (and logits) as the
# torch files, which --loader mcore reads per TP rank.
SAVE_HYBRID = r'''
import argparse, json, os, tempfile
import torch
CFG = json.loads(os.environ["CFG"])
OUT = os.environ["OUTDIR"]


def worker(rank, world, rendezvous, cfg, out, queue):
    try:
        _worker(rank, world, rendezvous, cfg, out)
        queue.put("ok")
    except BaseException as error:
        import traceback; traceback.print_exc(); queue.put(repr(error)); raise


class GatedNorm(torch.nn.Module):  # mamba_ssm.ops.triton.layernorm_gated.RMSNorm's parameters, no kernel
    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):  # as ExtendedRMSNorm's
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=metadata["dp_cp_group"])


def _worker(rank, world, rendezvous, cfg, out):
    patch_for_cpu()
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    filesystem_async._process_memory = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.ssm import mamba_mixer
    from megatron.core.ssm import mamba_context_parallel
    mamba_mixer.HAVE_MAMBA_SSM = mamba_mixer.HAVE_EINOPS = mamba_context_parallel.HAVE_EINOPS = True  # the forward uses them
    mamba_mixer.RMSNormGated = mamba_mixer.ExtendedRMSNorm = GatedNorm
    from megatron.core import parallel_state, dist_checkpointing
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, model_parallel_cuda_manual_seed
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    torch.distributed.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=world)
    a = argparse.Namespace(**cfg["args"])
    a.params_dtype = torch.float32
    tp = a.tensor_model_parallel_size
    parallel_state.initialize_model_parallel(tp)
    model_parallel_cuda_manual_seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size, kv_channels=a.kv_channels,
        normalization=a.normalization, layernorm_epsilon=a.norm_epsilon, add_bias_linear=False, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, hidden_dropout=0.0, attention_dropout=0.0,
        mamba_state_dim=a.mamba_state_dim, mamba_head_dim=a.mamba_head_dim, mamba_num_groups=a.mamba_num_groups,
        bias_activation_fusion=False, use_cpu_initialization=True, tensor_model_parallel_size=tp)
    # the local spec's modules, saved under the Transformer Engine spec's fused norm names (mamba_stack_spec's)
    gpt = get_gpt_layer_local_spec(normalization=a.normalization).submodules
    norm = gpt.input_layernorm
    from megatron.core.ssm import mamba_block
    mamba_block.TENorm = norm  # the stack's final norm is TENorm, whatever the spec: the local norm without TE
    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=norm, mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add, sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"}))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=gpt.self_attention, self_attn_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=norm, mlp=gpt.mlp, mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}))
    spec = ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=mamba, attention_layer=attention, mlp_layer=mlp))
    model = MambaModel(config, spec, vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
                       hybrid_override_pattern=a.hybrid_override_pattern, position_embedding_type="none",
                       share_embeddings_and_output_weights=False).eval()
    with torch.no_grad():  # norms away from 1, so a norm mapped to the wrong place shows
        for key, param in model.named_parameters():
            if "norm" in key:
                param.add_(torch.randn_like(param) * 0.3)
    common = {"args": a, "checkpoint_version": 3.0, "iteration": 7}
    for fmt in ("torch", "torch_dist"):
        os.makedirs(os.path.join(out, fmt, "iter_0000007"), exist_ok=True)
        with open(os.path.join(out, fmt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("7")
    torch.distributed.barrier()
    folder = os.path.join(out, "torch", "iter_0000007", f"mp_rank_{rank:02d}")
    os.makedirs(folder)
    torch.save({**common, "model": model.state_dict()}, os.path.join(folder, "model_optim_rng.pt"))
    a.ckpt_format = "torch_dist"
    dist_checkpointing.save({**common, "model": model.sharded_state_dict()}, os.path.join(out, "torch_dist", "iter_0000007"))
    torch.distributed.barrier()

''' + LAUNCH + r'''results = [queue.get(timeout=HANG) for _ in procs]
for p in procs:
    p.join()
    assert p.exitcode == 0, p.exitcode
emit(results)
'''

HYBRID = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
          "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--hybrid-override-pattern", "M*-",
          "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2", "--normalization", "RMSNorm",
          "--disable-bias-linear", "--swiglu", "--position-embedding-type", "none", "--group-query-attention",
          "--num-query-groups", "2", "--ffn-hidden-size", "48", "--untie-embeddings-and-output-weights",
          "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def hybrid_tp2(tmp_path_factory):
    from megatron.training.arguments import parse_and_validate_args

    out = tmp_path_factory.mktemp("mcore_dist") / "hybrid"
    args = parse_and_validate_args(argv=HYBRID)
    raw = {k: v for k, v in vars(args).items() if isinstance(v, (type(None), bool, int, float, str))}
    raw.update(padded_vocab_size=256, tensor_model_parallel_size=2, pipeline_model_parallel_size=1, world_size=2,
               transformer_impl="local", use_legacy_models=False, ckpt_format="torch", is_hybrid_model=True)
    cfg = {"args": raw, "seed": 7, "world": 2}
    assert run_mcore(SAVE_HYBRID, env={"CFG": json.dumps(cfg), "OUTDIR": str(out)}) == ["ok", "ok"]
    return out


def _torch_files(load_dir):
    """The whole tensors --loader mcore reads from Megatron-LM's torch files (per TP rank) in load_dir."""
    import argparse

    from tools.checkpoint import loader_core

    parser = argparse.ArgumentParser()
    loader_core.add_arguments(parser)
    args = parser.parse_args([])
    args.load_dir, args.model_type = str(load_dir), "GPT"
    return dict(loader_core.load_checkpoint(args)[1])


def test_megatron_lm_hybrid_torch_dist_converts_as_its_torch_files(hybrid_tp2, tmp_path, capsys):
    from megatron.convert.mcore_dist import MegatronLMDist

    names = MegatronLMDist(str(hybrid_tp2 / "torch_dist" / "iter_0000007")).names()
    assert "decoder.layers.0.mixer.in_proj.weight" in names and "decoder.layers.0.norm.weight" in names
    _converted_logits(hybrid_tp2 / "torch_dist", tmp_path / "from_dist", capsys)  # convert.py verifies the logits
    _, from_dist = saver_megatron.read_back(str(tmp_path / "from_dist"))
    from_dist, from_torch = dict(from_dist), _torch_files(hybrid_tp2 / "torch")
    assert list(from_dist) == list(from_torch)
    assert not [k for k in from_dist if not torch.equal(from_dist[k], from_torch[k])]


def test_incomplete_parts_and_a_wrong_expert_axis_are_one_line(hybrid_tp2, moe_tp2_pp2_ep2):
    from megatron.convert.mcore_dist import MegatronLMDist

    hybrid = MegatronLMDist(str(hybrid_tp2 / "torch_dist" / "iter_0000007"))
    del hybrid.metadata.state_dict_metadata["decoder.layers.0.mixer.in_proj.weight.dt"]
    with pytest.raises(CheckpointError, match=r"holds decoder\.layers\.0\.mixer\.in_proj\.weight\.z but not "
                                              r"decoder\.layers\.0\.mixer\.in_proj\.weight\.dt"):
        hybrid._scan()
    moe = MegatronLMDist(str(moe_tp2_pp2_ep2[0] / "stacked" / "iter_0000007"))
    moe.args.num_experts = 8
    with pytest.raises(CheckpointError, match=r"experts\.experts\.linear_fc1\.weight has shape \[2, 4, 48, 32\], "
                                              r"whose axis 1 is not the 8 experts"):
        moe._scan()
