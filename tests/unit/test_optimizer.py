"""Megatron optimizers: param groups, fp16 loss scaling, clipping, bf16 main params, state."""

import copy
import io
import math

import pytest
import torch
from torch import nn

from megatron.core.optimizer import (
    ConstantGradScaler,
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    clip_grad_norm_fp32,
    count_zeros_fp32,
    get_megatron_optimizer,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.linear2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.norm(self.linear1(x)))


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny()
    with torch.no_grad():  # non-trivial norm params so that decay would show
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model.to(dtype)


def _config(**kwargs) -> OptimizerConfig:
    base = {"lr": 0.01, "weight_decay": 0.1, "clip_grad": 1.0}
    base.update(kwargs)
    return OptimizerConfig(**base)


def _set_grads(model: nn.Module, value_fn, scale: float = 1.0) -> None:
    for i, p in enumerate(model.parameters()):
        p.grad = (value_fn(i, p) * scale).to(p.dtype)


def _ramp_grads(i: int, p: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape) * (i + 1)


def _params(model: nn.Module) -> list:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(a: list, b: list) -> None:
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---------------------------------------------------------------- param groups and decay
def test_no_weight_decay_on_biases_and_norms():
    model = _model()
    opt = get_megatron_optimizer(_config(), [model])
    assert isinstance(opt, FP32Optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    by_wd = {g["wd_mult"]: sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups}
    assert by_wd[1.0] == ["linear1.weight", "linear2.weight"]
    assert by_wd[0.0] == ["linear1.bias", "linear2.bias", "norm.bias", "norm.weight"]
    assert all(g["lr_mult"] == 1.0 for g in opt.param_groups)
    assert {g["wd_mult"]: g["weight_decay"] for g in opt.param_groups} == {1.0: 0.1, 0.0: 0.0}


def test_decay_step_leaves_biases_and_norms_unchanged():
    model = _model()
    opt = get_megatron_optimizer(_config(lr=0.1, weight_decay=0.5), [model])
    sched = OptimizerParamScheduler(opt, 0.1, 0.1, 0.0, 0, 100, "constant", 0.5, 0.5, 100, "constant")
    assert {g["wd_mult"]: g["weight_decay"] for g in opt.param_groups} == {1.0: 0.5, 0.0: 0.0}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _set_grads(model, lambda i, p: torch.zeros_like(p))  # Adam's update is 0: only decay acts
    assert opt.step()[0]
    sched.step(1)
    for name, p in model.named_parameters():
        if name.endswith("weight") and p.ndim == 2:
            torch.testing.assert_close(p, before[name] * (1 - 0.1 * 0.5))
        else:
            assert torch.equal(p, before[name]), name


def test_tied_params_appear_once_and_conditions_apply():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    opt = get_megatron_optimizer(_config(), [nn.ModuleList([emb, head]), nn.ModuleList([head])],
                                 no_weight_decay_cond=lambda n, p: True,
                                 scale_lr_cond=lambda n, p: True, lr_mult=3.0)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == 1 and params[0] is emb.weight
    assert opt.param_groups[0]["wd_mult"] == 0.0 and opt.param_groups[0]["lr_mult"] == 3.0


def test_sgd_and_plain_adam():
    assert isinstance(get_megatron_optimizer(_config(optimizer="sgd"), [_model()]).optimizer, torch.optim.SGD)
    adam = get_megatron_optimizer(_config(decoupled_weight_decay=False), [_model()]).optimizer
    assert type(adam) is torch.optim.Adam


# ---------------------------------------------------------------- clipping
@pytest.mark.parametrize("norm_type", [2, 1, math.inf])
@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_clip_grad_norm_matches_torch(norm_type, max_norm):
    ours, ref = _model(), _model()
    _set_grads(ours, _ramp_grads)
    _set_grads(ref, _ramp_grads)
    norm = clip_grad_norm_fp32(list(ours.parameters()), max_norm, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    assert norm == pytest.approx(ref_norm.item(), rel=1e-6)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_clip_takes_bare_grads_and_reports_inf():
    grads = [torch.full((3,), 3.0), torch.full((1,), 4.0 * math.sqrt(3))]
    assert clip_grad_norm_fp32(grads, 1.0) == pytest.approx(math.sqrt(27 + 48))
    assert torch.linalg.vector_norm(torch.cat(grads)).item() == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm_fp32([torch.tensor([1.0, math.inf])], 1.0) == math.inf
    assert count_zeros_fp32([torch.tensor([0.0, 1.0, 0.0]), torch.zeros(2, 2)]) == 6


def test_fp32_step_matches_torch_adamw_with_clipping():
    model, ref = _model(), _model()
    opt = get_megatron_optimizer(_config(clip_grad=0.1, log_num_zeros_in_grad=True), [model])
    ref_opt = torch.optim.AdamW([{"params": [ref.linear1.weight, ref.linear2.weight], "weight_decay": 0.1},
                                 {"params": [ref.linear1.bias, ref.norm.weight, ref.norm.bias,
                                             ref.linear2.bias], "weight_decay": 0.0}], lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        _set_grads(model, _ramp_grads)
        _set_grads(ref, _ramp_grads)
        ok, grad_norm, zeros = opt.step()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        ref_zeros = sum(int((p.grad == 0).sum()) for p in ref.parameters())
        assert ok and zeros == ref_zeros and grad_norm == pytest.approx(ref_norm.item(), rel=1e-6)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    assert opt.get_loss_scale().item() == 1.0
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- fp16 loss scaling
def _fp16(model: nn.Module, **kwargs) -> Float16OptimizerWithFloat16Params:
    config = _config(fp16=True, params_dtype=torch.float16, initial_loss_scale=2.0 ** 10, **kwargs)
    opt = get_megatron_optimizer(config, [model])
    assert isinstance(opt, Float16OptimizerWithFloat16Params)
    return opt


def _fp16_step(opt, model: nn.Module, overflow: bool):
    """Scaled grads as backward would leave them; optionally one inf entry."""
    scale = opt.get_loss_scale().item()
    _set_grads(model, _ramp_grads, scale)
    if overflow:
        model.linear2.weight.grad[0, 0] = math.inf
    return opt.step()


def test_fp16_overflow_skips_step_and_halves_scale():
    model = _model(torch.float16)
    opt = _fp16(model, hysteresis=1)
    assert isinstance(opt.grad_scaler, DynamicGradScaler)
    before, main_before = _params(model), [p.detach().clone() for p in opt.get_parameters()]
    assert _fp16_step(opt, model, overflow=True) == (False, None, None)
    _assert_same(before, _params(model))
    _assert_same(main_before, [p.detach().clone() for p in opt.get_parameters()])
    assert opt.get_loss_scale().item() == 2.0 ** 9
    opt.zero_grad()
    ok, grad_norm, _ = _fp16_step(opt, model, overflow=False)
    assert ok and grad_norm is not None and math.isfinite(grad_norm)
    assert opt.get_loss_scale().item() == 2.0 ** 9
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(model)))


def test_fp16_grads_are_unscaled():
    """A real backward of the scaled loss gives the fp32 model's grad norm."""
    model, ref = _model(torch.float16), _model(torch.float16).float()
    opt = _fp16(model, clip_grad=1e9)
    x = torch.randn(5, 4)
    opt.scale_loss(model(x.half()).float().pow(2).mean()).backward()
    ref(x).pow(2).mean().backward()
    ok, grad_norm, _ = opt.step()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()
    assert ok and grad_norm == pytest.approx(ref_norm, rel=1e-2)


def test_hysteresis_two_needs_two_overflows():
    model = _model(torch.float16)
    opt = _fp16(model, hysteresis=2)
    assert _fp16_step(opt, model, overflow=True)[0] is False
    assert opt.get_loss_scale().item() == 2.0 ** 10
    assert _fp16_step(opt, model, overflow=True)[0] is False
    assert opt.get_loss_scale().item() == 2.0 ** 9


def test_scale_grows_after_window_and_restores_hysteresis():
    scaler = DynamicGradScaler(2.0 ** 4, 1.0, growth_interval=3, hysteresis=2)
    scaler.update(True)  # hysteresis 2 -> 1, scale kept
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale.item() == 16.0
    scaler.update(False)  # third clean step in a row
    assert scaler.scale.item() == 32.0 and scaler.inv_scale.item() == 1 / 32
    scaler.update(True)  # hysteresis was restored to 2 by the growth: no backoff yet
    assert scaler.scale.item() == 32.0
    scaler.update(True)
    assert scaler.scale.item() == 16.0


def test_clean_step_does_not_restore_hysteresis():
    # Megatron: only a growth restores the hysteresis budget, so overflow, clean, overflow backs off.
    scaler = DynamicGradScaler(2.0 ** 4, 1.0, growth_interval=100, hysteresis=2)
    scaler.update(True)
    scaler.update(False)
    scaler.update(True)
    assert scaler.scale.item() == 8.0
    restored = DynamicGradScaler(1.0, 1.0)
    restored.load_state_dict(_round_trip(scaler.state_dict()))
    assert restored.scale.item() == 8.0 and restored.state_dict()["hysteresis_tracker"] == 0


def test_growth_through_the_optimizer():
    model = _model(torch.float16)
    opt = _fp16(model, loss_scale_window=2)
    for _ in range(2):
        assert _fp16_step(opt, model, overflow=False)[0]
    assert opt.get_loss_scale().item() == 2.0 ** 11


def test_min_loss_scale_floor():
    scaler = DynamicGradScaler(4.0, 2.0, hysteresis=1)
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale.item() == 2.0
    with pytest.raises(ValueError, match="min loss scale"):
        DynamicGradScaler(4.0, 8.0)


def test_constant_loss_scale_still_skips_overflow():
    model = _model(torch.float16)
    opt = _fp16(model, loss_scale=128.0)
    assert isinstance(opt.grad_scaler, ConstantGradScaler)
    before = _params(model)
    assert _fp16_step(opt, model, overflow=True) == (False, None, None)
    _assert_same(before, _params(model))
    assert opt.get_loss_scale().item() == 128.0
    assert _fp16_step(opt, model, overflow=False)[0]
    assert opt.get_loss_scale().item() == 128.0
    loss = torch.tensor(0.5)
    assert opt.scale_loss(loss).shape == loss.shape and opt.scale_loss(loss).item() == 64.0


def test_fp16_reads_main_grad_when_present():
    model = _model(torch.float16)
    opt = _fp16(model, clip_grad=0.0)
    for p in model.parameters():
        p.main_grad = torch.full(p.shape, 2.0 ** 10, dtype=torch.float32)  # unscales to 1.0
    opt.step()
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in opt.get_parameters())


