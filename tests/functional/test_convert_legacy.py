"""`--loader legacy`, `--loader mcore` and `--saver mcore`: Megatron-LM's own checkpoints, written here from a model.

Each fixture is a Megatron-LM `--ckpt-format torch` checkpoint of one of our seeded models, written
by this test (not by the code under test): the whole tensors cut per TP rank with the layout rules
(tests/unit/test_convert_layout_rules.py ties them to the layers), renamed with this file's own
tables to Megatron-LM's classic names (three generations of them) or megatron-core's (TE and local
spec), the QKV rows of each shard put in the order of the file's checkpoint_version by explicit
row indexing, and a Megatron-LM-style args Namespace (older field names for older versions).

Every conversion runs convert.py's verification (source read again vs target read back) *and* is
compared here with the original model's logits: the verification reads both sides with the same
loader, so only the second comparison can see a wrong QKV order (test_mislabelled_version_...).
"""

from __future__ import annotations

import argparse
import io
import os

import pytest
import torch

from megatron.training.arguments import core_transformer_config_from_args, gpt_model_kwargs
from megatron.training.checkpoint_safety import load_file
from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename
from megatron.convert import verify
from megatron.convert.layout_rules import renumber, tensor_layout
from megatron.core.tensor_parallel.layout import shard_for_rank
from megatron.model import GPTModel
from tests.helpers.convert import FLAGS, VOCAB, assert_same_tensors, legacy_args
from tests.helpers.mcore_reference import run_mcore
from tools.checkpoint import convert, saver_core, saver_megatron

TP, PP = 2, 2

# ours -> Megatron-LM's classic names, per generation: (block, attention, norms: input, post, final)
CLASSIC = {
    "v1.0": ("transformer", "attention", "input_layernorm", "post_attention_layernorm", "final_layernorm"),
    "23.04": ("encoder", "self_attention", "input_layernorm", "post_attention_layernorm", "final_layernorm"),
    "core_v0.5": ("encoder", "self_attention", "input_norm", "post_attention_norm", "final_norm"),
}
TE_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _model(args: argparse.Namespace) -> GPTModel:
    return GPTModel(core_transformer_config_from_args(args), vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    **gpt_model_kwargs(args)).eval()


@pytest.fixture(scope="module")
def models():
    """name -> (our args, the whole state dict, the model) of seeded random models."""
    out = {}
    for seed, name in enumerate(FLAGS):
        args = legacy_args(name)
        torch.manual_seed(100 + seed)
        model = _model(args)
        with torch.no_grad():  # norms away from 1 / 0, so a norm mapped to the wrong place shows
            for key, param in model.named_parameters():
                if "norm" in key:
                    param.add_(torch.randn_like(param) * 0.3)
        out[name] = (args, {k: v.detach().clone() for k, v in model.state_dict().items()}, model)
    return out


# ----------------------------------------------------------------------------- writing fixtures


def _megatron_args(args: argparse.Namespace, version: float, vp: int) -> argparse.Namespace:
    """A Megatron-LM args Namespace of this model at TP x PP (x vp); older names before version 3.0."""
    raw = argparse.Namespace(**vars(args))
    raw.tensor_model_parallel_size, raw.pipeline_model_parallel_size, raw.world_size = TP, PP, TP * PP
    raw.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
    raw.num_layers_per_virtual_pipeline_stage = args.num_layers // (PP * vp) if vp > 1 else None
    raw.transformer_impl, raw.use_legacy_models = "local", version < 3.0
    if version < 3.0:  # Megatron-LM v1.0 / v2.0-era args
        raw.model_parallel_size = TP
        raw.layernorm_epsilon = args.norm_epsilon
        for field in ("tensor_model_parallel_size", "norm_epsilon", "position_embedding_type", "add_bias_linear",
                      "normalization", "group_query_attention", "num_query_groups", "swiglu"):
            delattr(raw, field)
    return raw


def _version_rows(shard: torch.Tensor, version: float, heads: int, hn: int) -> torch.Tensor:
    """One shard's [np, 3, hn] QKV rows in the order a version-`version` file stores them."""
    if version >= 2.0:
        return shard
    row = lambda head, which, i: (head * 3 + which) * hn + i  # noqa: E731 -- the [np, 3, hn] index
    if version == 0:  # [3, np, hn]: every head's q, then every k, then every v
        order = [row(h, w, i) for w in range(3) for h in range(heads) for i in range(hn)]
    else:  # 1.0: [np, hn, 3]: per head, per channel, its q, k, v
        order = [row(h, w, i) for h in range(heads) for i in range(hn) for w in range(3)]
    return shard[torch.tensor(order)]


