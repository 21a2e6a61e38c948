"""`--loader mcore` and `--saver mcore` for MoE: Megatron-LM's own MoE checkpoints (`--ckpt-format torch`).

The fixture is a Megatron-LM MoE checkpoint of one of our seeded models, written by this test (not
by the code under test), as test_convert_legacy.py writes dense ones: the whole tensors cut per
rank with the layout rules, renamed with this file's own tables to megatron-core's names, and a
Megatron-LM-style args Namespace. The model has a dense layer, then an MoE layer with a shared
expert (--moe-layer-freq [0, 1]), so both kinds of layer of the TE spec are written (the dense one
fuses pre_mlp_layernorm into mlp.linear_fc1; the MoE one keeps it). Files are named per (TP rank,
EP rank) as Megatron-LM's get_checkpoint_name does, one for each pair some rank holds: a rank r
of a stage has TP rank r % TP and EP rank (r // ETP) % EP (megatron-core's expert grid), so with
ETP < TP not every pair has a file. The experts in each of megatron-core's three implementations:

    SequentialMLP  mlp.experts.local_experts.{i}.linear_fc1 / linear_fc2.weight  (i local to the EP rank)
    TEGroupedMLP   mlp.experts.linear_fc1.weight{i} / linear_fc2.weight{i}, one _extra_state per fc
    GroupedMLP     mlp.experts.weight1 = the memory of [E_local, h, F] (expert i's x @ w1[i], w1[i] =
                   its fc1 shard transposed) viewed as [h, E_local F]; weight2 = [E_local F, h] (w2[i] =
                   its fc2 shard transposed)

Every conversion runs convert.py's verification and is compared here with the original model's
logits; --saver mcore's local-spec output is loaded strictly into megatron-core 0.16.1's MoE
GPTModel (get_gpt_decoder_block_spec without TE), which gives our logits.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from megatron.training.arguments import core_transformer_config_from_args, gpt_model_kwargs, parse_and_validate_args
from megatron.training.checkpoint_safety import load_file
from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename
from megatron.convert import verify
from megatron.convert.layout_rules import tensor_layout
from megatron.core.tensor_parallel.layout import shard_for_rank
from megatron.model import GPTModel
from tests.helpers.convert import assert_same_tensors
from tests.helpers.mcore_reference import run_mcore
from tools.checkpoint import convert, saver_core, saver_megatron

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--ffn-hidden-size", "48", "--num-experts", "4", "--moe-ffn-hidden-size", "24",
         "--moe-shared-expert-intermediate-size", "16", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1]",
         "--moe-aux-loss-coeff", "0.01"]
VOCAB, ITERATION = 256, 5
EXPERTS = 4
TE_NORM = ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")  # a dense layer's, in the TE spec
TE_INPUT_NORM = ("input_layernorm.", "self_attention.linear_qkv.layer_norm_")


# a Mixtral: every layer MoE, no shared expert (what --saver hf writes)
MIXTRAL = FLAGS[:FLAGS.index("--moe-shared-expert-intermediate-size")] + [
    "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]


# Megatron's default linear biases: every linear's, the experts' too (fc1 split over ETP, fc2 whole);
# no shared expert (megatron-core's SharedExpertMLP refuses biases)
_SHARED = FLAGS.index("--moe-shared-expert-intermediate-size")
BIASED = [f for f in FLAGS[:_SHARED] + FLAGS[_SHARED + 2:] if f != "--disable-bias-linear"]


def _seeded(flags, seed):
    args = parse_and_validate_args(argv=flags)
    args.padded_vocab_size = VOCAB
    torch.manual_seed(seed)
    model = GPTModel(core_transformer_config_from_args(args), vocab_size=VOCAB,
                     max_sequence_length=args.max_position_embeddings, share_embeddings_and_output_weights=False,
                     **gpt_model_kwargs(args)).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "norm" in key or key.endswith(".bias"):  # (Megatron zeroes biases)
                param.add_(torch.randn_like(param) * 0.3)
    return args, {k: v.detach().clone() for k, v in model.state_dict().items()}, model


@pytest.fixture(scope="module")
def moe():
    """(our args, the whole state dict, the model) of a seeded MoE model, norms away from 1."""
    return _seeded(FLAGS, 300)


@pytest.fixture(scope="module")
def biased():
    return _seeded(BIASED, 303)


# DeepSeek-V3's router: sigmoid, group-limited (2 groups of 2 experts, one kept per token), the aux-loss-free
# expert bias (mlp.router.expert_bias, set to nonzero values so that it changes the choice)
BIAS_GROUPS = FLAGS + ["--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "2",
                       "--moe-router-group-topk", "1", "--moe-router-enable-expert-bias"]


@pytest.fixture(scope="module")
def bias_groups():
    args, whole, model = _seeded(BIAS_GROUPS, 304)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("router.expert_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
                whole[name] = buffer.clone()
    return args, whole, model


@pytest.fixture(scope="module")
def mixtral():
    return _seeded(MIXTRAL, 301)


# Megatron-LM's legacy SwitchMLP in our terms: top-1, sigmoid weights, Sinkhorn balancing, every layer,
# experts of --ffn-hidden-size
SWITCH = FLAGS[:FLAGS.index("--moe-ffn-hidden-size")] + [
    "--moe-router-topk", "1", "--moe-router-load-balancing-type", "sinkhorn"]


@pytest.fixture(scope="module")
def switch():
    return _seeded(SWITCH, 302)


# ----------------------------------------------------------------------------- writing fixtures


def _file_pairs(tp: int, ep: int, etp: int) -> tuple:
    """(data-parallel size, the (TP rank, EP rank) pairs the ranks of one stage hold)."""
    dp = 1
    while (tp * dp) % (etp * ep):
        dp += 1
    return dp, sorted({(r % tp, (r // etp) % ep) for r in range(tp * dp)})


def _layer_of(name: str):
    parts = name.split(".")
    return (int(parts[2]), ".".join(parts[3:])) if name.startswith("decoder.layers.") else (None, name)


def _expert_of(rest: str):
    """(global expert, 'linear_fc1.weight') of mlp.experts.local_experts.{g}.linear_fc1.weight, else None."""
    prefix = "mlp.experts.local_experts."
    if not rest.startswith(prefix):
        return None
    index, tail = rest[len(prefix):].split(".", 1)
    return int(index), tail


def _entry(args, whole, naming, te, tp, t, ep, e, etp, pp, stage):
    """The model entry of file (TP rank t, EP rank e) of `stage`: naming sequential / te_grouped / grouped."""
    per_stage = args.num_layers // pp
    local_experts = EXPERTS // ep
    entry, extra, moe_layers = {}, [], set()
    fc = {}  # (local layer, 'linear_fc1' | 'linear_fc2') -> [expert shards] (the grouped namings)
    for name, tensor in whole.items():
        layer, rest = _layer_of(name)
        if layer is None:
            if stage != (0 if name.startswith("embedding.") else pp - 1):
                continue
            entry[name] = shard_for_rank(tensor, tensor_layout(name, args, tp, t), tp, t).clone()
            continue
        if layer // per_stage != stage:
            continue
        local = layer - stage * per_stage
        prefix = f"decoder.layers.{local}."
        expert = _expert_of(rest)
        if rest.startswith("mlp.router."):
            moe_layers.add(local)
        if expert is None:
            shard = shard_for_rank(tensor, tensor_layout(name, args, tp, t), tp, t).clone()
            for ours, fused in (TE_INPUT_NORM, TE_NORM) if te else ():
                if rest.startswith(ours) and not (ours == TE_NORM[0] and f"decoder.layers.{layer}.mlp.router.weight"
                                                  in whole):  # an MoE layer keeps its own norm
                    rest = fused + rest[len(ours):]
            entry[prefix + rest] = shard
            if rest.endswith(".weight") and "linear_" in rest:
                extra.append(prefix + rest.rsplit(".", 1)[0])
            continue
        index, tail = expert
        if index // local_experts != e:
            continue
        i = index % local_experts
        shard = shard_for_rank(tensor, tensor_layout(name, args, etp, t % etp), etp, t % etp).clone()
        if naming == "sequential":
            entry[f"{prefix}mlp.experts.local_experts.{i}.{tail}"] = shard
            extra.append(f"{prefix}mlp.experts.local_experts.{i}.{tail.split('.')[0]}")
        elif naming == "te_grouped":
            module, kind = tail.split(".")
            entry[f"{prefix}mlp.experts.{module}.{kind}{i}"] = shard
            if i == 0:
                extra.append(f"{prefix}mlp.experts.{module}")
        else:
            fc.setdefault((local, tail.split(".")[0]), []).append(shard)
    for (local, module), shards in fc.items():  # GroupedMLP's two tensors
        prefix = f"decoder.layers.{local}.mlp.experts."
        if module == "linear_fc1":  # [E_local, h, F] in memory, read as [h, E_local F]
            entry[prefix + "weight1"] = torch.stack([s.t() for s in shards]).contiguous().view(args.hidden_size, -1)
        else:  # [E_local F, h]
            entry[prefix + "weight2"] = torch.cat([s.t() for s in shards]).contiguous()
    for module in extra:
        entry[f"{module}._extra_state"] = torch.empty(0, dtype=torch.uint8) if te else None
    if te:
        for local in range(per_stage):
            core_attention = f"decoder.layers.{local}.self_attention.core_attention._extra_state"
            entry[core_attention] = torch.empty(0, dtype=torch.uint8)
    if stage == pp - 1:
        entry["output_layer._extra_state"] = None
    return entry


def write_megatron_lm_moe(save_dir, args, whole, naming, te=False, tp=1, pp=1, ep=2, etp=None,
                          args_changes=None, skip=()):
    """Megatron-LM's MoE checkpoint of `whole` (see the module docstring); `skip`: (t, stage, e)
    files not written."""
    etp = etp or tp
    dp, pairs = _file_pairs(tp, ep, etp)
    raw = argparse.Namespace(**vars(args))
    raw.tensor_model_parallel_size, raw.pipeline_model_parallel_size = tp, pp
    raw.expert_model_parallel_size, raw.expert_tensor_parallel_size = ep, etp
    raw.data_parallel_size, raw.world_size = dp, tp * pp * dp
    raw.sequence_parallel = tp > 1  # Megatron: MoE with TP needs sequence parallelism
    raw.transformer_impl = "transformer_engine" if te else "local"
    raw.use_legacy_models = False
    raw.moe_grouped_gemm = naming != "sequential"
    raw.moe_use_legacy_grouped_gemm = naming == "grouped"
    raw.moe_token_dispatcher_type = "alltoall"
    for key, value in (args_changes or {}).items():
        setattr(raw, key, value)
    for stage in range(pp):
        for t, e in pairs:
            if (t, stage, e) in skip:
                continue
            state = {"args": raw, "iteration": ITERATION, "checkpoint_version": 3.0,
                     "model": _entry(args, whole, naming, te, tp, t, ep, e, etp, pp, stage)}
            path = get_checkpoint_name(str(save_dir), ITERATION, pipeline_parallel=pp > 1, tensor_rank=t,
                                       pipeline_rank=stage, expert_parallel=ep > 1, expert_rank=e)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state, path)
    with open(get_checkpoint_tracker_filename(str(save_dir)), "w") as f:
        f.write(str(ITERATION))
    return pairs


# ----------------------------------------------------------------------------- converting and checking


def _convert(loader, saver, load_dir, save_dir, *extra):
    convert.main(["--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir", str(load_dir),
                  "--save-dir", str(save_dir), *extra])


def _assert_logits_of_original(model, read_back, save_dir):
    target_args, tensors = read_back(str(save_dir))
    result = verify.compare(model, verify.build_serial_model(target_args, tensors), VOCAB, 16)
    assert result.ok, result.describe()
    return target_args


CASES = {  # id: (naming, TE spec, TP, PP, EP, ETP, the model fixture)
    "sequential-local-pp2-ep2": ("sequential", False, 1, 2, 2, None, "moe"),
    "te-grouped-tp2-ep2": ("te_grouped", True, 2, 1, 2, None, "moe"),
    "grouped-tp2-etp1-ep2": ("grouped", False, 2, 1, 2, 1, "moe"),
    # expert biases: SequentialMLP's linear_fc1 / fc2.bias at ETP = TP 2 (megatron-core before ETP, which
    # divided the TP-reduced fc2 bias by TP), TEGroupedMLP's bias{i} at ETP 1 (GPT-OSS style; megatron-core
    # 0.16.1 asserts ETP 1 with biased experts)
    "biased-sequential-tp2-ep2": ("sequential", False, 2, 1, 2, None, "biased"),
    "biased-te-grouped-tp2-etp1-ep2": ("te_grouped", True, 2, 1, 2, 1, "biased"),
    # the router's expert bias (fp32, replicated) with group-limited routing
    "expert-bias-groups-sequential-tp2-ep2": ("sequential", False, 2, 1, 2, None, "bias_groups"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_lm_moe_checkpoint_converts_to_the_original_logits(case, request, tmp_path, capsys):
    naming, te, tp, pp, ep, etp, fixture = CASES[case]
    args, whole, model = request.getfixturevalue(fixture)
    pairs = write_megatron_lm_moe(tmp_path / "megatron_lm", args, whole, naming, te, tp, pp, ep, etp)
    if etp is not None and etp < tp:
        assert len(pairs) < tp * ep  # not every (TP rank, EP rank) pair has a file
    _convert("mcore", "megatron", tmp_path / "megatron_lm", tmp_path / "ours", "--target-tensor-parallel-size", "1",
             "--target-pipeline-parallel-size", "1", "--target-expert-parallel-size", "1")
    assert "-> OK" in capsys.readouterr().out
    target = _assert_logits_of_original(model, saver_megatron.read_back, tmp_path / "ours")
    assert target.num_experts == EXPERTS and target.moe_layer_freq == [0, 1]
    assert_same_tensors(whole, tmp_path / "ours")


def test_mcore_saver_te_grouped_names_per_ep_rank(moe, tmp_path, capsys):
    """Megatron-LM (SequentialMLP, local) -> --saver mcore, TE spec with --moe-grouped-gemm at TP 2,
    EP 2: TEGroupedMLP's names per EP rank (local numbering), the MoE layer's own pre_mlp_layernorm,
    and reading it back gives the original logits."""
    args, whole, model = moe
    write_megatron_lm_moe(tmp_path / "src", args, whole, "sequential", args_changes={"moe_grouped_gemm": True})
    _convert("mcore", "mcore", tmp_path / "src", tmp_path / "te", "--target-tensor-parallel-size", "2",
             "--target-expert-parallel-size", "2")
    assert "-> OK" in capsys.readouterr().out
    _assert_logits_of_original(model, saver_core.read_back, tmp_path / "te")
    folder = tmp_path / "te" / f"iter_{ITERATION:07d}"
    assert sorted(os.listdir(folder)) == ["checksums.json", "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                          "mp_rank_01_001"]
    state = load_file(str(folder / "mp_rank_01_001" / "model_optim_rng.pt"))
    a = state["args"]
    assert (a.transformer_impl, a.num_experts, a.expert_model_parallel_size, a.moe_grouped_gemm) == \
        ("transformer_engine", EXPERTS, 2, True)
    dense, moe_layer = "decoder.layers.0.", "decoder.layers.1."
    assert sorted(k[len(dense):] for k in state["model"] if k.startswith(dense)) == sorted([
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv._extra_state", "self_attention.core_attention._extra_state",
        "self_attention.linear_proj.weight", "self_attention.linear_proj._extra_state",
        "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc1._extra_state",
        "mlp.linear_fc2.weight", "mlp.linear_fc2._extra_state"])
    assert sorted(k[len(moe_layer):] for k in state["model"] if k.startswith(moe_layer)) == sorted([
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv._extra_state", "self_attention.core_attention._extra_state",
        "self_attention.linear_proj.weight", "self_attention.linear_proj._extra_state",
        "pre_mlp_layernorm.weight", "mlp.router.weight",
        "mlp.experts.linear_fc1.weight0", "mlp.experts.linear_fc1.weight1", "mlp.experts.linear_fc1._extra_state",
        "mlp.experts.linear_fc2.weight0", "mlp.experts.linear_fc2.weight1", "mlp.experts.linear_fc2._extra_state",
        "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1._extra_state",
        "mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.linear_fc2._extra_state"])
    # EP rank 1's first local expert is global expert 2, TP rank 1's half of its rows per gate / up
    fc1 = whole["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    assert torch.equal(state["model"][moe_layer + "mlp.experts.linear_fc1.weight0"],
                       torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))


def test_mcore_saver_writes_te_grouped_expert_biases(biased, tmp_path, capsys):
    """Biased experts -> --saver mcore, TE spec with --moe-grouped-gemm at TP 2, ETP 1, EP 2 (a layout
    megatron-core 0.16.1 builds with biases): TEGroupedMLP's bias{i} per EP rank, fc1's and fc2's
    whole at ETP 1, on both TP ranks; reading it back gives the original logits."""
    args, whole, model = biased
    write_megatron_lm_moe(tmp_path / "src", args, whole, "sequential", args_changes={"moe_grouped_gemm": True})
    _convert("mcore", "mcore", tmp_path / "src", tmp_path / "te", "--target-tensor-parallel-size", "2",
             "--target-expert-parallel-size", "2", "--target-expert-tensor-parallel-size", "1")
    assert "-> OK" in capsys.readouterr().out
    _assert_logits_of_original(model, saver_core.read_back, tmp_path / "te")
    experts = "decoder.layers.1.mlp.experts."
    for t in range(2):
        state = load_file(str(tmp_path / "te" / f"iter_{ITERATION:07d}" / f"mp_rank_0{t}_001" / "model_optim_rng.pt"))
        assert sorted(k[len(experts):] for k in state["model"] if k.startswith(experts) and "bias" in k) == [
            "linear_fc1.bias0", "linear_fc1.bias1", "linear_fc2.bias0", "linear_fc2.bias1"]
        for module in ("linear_fc1", "linear_fc2"):  # EP rank 1's local expert 1 is global expert 3
            assert torch.equal(state["model"][f"{experts}{module}.bias1"],
                               whole[f"{experts}local_experts.3.{module}.bias"])


MCORE_LOAD = '''
import torch, torch.nn.functional as F
patch_for_cpu()
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.transformer_config import TransformerConfig
init_one_rank(1234)
state = torch.load(@PATH@, map_location="cpu", weights_only=False)  # as Megatron-LM's load_checkpoint reads it
a = state["args"]
config = TransformerConfig(
    num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
    num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size, kv_channels=a.kv_channels,
    normalization=a.normalization, layernorm_epsilon=a.norm_epsilon, add_bias_linear=a.add_bias_linear,
    gated_linear_unit=a.swiglu, activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
    num_moe_experts=a.num_experts, moe_ffn_hidden_size=a.moe_ffn_hidden_size, moe_router_topk=a.moe_router_topk,
    moe_layer_freq=a.moe_layer_freq, moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
    moe_grouped_gemm=a.moe_grouped_gemm, moe_aux_loss_coeff=a.moe_aux_loss_coeff,
    moe_router_score_function=a.moe_router_score_function, moe_router_num_groups=a.moe_router_num_groups,
    moe_router_group_topk=a.moe_router_group_topk, moe_router_enable_expert_bias=a.moe_router_enable_expert_bias,
    apply_rope_fusion=False, bias_activation_fusion=False, use_cpu_initialization=True)
spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=a.normalization)
model = GPTModel(config, spec, vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
                 position_embedding_type=a.position_embedding_type,
                 share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights).eval()
model.load_state_dict(state["model"], strict=True)
tokens = torch.tensor(@TOKENS@)
positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
with torch.no_grad():
    logits = model(tokens, positions, None)  # [b, s, v]
emit({"impl": a.transformer_impl, "keys": sorted(state["model"]), "logits": logits.tolist()})
'''


@pytest.mark.parametrize("fixture, naming", [("moe", "grouped"), ("biased", "te_grouped"),
                                             ("bias_groups", "sequential")])
def test_mcore_saver_moe_loads_strictly_in_megatron_core_and_gives_our_logits(fixture, naming, request, tmp_path,
                                                                              capsys):
    """Megatron-LM (GroupedMLP, or with linear biases TEGroupedMLP, or SequentialMLP with a grouped sigmoid
    router and its expert bias, at EP 2) -> --saver mcore --saver-transformer-impl local at EP 1:
    megatron-core's MoE GPTModel (local spec: SequentialMLP, biased experts with add_bias_linear, the
    router's expert_bias) loads the file strictly and gives the original logits."""
    args, whole, model = request.getfixturevalue(fixture)
    write_megatron_lm_moe(tmp_path / "src", args, whole, naming, te=naming == "te_grouped")
    _convert("mcore", "mcore", tmp_path / "src", tmp_path / "local", "--target-expert-parallel-size", "1",
             "--saver-transformer-impl", "local")
    assert "-> OK" in capsys.readouterr().out
    path = tmp_path / "local" / f"iter_{ITERATION:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    tokens = verify.sample_tokens(VOCAB, 16)
    reference = run_mcore(MCORE_LOAD.replace("@PATH@", repr(str(path))).replace("@TOKENS@", repr(tokens.tolist())))
    assert reference["impl"] == "local"
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2._extra_state" in reference["keys"]
    torch.testing.assert_close(torch.tensor(reference["logits"]), verify.logits_of(model, tokens),
                               rtol=1e-5, atol=1e-5)


