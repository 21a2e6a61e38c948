"""OptimizerParamScheduler: closed-form learning rates and weight decays, checkpoint rules."""

import math

import pytest

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

MAX_LR, MIN_LR = 1.0, 0.1
WARMUP, DECAY = 100, 1000


class _Groups:
    """Stands in for an optimizer: the scheduler only touches param_groups."""

    def __init__(self, *groups: dict) -> None:
        self.param_groups = [dict(g) for g in groups] or [{}]


def _sched(style: str = "linear", warmup: int = WARMUP, init_lr: float = 0.0, optimizer=None,
           **kwargs) -> OptimizerParamScheduler:
    defaults = {"start_wd": 0.01, "end_wd": 0.01, "wd_incr_steps": DECAY, "wd_incr_style": "constant"}
    defaults.update(kwargs)
    return OptimizerParamScheduler(optimizer or _Groups(), init_lr=init_lr, max_lr=MAX_LR,
                                   min_lr=MIN_LR, lr_warmup_steps=warmup, lr_decay_steps=DECAY,
                                   lr_decay_style=style, **defaults)


def _lr_at(sched: OptimizerParamScheduler, num_steps: int) -> float:
    sched.num_steps = 0
    sched.step(num_steps)
    return sched.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("init_lr", [0.0, 0.2])
def test_warmup_is_linear_from_init_lr(init_lr):
    sched = _sched("cosine", init_lr=init_lr)
    assert _lr_at(sched, 0) == pytest.approx(init_lr)
    assert _lr_at(sched, 25) == pytest.approx(init_lr + (MAX_LR - init_lr) * 0.25)
    assert _lr_at(sched, 50) == pytest.approx(init_lr + (MAX_LR - init_lr) * 0.5)
    assert _lr_at(sched, WARMUP) == pytest.approx(MAX_LR)


# (style, num_steps, expected lr) with warmup 100, decay 1000, max 1.0, min 0.1.
_CASES = [
    ("constant", 500, 1.0), ("constant", 5000, 1.0),
    ("linear", 550, 0.1 + 0.9 * 0.5), ("linear", 325, 0.1 + 0.9 * 0.75), ("linear", 1000, 0.1),
    ("cosine", 550, 0.55), ("cosine", 325, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),
    ("cosine", 1000, 0.1),
    ("inverse-square-root", 400, 0.5), ("inverse-square-root", 900, 1.0 / 3.0),
    ("inverse-square-root", 200, 1.0 / math.sqrt(2.0)),
]


@pytest.mark.parametrize("style,num_steps,expected", _CASES)
def test_decay_styles_closed_form(style, num_steps, expected):
    assert _lr_at(_sched(style), num_steps) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root"])
def test_past_decay_end_gives_min_lr(style):
    sched = _sched(style)
    assert _lr_at(sched, DECAY + 1) == MIN_LR
    assert _lr_at(sched, 10 * DECAY) == MIN_LR


def test_inverse_square_root_is_floored_at_min_lr():
    # max_lr * sqrt(100 / 900) = 0.333 > min; with min 0.5 the floor wins.
    sched = OptimizerParamScheduler(_Groups(), 0.0, 1.0, 0.5, WARMUP, DECAY, "inverse-square-root",
                                    0.0, 0.0, DECAY, "constant")
    assert _lr_at(sched, 900) == 0.5


# WSD: stable until 800 (= 1000 - 200), then anneal over 200 steps; at 900 the ratio is 0.5.
_WSD = [
    ("linear", 0.5), ("cosine", 0.5),
    ("exponential", 2.0 * math.sqrt(0.5) - 1.0), ("minus_sqrt", 1.0 - math.sqrt(0.5)),
]


@pytest.mark.parametrize("wsd_style,coeff_at_900", _WSD)
def test_wsd_decay_styles(wsd_style, coeff_at_900):
    sched = _sched("WSD", wsd_decay_steps=200, lr_wsd_decay_style=wsd_style)
    assert _lr_at(sched, 50) == pytest.approx(0.5)  # still warming up
    assert _lr_at(sched, 500) == MAX_LR
    assert _lr_at(sched, 800) == MAX_LR
    assert _lr_at(sched, 900) == pytest.approx(MIN_LR + coeff_at_900 * (MAX_LR - MIN_LR))
    assert _lr_at(sched, 1000) == pytest.approx(MIN_LR, abs=1e-12)
    assert _lr_at(sched, 1001) == MIN_LR


def test_wsd_needs_its_decay_steps():
    with pytest.raises(ValueError, match="wsd_decay_steps"):
        _sched("WSD", lr_wsd_decay_style="linear")


