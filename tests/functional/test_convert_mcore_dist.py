"""Megatron-LM's own torch_dist checkpoints: megatron-core 0.16.1 saves a llama-like GPT at TP 2 x PP 2
with dist_checkpointing.save (and a common state like Megatron-LM's save_checkpoint), convert.py
--loader mcore reads it and our model gives megatron-core's logits.

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
    sharded = model.sharded_state_dict(metadata=cfg.get("metadata"))
    state = {"args": a, "checkpoint_version": 3.0, "iteration": 7, "model": sharded,
             "num_floating_point_operations_so_far": 0.0, "opt_param_scheduler": {"num_steps": 7}}
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    state["rng_state"] = ShardedObject("rng_state", [{"random_rng_state": torch.get_rng_state()}], (pp, tp),
                                       (parallel_state.get_pipeline_model_parallel_rank(),
                                        parallel_state.get_tensor_model_parallel_rank()),
                                       replica_id=parallel_state.get_data_parallel_rank())
    base = os.path.join(out, "iter_0000007")
    if rank == 0:
        os.makedirs(base, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, base)
    if rank == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
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

import multiprocessing as mp
ctx = mp.get_context("fork")
queue = ctx.Queue()
rendezvous = tempfile.mktemp(prefix="mcore-pg-")
world = CFG["world"]
procs = [ctx.Process(target=worker, args=(r, world, rendezvous, CFG, OUT, queue)) for r in range(world)]
for p in procs: p.start()
logits = queue.get(timeout=60)
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


@pytest.fixture(scope="module")
def moe_tp2_pp2_ep2(tmp_path_factory):
    out = tmp_path_factory.mktemp("mcore_dist") / "moe"
    args = legacy_args("llama")
    raw = {k: v for k, v in vars(args).items() if isinstance(v, (type(None), bool, int, float, str))}
    raw.update(MOE, num_layers=2, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, world_size=4,
               transformer_impl="local", use_legacy_models=False, ckpt_format="torch_dist")
    moe = {"num_moe_experts" if k == "num_experts" else k: v for k, v in MOE.items()}
    cfg = {"args": raw, "seed": 6, "world": 4, "tokens": TOKENS, "moe": moe}
    logits = run_mcore(SAVE, env={"CFG": json.dumps(cfg), "OUTDIR": str(out)})
    return out, torch.tensor(logits)


def _converted_logits(load_dir, save_dir, capsys):
    convert.main(["--model-type", "GPT", "--loader", "mcore", "--saver", "megatron", "--load-dir", str(load_dir),
                  "--save-dir", str(save_dir), "--target-tensor-parallel-size", "1",
                  "--target-pipeline-parallel-size", "1"])
    assert "-> OK" in capsys.readouterr().out
    target_args, tensors = saver_megatron.read_back(str(save_dir))
    return verify.logits_of(verify.build_serial_model(target_args, tensors), torch.tensor(TOKENS))


def test_megatron_lm_moe_torch_dist_converts_to_megatron_core_logits(moe_tp2_pp2_ep2, tmp_path, capsys):
    load_dir, reference = moe_tp2_pp2_ep2
    from megatron.convert.mcore_dist import MegatronLMDist

    names = MegatronLMDist(str(load_dir / "iter_0000007")).names()
    experts = [n for n in names if n.startswith("decoder.layers.1.mlp.experts.")]
    assert experts == [f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc{fc}.weight"
                       for e in range(4) for fc in (1, 2)]
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in names
    assert "decoder.layers.1.mlp.router.weight" in names
    torch.testing.assert_close(_converted_logits(load_dir, tmp_path / "ours", capsys), reference,
                               rtol=1e-5, atol=1e-5)


def test_megatron_lm_torch_dist_converts_to_megatron_core_logits(llama_tp2_pp2, tmp_path, capsys):
    load_dir, reference = llama_tp2_pp2
    convert.main(["--model-type", "GPT", "--loader", "mcore", "--saver", "megatron", "--load-dir", str(load_dir),
                  "--save-dir", str(tmp_path / "ours"), "--target-tensor-parallel-size", "1",
                  "--target-pipeline-parallel-size", "1"])
    assert "-> OK" in capsys.readouterr().out
    target_args, tensors = saver_megatron.read_back(str(tmp_path / "ours"))
    model = verify.build_serial_model(target_args, tensors)
    ours = verify.logits_of(model, torch.tensor(TOKENS))
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


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
