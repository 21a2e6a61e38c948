"""Layer specs: megatron-core's GPTModel and ours share state-dict keys and logits for the Llama
family; the GPT keys are unchanged; a user's own spec (a parallel attention + MLP block) builds a
model without touching library code; slots can be overridden or left empty; model code does not
branch on the device."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.convert.huggingface import state_dict_from_hf
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.model import GPTModel, TransformerConfig
from megatron.model.attention import DotProductAttention, SelfAttention, SelfAttentionSubmodules
from megatron.model.layer_specs import get_gpt_layer_spec, get_llama_layer_spec
from megatron.model.layers import LayerNorm, Norm, RMSNorm
from megatron.model.mlp import MLP
from megatron.model.module import MegatronModule
from megatron.model.spec import ModuleSpec, build_module
from megatron.model.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from tests.helpers.mcore_reference import run_mcore

ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ = 256, 16

# (megatron-core TransformerConfig / GPTModel keyword arguments, the same as ours)
LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
             normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True, hidden_dropout=0.0,
             attention_dropout=0.0, layernorm_epsilon=1e-5)
VARIANTS = {
    "llama-gqa": (dict(), dict(rotary_base=10000)),
    "qk-norm-qkv-bias-partial-interleaved": (
        dict(qk_layernorm=True, add_qkv_bias=True, rotary_interleaved=True, num_query_groups=4),
        dict(rotary_percent=0.5, rotary_base=500)),
    "llama3-scaling-mqa": (dict(num_query_groups=1), dict(rope_scaling=True, rope_scaling_factor=8.0,
                                                          rotary_base=500000)),
}

MCORE_LLAMA = '''
import torch, torch.nn.functional as F
patch_for_cpu()
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
init_one_rank(1234)
out = {}
tokens = torch.tensor(@TOKENS@)
for name, (config_kwargs, model_kwargs) in @VARIANTS@.items():
    config = TransformerConfig(**{**@LLAMA@, **config_kwargs}, activation_func=F.silu, apply_rope_fusion=False,
                               use_cpu_initialization=True, init_method_std=0.2)
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=@VOCAB@, max_sequence_length=@SEQ@, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False, **model_kwargs).eval()
    with torch.no_grad():
        logits = model(tokens, None, None)  # [b, s, v]
    state = model.state_dict()
    out[name] = {"state": {k: v.tolist() for k, v in state.items() if isinstance(v, torch.Tensor)},
                 "other": sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor)),
                 "logits": logits.tolist()}
emit(out)
'''


def _our_llama(config_kwargs, model_kwargs, **overrides) -> GPTModel:
    config = TransformerConfig(**{**LLAMA, **config_kwargs, **overrides}, activation_func=F.silu)
    return GPTModel(config, VOCAB, SEQ, position_embedding_type="rope", share_embeddings_and_output_weights=False,
                    transformer_layer_spec=get_llama_layer_spec(qk_layernorm=config.qk_layernorm),
                    **model_kwargs).eval()


@pytest.fixture(scope="module")
def mcore_llama():
    tokens = [[(7 * i + 3) % VOCAB for i in range(SEQ)], [(11 * i + 5) % VOCAB for i in range(SEQ)]]
    snippet = (MCORE_LLAMA.replace("@TOKENS@", repr(tokens))
               .replace("@VARIANTS@", repr(VARIANTS)).replace("@LLAMA@", repr(LLAMA))
               .replace("@VOCAB@", str(VOCAB)).replace("@SEQ@", str(SEQ)))
    return torch.tensor(tokens), run_mcore(snippet)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_megatron_core_llama_checkpoint_loads_one_to_one_and_gives_its_logits(mcore_llama, variant, fused):
    """megatron-core's GPTModel with its local spec (RMSNorm, SwiGLU, query groups, RoPE, untied):
    its state dict has exactly our keys and shapes, loads strictly, and gives its logits."""
    tokens, reference = mcore_llama
    unfused = {} if fused else dict(apply_rope_fusion=False, bias_swiglu_fusion=False, masked_softmax_fusion=False)
    model = _our_llama(*VARIANTS[variant], **unfused)
    state = {k: torch.tensor(v) for k, v in reference[variant]["state"].items()}
    # Megatron-Core's linear layers also save an empty `_extra_state` (None), which loading here skips
    assert all(key.endswith("._extra_state") for key in reference[variant]["other"])
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: tuple(v.shape) for k, v in state.items()}
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model(tokens, None)
    torch.testing.assert_close(logits, torch.tensor(reference[variant]["logits"]), rtol=1e-4, atol=1e-4)


def test_gpt_state_dict_keys_are_megatron_cores_local_spec():
    """The GPT spec's keys did not change with the spec seam (the list the checkpoints use)."""
    model = GPTModel(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4), VOCAB, SEQ,
                     share_embeddings_and_output_weights=False)
    layer = "decoder.layers.0."
    assert list(model.state_dict()) == [
        "embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
        *(layer + name for name in (
            "input_layernorm.weight", "input_layernorm.bias",
            "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
            "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
            "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
            "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")),
        "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"]