def _classic_entry(local: dict, generation: str) -> dict:
    """One file's model entry, nested as Megatron-LM's classic GPTModel saves it."""
    block, attention, input_norm, post_norm, final_norm = CLASSIC[generation]
    parts = {"input_layernorm.": f"{input_norm}.", "self_attention.linear_qkv.": f"{attention}.query_key_value.",
             "self_attention.linear_proj.": f"{attention}.dense.", "pre_mlp_layernorm.": f"{post_norm}.",
             "mlp.linear_fc1.": "mlp.dense_h_to_4h.", "mlp.linear_fc2.": "mlp.dense_4h_to_h."}
    language_model, encoder, entry = {}, {}, {}
    for name, tensor in local.items():
        if name.startswith("embedding."):  # embedding.word_embeddings.weight -> nested dicts
            _, table, leaf = name.split(".")
            language_model.setdefault("embedding", {}).setdefault(table, {})[leaf] = tensor
        elif name.startswith("decoder.layers."):
            _, _, index, rest = name.split(".", 3)
            old = next(prefix for prefix in parts if rest.startswith(prefix))
            encoder[f"layers.{index}.{parts[old]}{rest[len(old):]}"] = tensor
        elif name.startswith("decoder.final_layernorm."):
            encoder[f"{final_norm}.{name.rsplit('.', 1)[1]}"] = tensor
        elif name == "output_layer.weight":
            language_model["output_layer"] = {"weight": tensor}
        elif name == "word_embeddings_for_head.weight":
            entry["word_embeddings_for_head"] = {"weight": tensor}
        else:
            raise AssertionError(name)
    language_model[block] = encoder
    return {"language_model": language_model, **entry}


def _core_entry(local: dict, te: bool, fp8: bool = False) -> dict:
    """One file's model entry in megatron-core's names, with its `_extra_state` entries."""
    entry, layers = {}, []
    for name, tensor in local.items():
        if name == "word_embeddings_for_head.weight":
            name = "output_layer.weight"  # megatron-core keeps the tied copy under the output layer
        if name.startswith("decoder.layers."):
            _, _, index, rest = name.split(".", 3)
            prefix = f"decoder.layers.{index}."
            if prefix not in layers:
                layers.append(prefix)
            for local_name, fused in (TE_NORMS.items() if te else ()):
                if rest.startswith(local_name):
                    rest = fused + rest[len(local_name):]
            name = prefix + rest
        entry[name] = tensor
    for n, prefix in enumerate(layers):
        modules = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]
        for module in modules + (["self_attention.core_attention"] if te else []):
            if not te:
                value = None
            elif n == 0 and module == "self_attention.linear_proj":  # Transformer Engine < 1.6's form
                buffer = io.BytesIO()
                torch.save(None, buffer)
                value = buffer
            else:
                value = torch.empty(0, dtype=torch.uint8)
            entry[f"{prefix}{module}._extra_state"] = value
    if fp8 and layers:
        entry[f"{layers[0]}self_attention.linear_qkv._extra_state"] = torch.tensor(list(b"scale_fwd..."),
                                                                                  dtype=torch.uint8)
    if "decoder.final_layernorm.weight" in entry:
        entry["output_layer._extra_state"] = None
    return entry