def _one_line_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        convert.cli(argv)
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("layout, message", [
    (dict(skip={(1, 0, 1)}), "no file holds EP rank 1's experts (expert-TP rank 1): "),
    (dict(args_changes={"expert_tensor_parallel_size": 4}), "expert_tensor_parallel_size 4 does not divide "
                                                            "tensor_model_parallel_size 2"),
    (dict(args_changes={"moe_router_topk_limited_devices": 2}), "moe_router_topk_limited_devices=2 (the "
                                                                "deprecated device-limited routing"),
], ids=["missing-ep-file", "etp-not-dividing-tp", "limited-devices"])
def test_wrong_moe_layouts_are_one_line_and_nothing_written(layout, message, moe, tmp_path, capsys):
    args, whole, _ = moe
    write_megatron_lm_moe(tmp_path / "bad", args, whole, "sequential", tp=2, **layout)
    line = _one_line_error(["--model-type", "GPT", "--loader", "mcore", "--load-dir", str(tmp_path / "bad"),
                            "--save-dir", str(tmp_path / "out")], capsys)
    assert message in line, line
    assert not (tmp_path / "out").exists()


def test_megatron_lm_moe_checkpoint_converts_to_huggingface_mixtral(mixtral, tmp_path, capsys):
    """Megatron-LM (TEGroupedMLP, TE spec, TP 2 x EP 2) -> --saver hf: a MixtralForCausalLM whose
    from_pretrained logits are the original model's."""
    from transformers import AutoModelForCausalLM

    args, whole, model = mixtral
    write_megatron_lm_moe(tmp_path / "megatron_lm", args, whole, "te_grouped", te=True, tp=2)
    _convert("mcore", "hf", tmp_path / "megatron_lm", tmp_path / "hf")
    assert "-> OK" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    tokens = verify.sample_tokens(VOCAB, 16)
    with torch.no_grad():
        expected = verify.logits_of(model, tokens)[..., :VOCAB]
        got = hf(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ours -> Megatron-LM's legacy GPT layer (core_v0.5-era names) with its SwitchMLP
CLASSIC_PARTS = {"input_layernorm.": "input_norm.", "self_attention.linear_qkv.": "self_attention.query_key_value.",
                 "self_attention.linear_proj.": "self_attention.dense.", "pre_mlp_layernorm.": "post_attention_norm.",
                 "mlp.router.": "mlp.router."}
CLASSIC_TOP = {"embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
               "decoder.final_layernorm.weight": "encoder.final_norm.weight",
               "output_layer.weight": "output_layer.weight"}


def write_switch_mlp(save_dir, args, whole, tp=2, ep=2):
    """Megatron-LM's legacy MoE files (classic names, mlp.local_experts.{j}.dense_h_to_4h / dense_4h_to_h,
    ETP = TP, every (TP, EP) pair), with the MoE fields a later Megatron-LM saves but SwitchMLP ignores."""
    raw = argparse.Namespace(**vars(args))
    raw.tensor_model_parallel_size, raw.expert_model_parallel_size = tp, ep
    raw.expert_tensor_parallel_size, raw.data_parallel_size, raw.world_size = None, ep, tp * ep
    raw.sequence_parallel, raw.use_legacy_models, raw.transformer_impl = tp > 1, True, "local"
    raw.moe_router_topk, raw.moe_router_load_balancing_type, raw.moe_aux_loss_coeff = 2, "aux_loss", 0.01
    local = EXPERTS // ep
    for t in range(tp):
        for e in range(ep):
            flat = {}
            for name, tensor in whole.items():
                layer, rest = _layer_of(name)
                shard = lambda size, rank: shard_for_rank(  # noqa: E731
                    tensor, tensor_layout(name, args, size, rank), size, rank).clone()
                if layer is None:
                    flat[CLASSIC_TOP[name]] = shard(tp, t)
                    continue
                expert = _expert_of(rest)
                if expert is not None:
                    index, tail = expert
                    if index // local == e:
                        module, leaf = tail.split(".")
                        classic = "dense_h_to_4h" if module == "linear_fc1" else "dense_4h_to_h"
                        key = f"encoder.layers.{layer}.mlp.local_experts.{index % local}.{classic}.{leaf}"
                        flat[key] = shard(tp, t)
                    continue
                old = next(prefix for prefix in CLASSIC_PARTS if rest.startswith(prefix))
                flat[f"encoder.layers.{layer}.{CLASSIC_PARTS[old]}{rest[len(old):]}"] = shard(tp, t)
            state = {"args": raw, "iteration": ITERATION, "checkpoint_version": 3.0, "model": {"language_model": flat}}
            path = get_checkpoint_name(str(save_dir), ITERATION, pipeline_parallel=False, tensor_rank=t,
                                       pipeline_rank=0, expert_parallel=ep > 1, expert_rank=e)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state, path)
    with open(get_checkpoint_tracker_filename(str(save_dir)), "w") as f:
        f.write(str(ITERATION))