# ---------------------------------------------------------------- bf16
def test_bf16_main_params_fp32_and_model_follows():
    model = _model(torch.bfloat16)
    opt = get_megatron_optimizer(_config(bf16=True, lr=1e-4), [model])
    assert isinstance(opt, Float16OptimizerWithFloat16Params) and opt.grad_scaler is None
    assert opt.get_loss_scale().item() == 1.0
    assert all(p.dtype == torch.float32 for p in opt.get_parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    start = [p.detach().clone() for p in opt.get_parameters()]
    _set_grads(model, _ramp_grads)
    assert opt.step()[0]
    assert {id(p.main_param) for p in model.parameters()} == {id(p) for p in opt.get_parameters()}
    for model_param in model.parameters():
        assert torch.equal(model_param, model_param.main_param.to(torch.bfloat16))
    # A 1e-4 step is below bf16 resolution for most entries but kept in the fp32 main params.
    assert all(not torch.equal(a, b) for a, b in zip(start, opt.get_parameters()))


# ---------------------------------------------------------------- state dict round trip
def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _run(opt, model, steps: int, fp16: bool) -> None:
    for step in range(steps):
        opt.zero_grad()
        scale = opt.get_loss_scale().item()
        _set_grads(model, lambda i, p, k=step + 1: _ramp_grads(i, p) * k, scale)
        if fp16 and step == 0:
            model.linear1.bias.grad[0] = math.nan  # exercise the scaler state too
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_dict_round_trip_gives_identical_steps(dtype):
    fp16 = dtype == torch.float16
    kwargs = {"fp16": True, "initial_loss_scale": 2.0 ** 10, "hysteresis": 1} if fp16 else {}
    model_a = _model(dtype)
    opt_a = get_megatron_optimizer(_config(**kwargs), [model_a])
    _run(opt_a, model_a, 3, fp16)
    state = _round_trip(opt_a.state_dict())
    model_b = _model(dtype, seed=1)
    model_b.load_state_dict(copy.deepcopy(model_a.state_dict()))
    opt_b = get_megatron_optimizer(_config(**kwargs), [model_b])
    opt_b.load_state_dict(state)
    if fp16:
        assert opt_b.get_loss_scale().item() == opt_a.get_loss_scale().item() == 2.0 ** 9
        assert "fp32_from_fp16_params" in state and "grad_scaler" in state
    _run(opt_a, model_a, 2, False)
    _run(opt_b, model_b, 2, False)
    _assert_same(_params(model_a), _params(model_b))
    _assert_same([p.detach() for p in opt_a.get_parameters()], [p.detach() for p in opt_b.get_parameters()])


def test_fp16_state_dict_restores_fp32_main_params_not_the_rounded_model():
    model_a = _model(torch.float16)
    opt_a = _fp16(model_a)
    _run(opt_a, model_a, 2, False)
    model_b = _model(torch.float16)
    model_b.load_state_dict(model_a.state_dict())
    opt_b = _fp16(model_b)
    rounded = [p.detach().clone() for p in opt_b.get_parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(rounded, opt_a.get_parameters()))
    opt_b.load_state_dict(_round_trip(opt_a.state_dict()))
    _assert_same([p.detach() for p in opt_a.get_parameters()], [p.detach() for p in opt_b.get_parameters()])
    opt_b.reload_model_params()  # back to the model's (fp16-rounded) values
    _assert_same(rounded, [p.detach() for p in opt_b.get_parameters()])