def write_megatron_lm(save_dir, args, whole, naming: str, version: float = 3.0, vp: int = 1,
                      qkv_version: float = None, fp8: bool = False, iteration: int = 5,
                      args_changes: dict = None) -> None:
    """Megatron-LM's checkpoint of `whole` at TP x PP (x vp); naming: a CLASSIC generation, 'te' or 'local'.
    qkv_version: the order the QKV rows are really written in (default: `version`'s)."""
    qkv_version = version if qkv_version is None else qkv_version
    raw = _megatron_args(args, version, vp)
    for key, value in (args_changes or {}).items():
        setattr(raw, key, value)
    tied = not args.untie_embeddings_and_output_weights
    per_chunk = args.num_layers // (PP * vp)
    heads, hn = args.num_attention_heads // TP, args.kv_channels
    for pp_rank in range(PP):
        for tp_rank in range(TP):
            state = {"args": raw, "iteration": iteration}
            if version > 0:  # version-0 files have no checkpoint_version entry
                state["checkpoint_version"] = version
            for chunk in range(vp):
                first, last = pp_rank == 0 and chunk == 0, pp_rank == PP - 1 and chunk == vp - 1
                offset = (chunk * PP + pp_rank) * per_chunk
                local = {}
                for name, tensor in whole.items():
                    if name.startswith("decoder.layers."):
                        index = int(name.split(".")[2]) - offset
                        if not 0 <= index < per_chunk:
                            continue
                        local_name = renumber(name, -offset)
                    elif name.startswith("embedding."):
                        if not first:
                            continue
                        local_name = name
                    elif not last:
                        continue
                    else:
                        local_name = name
                    shard = shard_for_rank(tensor, tensor_layout(name, args, TP, tp_rank), TP, tp_rank).clone()
                    if ".linear_qkv." in name:
                        shard = _version_rows(shard, qkv_version, heads, hn)
                    local[local_name] = shard
                if last and tied and PP > 1:  # the last stage's copy of the tied word embeddings
                    embedding = whole["embedding.word_embeddings.weight"]
                    local["word_embeddings_for_head.weight"] = shard_for_rank(
                        embedding, tensor_layout("output_layer.weight", args, TP, tp_rank), TP, tp_rank).clone()
                entry = (_core_entry(local, naming == "te", fp8) if naming in ("te", "local")
                         else _classic_entry(local, naming))
                state["model" if vp == 1 else f"model{chunk}"] = entry
            path = get_checkpoint_name(str(save_dir), iteration, pipeline_parallel=True, tensor_rank=tp_rank,
                                       pipeline_rank=pp_rank, expert_parallel=False, expert_rank=0)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(state, path)  # no checksums.json: Megatron-LM writes none
    with open(get_checkpoint_tracker_filename(str(save_dir)), "w") as f:
        f.write(str(iteration))


# ----------------------------------------------------------------------------- converting and checking


def _convert(loader, saver, load_dir, save_dir, tp=1, pp=1, *extra):
    convert.main(["--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir", str(load_dir),
                  "--save-dir", str(save_dir), "--target-tensor-parallel-size", str(tp),
                  "--target-pipeline-parallel-size", str(pp), *extra])


def _assert_logits_of_original(model, read_back, save_dir):
    """The converted checkpoint, built at TP = 1, gives the original model's logits."""
    target_args, tensors = read_back(str(save_dir))
    converted = verify.build_serial_model(target_args, tensors)
    result = verify.compare(model, converted, VOCAB, 16)
    assert result.ok, result.describe()
    return result