def test_legacy_switch_mlp_checkpoint_converts_to_the_original_logits(switch, tmp_path, capsys):
    """--loader legacy: SwitchMLP files at TP 2 x EP 2 convert to ours (top-1 sinkhorn, the saved
    moe_router_topk 2 not read) with the original logits; with linear biases it is one line."""
    args, whole, model = switch
    write_switch_mlp(tmp_path / "legacy", args, whole)
    _convert("legacy", "megatron", tmp_path / "legacy", tmp_path / "ours", "--target-tensor-parallel-size", "1",
             "--target-expert-parallel-size", "1")
    assert "-> OK" in capsys.readouterr().out
    target = _assert_logits_of_original(model, saver_megatron.read_back, tmp_path / "ours")
    assert (target.moe_router_topk, target.moe_router_load_balancing_type) == (1, "sinkhorn")
    assert_same_tensors(whole, tmp_path / "ours")
    biased = argparse.Namespace(**{**vars(args), "add_bias_linear": True})
    write_switch_mlp(tmp_path / "biased", biased, whole)
    line = _one_line_error(["--model-type", "GPT", "--loader", "legacy", "--load-dir", str(tmp_path / "biased"),
                            "--save-dir", str(tmp_path / "out")], capsys)
    assert "not support with linear biases" in line, line