# ------------------------------------------------------------------ a user's own spec
class ParallelResidualLayer(MegatronModule):
    """x + attn(ln1(x)) + mlp(ln2(x)) (GPT-J / GPT-NeoX's parallel block), written as a user would:
    its own class, the library's slots and builder, no library change."""

    def __init__(self, config, submodules: TransformerLayerSubmodules, layer_number: int = 1):
        super().__init__(config)
        self.input_layernorm = build_module(submodules.input_layernorm, config.hidden_size, config)
        self.self_attention = build_module(submodules.self_attention, config, layer_number=layer_number)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config.hidden_size, config)
        self.mlp = build_module(submodules.mlp, config)

    def forward(self, hidden_states, attention_mask, is_causal=False, rotary_pos_emb=None, attention_bias=None):
        attention, attention_bias_out = self.self_attention(self.input_layernorm(hidden_states), attention_mask,
                                                            is_causal, rotary_pos_emb=rotary_pos_emb)
        mlp, mlp_bias = self.mlp(self.pre_mlp_layernorm(hidden_states))
        for bias in (attention_bias_out, mlp_bias):
            if bias is not None:
                hidden_states = hidden_states + bias
        return hidden_states + attention + mlp


def parallel_residual_spec() -> ModuleSpec:
    gpt = get_gpt_layer_spec().submodules
    return ModuleSpec(ParallelResidualLayer, submodules=dataclasses.replace(gpt, input_layernorm=LayerNorm,
                                                                             pre_mlp_layernorm=LayerNorm))


def test_user_spec_parallel_block_equals_hf_gpt_neox_parallel_residual():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=128, rotary_pct=0.25, max_position_embeddings=SEQ,
                                           use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
                                           attn_implementation="eager")
    hf = transformers.GPTNeoXForCausalLM(hf_config).eval()
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                               hidden_dropout=0.0, attention_dropout=0.0, bias_gelu_fusion=False,
                               bias_dropout_fusion=False)
    model = GPTModel(config, VOCAB, SEQ, position_embedding_type="rope", rotary_percent=0.25,
                     share_embeddings_and_output_weights=False, transformer_layer_spec=parallel_residual_spec()).eval()
    # The weights map as for the sequential block (megatron/convert/huggingface.py); only the layer differs.
    mapped = state_dict_from_hf(hf.state_dict(), hf_config)
    model.load_state_dict(mapped, strict=True)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        assert (model(tokens, None) - hf(tokens).logits).abs().max() < 1e-4


# ------------------------------------------------------------------ the builder
class CountingAttention(DotProductAttention):
    calls = 0

    def forward(self, *args, **kwargs):
        CountingAttention.calls += 1
        return super().forward(*args, **kwargs)


def test_slots_take_classes_params_and_none():
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, normalization="RMSNorm")
    assert isinstance(build_module(Norm, 32, config), RMSNorm)
    assert build_module(None, 32, config) is None
    linear = build_module(ModuleSpec(ColumnParallelLinear, params={"bias": False}), 32, 64, config=config,
                          init_method=config.init_method, bias=True)
    assert linear.bias is None  # the spec's params override the slot's arguments
    with pytest.raises(TypeError, match="ModuleSpec, a module class or None"):
        build_module("SelfAttention", config)
    spec = ModuleSpec(TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=Norm,
        self_attention=ModuleSpec(SelfAttention, submodules=SelfAttentionSubmodules(core_attention=CountingAttention)),
        pre_mlp_layernorm=None, mlp=None))  # attention only: no MLP, no second norm
    model = GPTModel(config, VOCAB, SEQ, transformer_layer_spec=spec).eval()
    assert not any(".mlp." in key or "pre_mlp_layernorm" in key for key in model.state_dict())
    CountingAttention.calls = 0
    model(torch.randint(0, VOCAB, (1, SEQ)), torch.arange(SEQ)[None])
    assert CountingAttention.calls == 1
    assert isinstance(model.decoder.layers[0].self_attention.core_attention, CountingAttention)
    assert isinstance(GPTModel(config, VOCAB, SEQ).decoder.layers[0].mlp, MLP)


def test_model_code_does_not_branch_on_the_device():
    """Kernel choices by device live in megatron/fused_kernels (backend.py), not in megatron/model."""
    found = []
    for path in sorted((ROOT / "megatron" / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("is_cuda", "is_cpu", "cuda"):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if (isinstance(node, ast.Attribute) and node.attr == "type" and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "device"):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def test_spec_flag_trains_the_users_layer_from_pretrain_gpt():
    """--spec MODULE NAME (Megatron's flag): pretrain_gpt builds this module's parallel block."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    models = []

    def provider(pre_process=True, post_process=True):
        models.append(pretrain_gpt.model_provider(pre_process, post_process))
        return models[-1]

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--max-position-embeddings",
            "16", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
            "--num-workers", "0", "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "255", "--train-iters", "3", "--position-embedding-type", "rope",
            "--spec", "tests.unit.test_layer_specs", "parallel_residual_spec"]
    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider, provider, ModelType.encoder_or_decoder,
                      pretrain_gpt.forward_step, argv=argv, record_history=True)
    assert all(isinstance(layer, ParallelResidualLayer) for layer in models[0].decoder.layers)
    losses = [entry.losses["lm loss"] for entry in result.history]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
