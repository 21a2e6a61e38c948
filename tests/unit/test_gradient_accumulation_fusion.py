"""Gradient-accumulation fusion: the linear layers add their weight gradients straight into
DistributedDataParallel's `main_grad`, and the result equals the unfused path (.grad, then the
DDP hook's add).

One process, no process group: DDP at data-parallel size 1 still gives every parameter a
`main_grad`. The GPT runs MICRO micro-batches (all but the last under no_sync, as the schedule
does) and each test compares the accumulated `main_grad`s.
"""

from __future__ import annotations

import pytest
import torch

from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.model import Float16Module, GPTModel, TransformerConfig

VOCAB, SEQ, MBS, HIDDEN, LAYERS, SEED, MICRO = 128, 8, 2, 32, 2, 1234, 3
FUSED_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _gpt(fusion: bool, dtype: torch.dtype = torch.float32, untied: bool = True):
    torch.manual_seed(SEED)
    bf16 = dtype == torch.bfloat16
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, bf16=bf16, gradient_accumulation_fusion=fusion)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=not untied)
    if bf16:
        return Float16Module(config, model)
    return model.to(dtype)


def _batches():
    generator = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (MBS, SEQ), generator=generator),
             torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)) for _ in range(MICRO)]


def _backward(model, batches) -> None:
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    for tokens, labels in batches:
        (model(tokens, positions, None, labels=labels).float().mean() / len(batches)).backward()


def _main_grads(fusion: bool, dtype: torch.dtype = torch.float32, untied: bool = True, grad_fp32: bool = False):
    """{name: accumulated main_grad (fp64 copy)} of MICRO micro-batches, and the wrapped model."""
    model = _gpt(fusion, dtype, untied)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=grad_fp32), model)
    ddp.zero_grad_buffer()
    batches = _batches()
    with ddp.no_sync():
        _backward(ddp, batches[:-1])
    _backward(ddp, batches[-1:])
    ddp.finish_grad_sync()
    return {name.removeprefix("module."): p.main_grad.double().clone()  # Float16Module's prefix
            for name, p in ddp.module.named_parameters()}, ddp


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("untied", [True, False], ids=["untied", "tied"])
def test_fp32_fused_main_grads_equal_unfused(single_process, untied):
    fused, _ = _main_grads(True, untied=untied)
    unfused, _ = _main_grads(False, untied=untied)
    assert fused.keys() == unfused.keys()
    # Bit for bit here (CPU BLAS); addmm_ (beta = 1) may round differently from mm then add_.
    errors = {name: _relative_error(fused[name], unfused[name]) for name in fused}
    bad = {name: error for name, error in errors.items() if error > 1e-6}
    assert not bad, bad
    assert all(fused[name].abs().max() > 0 for name in fused if name.endswith(FUSED_SUFFIXES))


def test_bf16_fused_equals_the_unfused_path_on_cpu(single_process):
    """On CPU a bf16 weight gradient is one bf16 GEMM (fp32 accumulation inside, the product rounded
    once) added into the fp32 main_grad, as without fusion: the two paths agree, and both are
    within bf16 tolerance of fp64."""
    reference, _ = _main_grads(False, dtype=torch.float64)
    fused, _ = _main_grads(True, dtype=torch.bfloat16, grad_fp32=True)
    unfused, _ = _main_grads(False, dtype=torch.bfloat16, grad_fp32=True)
    for name in fused:
        assert _relative_error(fused[name], unfused[name]) < 1e-6, name
    weights = [name for name in fused if name.endswith(FUSED_SUFFIXES) or name == "output_layer.weight"]
    assert max(_relative_error(fused[name], reference[name]) for name in weights) < 5e-2


def test_bf16_layer_gradient_on_cpu_is_a_bf16_gemm_added_in_fp32(single_process):
    """One layer, bf16 weight, fp32 main_grad, 4 micro-batches: each micro-batch's product is
    rounded to bf16 once and summed in fp32 -- the unfused path's numbers, bit for bit."""
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, params_dtype=torch.bfloat16,
                               gradient_accumulation_fusion=True)
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(64, 4, 64, generator=generator).bfloat16() for _ in range(4)]  # [s, b, in]
    grads = [torch.randn(64, 4, 96, generator=generator).bfloat16() for _ in range(4)]  # [s, b, out]
    exact = sum(g.double().reshape(-1, 96).t() @ x.double().reshape(-1, 64) for x, g in zip(inputs, grads))
    expected = sum((g.reshape(-1, 96).t() @ x.reshape(-1, 64)).float() for x, g in zip(inputs, grads))
    main_grads = {}
    for fusion in (True, False):
        torch.manual_seed(SEED)
        layer = ColumnParallelLinear(64, 96, config=config, init_method=torch.nn.init.normal_, bias=False)
        layer.gradient_accumulation_fusion = fusion
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer)
        for x, g in zip(inputs, grads):
            output, _ = ddp(x.requires_grad_())
            output.backward(g)
        assert layer.weight.grad is None and layer.weight.main_grad.dtype == torch.float32
        main_grads[fusion] = layer.weight.main_grad.clone()
    assert torch.equal(main_grads[True], main_grads[False])
    assert torch.equal(main_grads[True], expected)
    assert _relative_error(main_grads[True].double(), exact) < 1e-2


def test_fused_weights_get_only_a_placeholder_and_no_grad_is_left(single_process):
    model = _gpt(True)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    arrived = {}

    def record(name):
        # A tensor hook runs before AccumulateGrad (and so before DDP's post-accumulate hook).
        def hook(grad):
            param = dict(model.named_parameters())[name]
            arrived[name] = (getattr(param, "grad_added_to_main_grad", False), grad.shape == param.shape)
        return hook

    for name, param in model.named_parameters():
        param.register_hook(record(name))
    ddp.zero_grad_buffer()
    _backward(ddp, _batches()[:2])
    fused = {name for name, (flag, _) in arrived.items() if flag}
    expected = {name for name in arrived if name.endswith(FUSED_SUFFIXES) or name == "output_layer.weight"}
    assert fused == expected and len(fused) == 4 * LAYERS + 1
    assert all(same_shape for _, same_shape in arrived.values())  # the placeholder is weight-sized
    for name, param in model.named_parameters():
        assert param.grad is None, name
        assert param.grad_added_to_main_grad is False, name


def test_without_main_grad_the_layer_returns_its_gradient(single_process):
    """Fusion on but no DDP wrapper (no main_grad): the weight gradient goes to .grad as usual."""
    grads = {}
    for fusion in (True, False):
        model = _gpt(fusion)
        _backward(model, _batches())
        grads[fusion] = {name: p.grad.clone() for name, p in model.named_parameters()}
    for name in grads[True]:
        assert _relative_error(grads[True][name], grads[False][name]) < 1e-6, name


TINY_RUN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --max-position-embeddings 8 --seq-length 8 "
            "--micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 100").split()


def test_flag_reaches_the_config(single_process):
    default = core_transformer_config_from_args(parse_and_validate_args(argv=TINY_RUN))
    off_args = parse_and_validate_args(argv=TINY_RUN + ["--no-gradient-accumulation-fusion"])
    off = core_transformer_config_from_args(off_args)
    assert off.gradient_accumulation_fusion is False
    assert default.gradient_accumulation_fusion is True  # Megatron's default