CASES = {  # id: (model, naming, checkpoint_version, virtual stages)
    "gpt2-classic-v3-vp2": ("gpt2", "core_v0.5", 3.0, 2),
    "llama-gqa-classic-v3": ("llama", "core_v0.5", 3.0, 1),
    "gpt2-classic-v2": ("gpt2", "23.04", 2.0, 1),
    "gpt2-classic-v1": ("gpt2", "v1.0", 1.0, 1),
    "gpt2-classic-v0": ("gpt2", "v1.0", 0, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_legacy_checkpoint_converts_to_the_original_logits(case, models, tmp_path, capsys):
    name, naming, version, vp = CASES[case]
    args, whole, model = models[name]
    write_megatron_lm(tmp_path / "megatron_lm", args, whole, naming, version, vp)
    _convert("legacy", "megatron", tmp_path / "megatron_lm", tmp_path / "ours")
    assert "-> OK" in capsys.readouterr().out
    _assert_logits_of_original(model, saver_megatron.read_back, tmp_path / "ours")
    assert_same_tensors(whole, tmp_path / "ours")


def test_mislabelled_version_passes_verification_but_not_the_original_logits(models, tmp_path, capsys):
    """Version-0 rows in a file that says 3.0: both sides of the verification read the same wrong
    order, so it passes; the original model's logits do not."""
    args, whole, model = models["gpt2"]
    write_megatron_lm(tmp_path / "mislabelled", args, whole, "23.04", version=3.0, qkv_version=0)
    _convert("legacy", "megatron", tmp_path / "mislabelled", tmp_path / "ours")
    assert "-> OK" in capsys.readouterr().out
    target_args, tensors = saver_megatron.read_back(str(tmp_path / "ours"))
    result = verify.compare(model, verify.build_serial_model(target_args, tensors), VOCAB, 16)
    assert not result.ok and result.max_difference > 1e-2, result.describe()


@pytest.mark.parametrize("naming", ["te", "local"])
@pytest.mark.parametrize("name", list(FLAGS))
def test_mcore_checkpoint_converts_to_the_original_logits(name, naming, models, tmp_path, capsys):
    args, whole, model = models[name]
    write_megatron_lm(tmp_path / "mcore", args, whole, naming, vp=2 if name == "gpt2" else 1)
    _convert("mcore", "megatron", tmp_path / "mcore", tmp_path / "ours", 2, 1)
    assert "-> OK" in capsys.readouterr().out
    _assert_logits_of_original(model, saver_megatron.read_back, tmp_path / "ours")
    assert_same_tensors(whole, tmp_path / "ours")


def test_fp8_extra_state_is_one_line_and_nothing_written(models, tmp_path, capsys):
    args, whole, _ = models["llama"]
    write_megatron_lm(tmp_path / "fp8", args, whole, "te", fp8=True)
    with pytest.raises(SystemExit) as exit_:
        convert.cli(["--model-type", "GPT", "--loader", "mcore", "--load-dir", str(tmp_path / "fp8"),
                     "--save-dir", str(tmp_path / "out")])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "linear_qkv._extra_state carries data" in err[0], err
    assert not (tmp_path / "out").exists() and not [p for p in os.listdir(tmp_path) if "converting" in p]


def test_wrong_loader_is_named(models, tmp_path):
    args, whole, _ = models["gpt2"]
    write_megatron_lm(tmp_path / "classic", args, whole, "23.04", version=1.0)
    with pytest.raises(ValueError, match="checkpoint_version 1.0.*--loader legacy"):
        _convert("megatron", "megatron", tmp_path / "classic", tmp_path / "a")
    write_megatron_lm(tmp_path / "classic3", args, whole, "23.04")
    with pytest.raises(ValueError, match="classic naming.*--loader legacy"):
        _convert("mcore", "megatron", tmp_path / "classic3", tmp_path / "b")
    write_megatron_lm(tmp_path / "te", args, whole, "te")
    with pytest.raises(ValueError, match="Transformer Engine naming.*--loader mcore"):
        _convert("megatron", "megatron", tmp_path / "te", tmp_path / "c")


def test_mcore_saver_te_names_at_tp2_pp2_read_back_to_the_original(models, tmp_path, capsys):
    args, whole, model = models["llama"]
    write_megatron_lm(tmp_path / "classic", args, whole, "core_v0.5")
    _convert("legacy", "mcore", tmp_path / "classic", tmp_path / "te", 2, 2)
    assert "-> OK" in capsys.readouterr().out
    _assert_logits_of_original(model, saver_core.read_back, tmp_path / "te")
    state = load_file(str(tmp_path / "te" / "iter_0000005" / "mp_rank_01_001" / "model_optim_rng.pt"))
    assert state["checkpoint_version"] == 3.0 and state["args"].transformer_impl == "transformer_engine"
    assert (state["args"].tensor_model_parallel_size, state["args"].pipeline_model_parallel_size) == (2, 2)
    layer = "decoder.layers.1."
    assert sorted(k[len(layer):] for k in state["model"] if k.startswith(layer)) == sorted([
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv._extra_state", "self_attention.core_attention._extra_state",
        "self_attention.linear_proj.weight", "self_attention.linear_proj._extra_state",
        "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc1._extra_state",
        "mlp.linear_fc2.weight", "mlp.linear_fc2._extra_state"])
    assert {k for k in state["model"] if not k.startswith("decoder.layers.")} == {
        "decoder.final_layernorm.weight", "output_layer.weight", "output_layer._extra_state"}


MCORE_LOAD = '''
import argparse, torch, torch.nn.functional as F
patch_for_cpu()
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
init_one_rank(1234)
out = {}
for name, path in @PATHS@.items():
    # as Megatron-LM's load_checkpoint reads a torch-format file (the args Namespace unpickles here,
    # where nothing of our package can be imported)
    state = torch.load(path, map_location="cpu", weights_only=False)
    a = state["args"]
    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups if a.group_query_attention else None,
        ffn_hidden_size=a.ffn_hidden_size, kv_channels=a.kv_channels, normalization=a.normalization,
        layernorm_epsilon=a.norm_epsilon, add_bias_linear=a.add_bias_linear, gated_linear_unit=a.swiglu,
        activation_func=F.silu if a.swiglu else F.gelu, hidden_dropout=0.0, attention_dropout=0.0,
        apply_rope_fusion=False, bias_activation_fusion=False, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(normalization=a.normalization)
    model = GPTModel(config, spec, vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
                     position_embedding_type=a.position_embedding_type,
                     share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights).eval()
    model.load_state_dict(state["model"], strict=True)
    tokens = torch.tensor(@TOKENS@)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, None)  # [b, s, v]
    out[name] = {"version": state["checkpoint_version"], "impl": a.transformer_impl, "logits": logits.tolist()}
emit(out)
'''


def test_mcore_saver_output_loads_strictly_in_megatron_core_and_gives_our_logits(models, tmp_path, capsys):
    paths = {}
    for name in FLAGS:
        args, whole, _ = models[name]
        write_megatron_lm(tmp_path / f"{name}_classic", args, whole, "23.04" if name == "gpt2" else "core_v0.5")
        _convert("legacy", "mcore", tmp_path / f"{name}_classic", tmp_path / f"{name}_mcore", 1, 1,
                 "--saver-transformer-impl", "local")
        paths[name] = str(tmp_path / f"{name}_mcore" / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt")
    assert capsys.readouterr().out.count("-> OK") == len(FLAGS)
    tokens = verify.sample_tokens(VOCAB, 16)
    reference = run_mcore(MCORE_LOAD.replace("@PATHS@", repr(paths))
                          .replace("@TOKENS@", repr(tokens.tolist())))
    for name in FLAGS:
        assert reference[name]["version"] == 3.0 and reference[name]["impl"] == "local"
        ours = verify.logits_of(models[name][2], tokens)
        torch.testing.assert_close(torch.tensor(reference[name]["logits"]), ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change, message", [
    (dict(num_experts=8), "uses num_experts=8, which the converter does not support"),
    (dict(hidden_size=None), "the saved args have no hidden_size, which the converter cannot infer"),
    (dict(position_embedding_type="relative"), "describe a model this framework cannot build"),
    (dict(normalization="FancyNorm"), "hold a value our flags do not accept (--normalization: 'FancyNorm' is "
                                      "not one of LayerNorm, RMSNorm)"),
], ids=["moe", "no-hidden-size", "relative-positions", "unknown-norm"])
def test_args_that_cannot_be_converted_are_one_line(change, message, models, tmp_path, capsys):
    args, whole, _ = models["gpt2"]
    write_megatron_lm(tmp_path / "bad", args, whole, "23.04", args_changes=change)
    with pytest.raises(SystemExit) as exit_:
        convert.cli(["--model-type", "GPT", "--loader", "legacy", "--load-dir", str(tmp_path / "bad"),
                     "--save-dir", str(tmp_path / "out")])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def _to_hf(loader, load_dir, save_dir):
    convert.main(["--model-type", "GPT", "--loader", loader, "--saver", "hf", "--load-dir", str(load_dir),
                  "--save-dir", str(save_dir)])


@pytest.mark.parametrize("source", ["legacy", "mcore"])
@pytest.mark.parametrize("name", list(FLAGS))
def test_megatron_lm_checkpoint_converts_to_huggingface(name, source, models, tmp_path, capsys):
    """Megatron-LM (classic v3.0 at TP=2 PP=2, or megatron-core TE names) -> a transformers folder
    (--saver hf, its config built from the args): from_pretrained gives the original model's logits."""
    from transformers import AutoModelForCausalLM

    args, whole, model = models[name]
    write_megatron_lm(tmp_path / "megatron_lm", args, whole, "core_v0.5" if source == "legacy" else "te", 3.0)
    _to_hf(source, tmp_path / "megatron_lm", tmp_path / "hf")
    assert "-> OK" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    tokens = verify.sample_tokens(VOCAB, 16)
    with torch.no_grad():
        expected = verify.logits_of(model, tokens)[..., :VOCAB]
        got = hf(tokens).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_huggingface_converts_to_megatron_core_names(models, tmp_path, capsys):
    """ours -> HF -> --saver mcore (TE names): read back, the original model's logits."""
    from tools.checkpoint import saver_core

    args, whole, model = models["llama"]
    write_megatron_lm(tmp_path / "mcore", args, whole, "te")
    _to_hf("mcore", tmp_path / "mcore", tmp_path / "hf")
    _convert("hf", "mcore", tmp_path / "hf", tmp_path / "mcore_again", 2, 2)
    assert capsys.readouterr().out.count("-> OK") == 2
    _assert_logits_of_original(model, saver_core.read_back, tmp_path / "mcore_again")