def test_steps_count_samples_and_groups_get_multipliers():
    groups = _Groups({"lr_mult": 1.0, "wd_mult": 1.0}, {"lr_mult": 0.5, "wd_mult": 0.0},
                     {"max_lr": 2.0})
    sched = _sched("linear", optimizer=groups, start_wd=0.0, end_wd=0.1, wd_incr_style="linear")
    for _ in range(11):  # 11 iterations of global batch size 50 = 550 samples
        sched.step(increment=50)
    assert sched.num_steps == 550
    g0, g1, g2 = groups.param_groups
    assert g0["lr"] == pytest.approx(0.55) and g0["weight_decay"] == pytest.approx(0.055)
    assert g1["lr"] == pytest.approx(0.275) and g1["weight_decay"] == 0.0
    assert g2["lr"] == pytest.approx(0.1 + 1.9 * 0.5)  # the group's own max_lr


@pytest.mark.parametrize("style,steps,expected", [
    ("linear", 250, 0.025), ("linear", 1000, 0.1), ("linear", 5000, 0.1),
    ("cosine", 500, 0.05), ("cosine", 250, 0.1 * 0.5 * (1 - math.cos(math.pi / 4))),
])
def test_weight_decay_increment(style, steps, expected):
    sched = _sched(start_wd=0.0, end_wd=0.1, wd_incr_style=style)
    sched.num_steps = steps
    assert sched.get_wd() == pytest.approx(expected, abs=1e-12)


def test_constant_wd_needs_equal_start_and_end():
    assert _sched(start_wd=0.05, end_wd=0.05).get_wd() == 0.05
    with pytest.raises(ValueError, match="start_wd"):
        _sched(start_wd=0.0, end_wd=0.1, wd_incr_style="constant")


@pytest.mark.parametrize("kwargs,field", [
    ({"lr_warmup_steps": DECAY}, "lr_warmup_steps"),
    ({"init_lr": 2.0}, "init_lr"),
    ({"lr_decay_style": "step"}, "lr_decay_style"),
    ({"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": True}, "override"),
])
def test_constructor_validation(kwargs, field):
    base = {"init_lr": 0.0, "max_lr": MAX_LR, "min_lr": MIN_LR, "lr_warmup_steps": WARMUP,
            "lr_decay_steps": DECAY, "lr_decay_style": "linear", "start_wd": 0.0, "end_wd": 0.0,
            "wd_incr_steps": DECAY, "wd_incr_style": "constant"}
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        OptimizerParamScheduler(_Groups(), **base)


def test_state_dict_round_trip():
    source = _sched("cosine", start_wd=0.0, end_wd=0.1, wd_incr_style="linear")
    for _ in range(7):
        source.step(increment=64)
    state = source.state_dict()
    assert set(state) == {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style",
                          "lr_decay_steps", "min_lr", "start_wd", "end_wd", "wd_incr_style",
                          "wd_incr_steps"}
    target = _sched("cosine", start_wd=0.0, end_wd=0.1, wd_incr_style="linear")
    target.load_state_dict(state)
    assert target.num_steps == 7 * 64
    assert target.optimizer.param_groups == source.optimizer.param_groups
    source.step(64)
    target.step(64)
    assert target.optimizer.param_groups[0]["lr"] == source.optimizer.param_groups[0]["lr"]


def _checkpoint_with_max_lr(max_lr: float) -> dict:
    source = OptimizerParamScheduler(_Groups(), 0.0, max_lr, MIN_LR, WARMUP, DECAY, "linear",
                                     0.0, 0.0, DECAY, "constant")
    source.step(550)
    return source.state_dict()


def test_use_checkpoint_takes_the_checkpoint_value():
    target = _sched("linear", start_wd=0.0, end_wd=0.0, use_checkpoint_opt_param_scheduler=True)
    target.load_state_dict(_checkpoint_with_max_lr(0.5))
    assert target.max_lr == 0.5
    assert target.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 + 0.4 * 0.5)


def test_override_keeps_the_class_value():
    target = _sched("linear", start_wd=0.0, end_wd=0.0, override_opt_param_scheduler=True,
                    use_checkpoint_opt_param_scheduler=False)
    target.load_state_dict(_checkpoint_with_max_lr(0.5))
    assert target.max_lr == MAX_LR
    assert target.num_steps == 550  # the step count always comes from the checkpoint
    assert target.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)


def test_mismatch_without_either_flag_names_the_field():
    target = _sched("linear", start_wd=0.0, end_wd=0.0, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="learning rate"):
        target.load_state_dict(_checkpoint_with_max_lr(0.5))
    # Matching values load fine without either flag.
    target.load_state_dict(_checkpoint_with_max_lr(MAX_LR))
    assert target.num_steps == 550


def test_loads_old_megatron_keys():
    old = {"start_lr": MAX_LR, "min_lr": MIN_LR, "warmup_iter": WARMUP, "end_iter": DECAY,
           "decay_style": "linear", "num_iters": 550}
    target = _sched("linear", use_checkpoint_opt_param_scheduler=False)
    target.load_state_dict(old)
    assert target.num_steps == 550
    assert target.optimizer.param_groups[0]["lr"] == pytest.approx(0.55)
