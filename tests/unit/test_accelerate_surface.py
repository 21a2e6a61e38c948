"""The names HuggingFace Accelerate's Megatron-LM integration imports from `megatron`, and how they behave.

accelerate/utils/megatron_lm.py (1.16) imports its Megatron surface in one block; (a) every name there
imports here, and (b) each function this project adds for it behaves as Megatron-LM's (core_v0.13+),
checked against a direct computation: masks built by hand, losses computed from the model, the
padding rule, a 7-argument train_step on a tiny GPT, checkpoints saved and loaded in Accelerate's
call form. Accelerate itself is only needed by (a): without it that test skips.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import math
import re
from functools import partial
from pathlib import Path

import pytest
import torch

from megatron.core import device
from megatron.training.utils import get_ltor_masks_and_position_ids

# ----------------------------------------------------------------------------- (a) the import block

def _accelerate_megatron_imports() -> list[tuple[str, str]]:
    """(module, name) of every `from megatron... import name` in the installed accelerate's
    utils/megatron_lm.py (the integration's import block) and utils/dataclasses.py (the plugin's
    _add_logging_args)."""
    spec = importlib.util.find_spec("accelerate")
    if spec is None or spec.origin is None:
        pytest.skip("accelerate is not installed")
    found = []
    for name in ("megatron_lm.py", "dataclasses.py"):
        tree = ast.parse((Path(spec.origin).parent / "utils" / name).read_text())
        found += [(node.module, alias.name) for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "megatron"
                  for alias in node.names]
    return found


def _resolve(module: str, name: str) -> object:
    """`from module import name`, as the import statement resolves it (an attribute, else a submodule)."""
    imported = importlib.import_module(module)
    if hasattr(imported, name):
        return getattr(imported, name)
    return importlib.import_module(f"{module}.{name}")


def test_every_name_accelerate_imports_from_megatron_imports():
    imports = _accelerate_megatron_imports()
    assert len(imports) > 40  # the block was found (accelerate 1.16: 46 names)
    failures = {}
    for module, name in imports:
        try:
            _resolve(module, name)
        except ImportError as error:
            failures[f"{module}.{name}"] = str(error)
    assert failures == {}


def test_tensor_parallel_is_an_attribute_of_megatron_core_with_megatrons_signatures():
    import inspect

    import megatron.core

    tensor_parallel = megatron.core.tensor_parallel  # `from megatron.core import mpu, tensor_parallel`
    assert megatron.core.mpu is megatron.core.parallel_state
    expected = {
        "broadcast_data": ["keys", "data", "datatype"],
        "vocab_parallel_cross_entropy": ["vocab_parallel_logits", "target", "label_smoothing"],
        "gather_from_tensor_model_parallel_region": ["input_", "group"],
        "scatter_to_tensor_model_parallel_region": ["input_", "group"],
        "copy_to_tensor_model_parallel_region": ["input_", "group"],
        "reduce_from_tensor_model_parallel_region": ["input_", "group"],
        "gather_from_sequence_parallel_region": ["input_", "tensor_parallel_output_grad", "group"],
    }
    for name, parameters in expected.items():
        assert list(inspect.signature(getattr(tensor_parallel, name)).parameters)[:len(parameters)] == parameters


# ----------------------------------------------------------------------------- get_ltor_masks_and_position_ids

def _megatron_masks(data, eod, pad, reset_position_ids, reset_attention_mask, eod_mask_loss, pad_mask_loss):
    """Megatron-LM's loops, written out (with eod == pad, where its eod/pad index intersection is the eods)."""
    b, s = data.shape
    mask = torch.tril(torch.ones((b if reset_attention_mask else 1, s, s))).view(-1, 1, s, s)
    loss_mask = torch.ones(data.shape)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    if pad_mask_loss:
        loss_mask[data == pad] = 0.0
    positions = torch.arange(s).unsqueeze(0).expand_as(data).clone()
    for row in range(b):
        previous = 0
        for i in torch.nonzero(data[row] == eod).flatten().tolist():
            if reset_attention_mask:
                mask[row, 0, i + 1:, :i + 1] = 0
            if reset_position_ids:
                positions[row, i + 1:] -= i + 1 - previous
                previous = i + 1
    return mask < 0.5, loss_mask, positions


def test_ltor_masks_match_a_hand_built_mask():
    eod = 0
    data = torch.tensor([[5, 1, eod, 3, 4, eod, 7, 8]])
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        data, eod_token=eod, pad_token=eod, reset_position_ids=True, reset_attention_mask=True,
        eod_mask_loss=True, pad_mask_loss=True)  # Accelerate's call
    visible = torch.zeros(8, 8, dtype=torch.bool)  # row attends column: causal within a document (eod included)
    for start, end in ((0, 3), (3, 6), (6, 8)):
        for q in range(start, end):
            visible[q, start:q + 1] = True
    assert attention_mask.dtype == torch.bool and attention_mask.shape == (1, 1, 8, 8)
    assert torch.equal(attention_mask[0, 0], ~visible)  # True = masked
    assert loss_mask.dtype == torch.float32 and loss_mask.tolist() == [[1, 1, 0, 1, 1, 0, 1, 1]]
    assert position_ids.dtype == torch.long and position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]


@pytest.mark.parametrize("flags", [(False, False, False), (True, False, False), (False, True, False),
                                   (True, True, True)])
def test_ltor_masks_match_megatrons_loops_on_a_batch(flags):
    reset_position_ids, reset_attention_mask, eod_mask_loss = flags
    data = torch.randint(0, 6, (3, 17), generator=torch.Generator().manual_seed(0))  # eod 0 about every 6th
    got = get_ltor_masks_and_position_ids(data, 0, 0, reset_position_ids, reset_attention_mask, eod_mask_loss, False)
    want = _megatron_masks(data, 0, 0, reset_position_ids, reset_attention_mask, eod_mask_loss, False)
    assert got[0].shape == ((3, 1, 17, 17) if reset_attention_mask else (1, 1, 17, 17))
    for a, b in zip(got, want):
        assert torch.equal(a, b.to(a.dtype))


def test_pad_tokens_mask_the_loss_but_do_not_end_documents():
    eod, pad = 0, 9
    data = torch.tensor([[1, 2, eod, 3, pad, pad]])
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        data, eod, pad, True, True, eod_mask_loss=False, pad_mask_loss=True)
    assert loss_mask.tolist() == [[1, 1, 1, 1, 0, 0]]
    assert position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert attention_mask[0, 0, 5].tolist() == [True, True, True, False, False, False]
    with pytest.raises(TypeError):  # core_v0.13's 5-argument form: pad_token and pad_mask_loss are required now
        get_ltor_masks_and_position_ids(data, eod, False, False, False)


# ----------------------------------------------------------------------------- arguments, padding

def test_every_add_args_helper_returns_its_parser():
    from megatron.training import arguments

    helpers = [name for name in dir(arguments) if re.fullmatch(r"_add_\w+_args", name)]
    assert {"_add_data_args", "_add_validation_args", "_add_logging_args"} <= set(helpers)
    for name in helpers:
        parser = argparse.ArgumentParser()
        assert getattr(arguments, name)(parser) is parser, name
    parser = argparse.ArgumentParser()  # MegatronLMDummyDataLoader's use
    parser = arguments._add_data_args(parser)
    parser = arguments._add_validation_args(parser)
    known, _ = parser.parse_known_args([])
    assert known.data_path is None and known.split is None and known.eval_iters == 100


@pytest.mark.parametrize("vocab, divisible, tp", [(50257, 128, 1), (50257, 128, 2), (30522, 128, 8), (256, 1, 1),
                                                   (100, 7, 3)])
def test_vocab_size_with_padding_follows_megatrons_rule(vocab, divisible, tp, capsys):
    from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding

    args = argparse.Namespace(make_vocab_size_divisible_by=divisible, tensor_model_parallel_size=tp, rank=0)
    padded = math.ceil(vocab / (divisible * tp)) * divisible * tp
    assert _vocab_size_with_padding(vocab, args, logging_enabled=False) == padded
    assert capsys.readouterr().out == ""
    assert _vocab_size_with_padding(vocab, args) == padded
    assert capsys.readouterr().out == (f" > padded vocab (size: {vocab}) with {padded - vocab} dummy tokens "
                                       f"(new size: {padded})\n")


def test_validate_args_takes_accelerates_args_without_data(monkeypatch):
    """Accelerate parses with ignore_unknown_args, sets its defaults on the Namespace (no data path:
    its own loader brings the data) and calls validate_args(args)."""
    from megatron.training.arguments import parse_args, validate_args

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    args = parse_args(None, ignore_unknown_args=True, argv=["--unknown-flag-of-the-script"])
    for key, value in dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=32,
                           seq_length=32, micro_batch_size=2, global_batch_size=2, train_iters=10, lr=1e-3,
                           tokenizer_type="GPT2BPETokenizer", orig_vocab_size=100, megatron_dataset_flag=False,
                           model_type_name="gpt", num_micro_batches=1, consumed_samples=None).items():
        setattr(args, key, value)
    assert validate_args(args).data_path is None


# ----------------------------------------------------------------------------- one tiny run, in process

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "4", "--log-interval", "1",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--seed", "1234", "--ckpt-format", "torch"]
EOD = 99  # NullTokenizer(--vocab-size 99): ids 0..99, 99 its eod (Megatron's)


@pytest.fixture
def megatron_run(monkeypatch):
    """initialize_megatron with TINY (plus flags) in this process, torn down afterwards."""
    from megatron.training.initialize import initialize_megatron, reset_megatron

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()

    def start(*flags):
        return initialize_megatron(argv=[*TINY, *flags])

    yield start
    reset_megatron()
    torch.set_num_threads(threads)


def _gpt(args):
    from megatron.core.enums import ModelType
    from megatron.training.gpt_builders import gpt_builder
    from megatron.training.training import setup_model_and_optimizer

    return setup_model_and_optimizer(partial(gpt_builder, args), ModelType.encoder_or_decoder)


def _batches(count, micro_batch_size, seq):
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, EOD + 1, (count, micro_batch_size, seq + 1), generator=g)
    data[:, :, 5] = EOD  # a document boundary in every sample
    return [{"input_ids": sample} for sample in data]


def _accelerate_forward_step(data_iterator, model):
    """Accelerate's GPTTrainStep: its get_batch_transformer (eod as pad), and a loss function returning
    (loss, {"lm loss": averaged}) through average_losses_across_data_parallel_group."""
    from megatron.training.utils import average_losses_across_data_parallel_group

    tokens_ = next(data_iterator)["input_ids"].long().to(device.get_device())  # Accelerate's send_to_device
    labels, tokens = tokens_[:, 1:].contiguous(), tokens_[:, :-1].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod_token=EOD, pad_token=EOD, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, pad_mask_loss=True)
    output = model(tokens, position_ids, attention_mask, labels=labels)

    def loss_func(loss_mask, output_tensor):
        loss = torch.sum(output_tensor.float().view(-1) * loss_mask.view(-1)) / loss_mask.sum()
        return loss, {"lm loss": average_losses_across_data_parallel_group([loss])[0]}

    return output, partial(loss_func, loss_mask)


def _direct_loss(model, batches):
    """The mean over the micro-batches of each one's masked mean loss, from the model itself."""
    losses = []
    with torch.no_grad():
        for batch in batches:
            tokens_ = batch["input_ids"].to(device.get_device())
            labels, tokens = tokens_[:, 1:], tokens_[:, :-1]
            attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
                tokens, EOD, EOD, False, False, False, True)
            per_token = model[0](tokens, position_ids, attention_mask, labels=labels)
            losses.append((per_token * loss_mask).sum() / loss_mask.sum())
    return torch.stack(losses).mean().item()


@pytest.mark.parametrize("per_token", [False, True])
def test_train_step_with_accelerates_seven_arguments_returns_megatrons_tuple(megatron_run, tmp_path, per_token):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron.training.training import train_step

    args = megatron_run("--save", str(tmp_path), "--save-interval", "1000", "--load", str(tmp_path),
                        *(["--calculate-per-token-loss"] if per_token else []))
    model, optimizer, scheduler = _gpt(args)
    config = get_model_config(model[0])  # MegatronEngine.get_module_config
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    batches = _batches(2, args.micro_batch_size, args.seq_length)
    expected = _direct_loss(model, batches)
    before = [p.detach().clone() for p in model[0].parameters()]

    result = train_step(_accelerate_forward_step, iter(batches), model, optimizer, scheduler, config,
                        get_forward_backward_func())

    loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, num_zeros_in_grad = result
    assert list(loss_dict) == ["lm loss"] and loss_dict["lm loss"].dim() == 0
    assert loss_dict["lm loss"].item() == pytest.approx(expected, rel=1e-5)
    assert (skipped_iter, should_checkpoint, should_exit, exit_code, num_zeros_in_grad) == (0, False, False, 0, None)
    assert isinstance(grad_norm, float) and grad_norm > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model[0].parameters()))

    # MegatronEngine.save_checkpoint / load_checkpoint: Megatron's call forms, args from get_args().
    save_checkpoint(1, model, optimizer, scheduler, num_floating_point_operations_so_far=123.0)
    assert load_checkpoint(model, optimizer, scheduler) == (1, 123.0)
    with pytest.raises(TypeError, match="args go by keyword"):
        save_checkpoint(2, model, optimizer, scheduler, args)


def test_per_token_flag_leaves_gradients_of_two_value_losses_unscaled(megatron_run):
    """megatron-core's rule for (loss, dict) losses: they count no tokens, so --calculate-per-token-loss
    divides nothing; with one data-parallel rank the gradient is the same as without the flag."""
    from megatron.training.training import train_step

    norms = []
    for flags in ([], ["--calculate-per-token-loss"]):
        args = megatron_run(*flags)
        model, optimizer, scheduler = _gpt(args)
        batches = _batches(2, args.micro_batch_size, args.seq_length)
        norms.append(train_step(_accelerate_forward_step, iter(batches), model, optimizer, scheduler)[5])
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)


def test_training_log_prints_the_log_line_and_returns_the_memory_flag(megatron_run, capsys):
    from megatron.training.training import training_log

    megatron_run("--log-interval", "2")
    total = {}
    capsys.readouterr()
    flag = training_log({"lm loss": torch.tensor(2.0)}, total, 1e-3, 1, 1.0, True, 0, 0.5, None, None)
    assert flag is True and capsys.readouterr().out == ""  # not a logging iteration: summed only
    assert total == {"advanced iterations": 1, "skipped iterations": 0, "nan iterations": 0, "lm loss": 2.0}
    flag = training_log({"lm loss": torch.tensor(4.0)}, total, 1e-3, 2, 1.0, flag, 0, 0.25, 7.5, None)
    out = capsys.readouterr().out
    assert flag is False
    line = next(line for line in out.splitlines() if " iteration " in line)
    assert re.search(r"iteration +2/ +4 \|", line) and "lm loss: 3.000000E+00 |" in line
    assert "learning rate: 1.000000E-03 |" in line and "grad norm: 0.250 |" in line and "params norm: 7.500 |" in line
    assert "number of skipped iterations:   0 |" in line
    assert "[Rank 0] (after 2 iterations) memory (MB)" in out
    assert total == {"advanced iterations": 0, "skipped iterations": 0, "nan iterations": 0}  # a new interval
    flag = training_log({"lm loss": torch.tensor(1.0)}, total, 1e-3, 3, 1.0, flag, 1, None, None, None)
    flag = training_log({"lm loss": torch.tensor(float("nan"))}, total, 1e-3, 4, 1.0, flag, 0, None, None, None)
    line = next(line for line in capsys.readouterr().out.splitlines() if " iteration " in line)
    assert "lm loss" not in line  # neither iteration's loss counts: one skipped, one nan
    assert "number of skipped iterations:   1 |" in line and "number of nan iterations:   1 |" in line


def test_calc_params_l2_norm_against_the_parameters(megatron_run):
    from megatron.training.utils import calc_params_l2_norm

    args = megatron_run()
    model, _, _ = _gpt(args)
    params = list(model[0].parameters())
    direct = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in params))
    assert calc_params_l2_norm(model) == pytest.approx(direct, rel=1e-12)
    assert calc_params_l2_norm(model[0]) == pytest.approx(direct, rel=1e-12)
    # --bf16: Megatron reads the optimizer's fp32 main copies, unless force_create_fp32_copy.
    first = params[0]
    first.main_param = first.detach().float() * 2
    args.bf16 = True
    with_main = math.sqrt(direct ** 2 + 3 * float(first.detach().double().pow(2).sum()))
    assert calc_params_l2_norm(model) == pytest.approx(with_main, rel=1e-12)
    assert calc_params_l2_norm(model, force_create_fp32_copy=True) == pytest.approx(direct, rel=1e-12)


def test_gpt_builder_builds_pretrain_gpts_model(megatron_run, monkeypatch):
    import pretrain_gpt
    from megatron.model import GPTModel
    from megatron.training import global_vars
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.gpt_builders import gpt_builder

    args = megatron_run("--position-embedding-type", "rope", "--swiglu")
    torch.manual_seed(3)
    built = gpt_builder(args, True, True)
    torch.manual_seed(3)
    provided = pretrain_gpt.model_provider(True, True)
    assert isinstance(built, GPTModel) and built.num_tokens == 100 and built.vocab_size == args.padded_vocab_size
    assert built.state_dict().keys() == provided.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), provided.state_dict().values()))
    config = core_transformer_config_from_args(args)
    stage = gpt_builder(args, pre_process=True, post_process=False, vp_stage=0, config=config)
    assert stage.config is config and "decoder.final_layernorm.weight" not in stage.state_dict()
    # Accelerate builds no tokenizer: the real vocabulary is its args.orig_vocab_size.
    monkeypatch.setattr(global_vars, "_TOKENIZER", None)
    args.orig_vocab_size = 90
    assert gpt_builder(args, True, True).num_tokens == 90


def test_initialize_steps_accelerate_calls(megatron_run, capsys, monkeypatch):
    from megatron.core import parallel_state
    from megatron.training import global_vars, initialize

    args = megatron_run()
    capsys.readouterr()
    initialize._initialize_distributed(None, None, None)  # finish_mpu_init: the groups exist, kept
    assert "model parallel is already initialized" in capsys.readouterr().out
    assert parallel_state.model_parallel_is_initialized()
    with pytest.raises(ValueError, match="get_embedding_ranks"):
        initialize._initialize_distributed(lambda ranks: ranks, None, None)

    initialize._set_random_seed(args.seed, args.data_parallel_random_init)
    seeded = torch.rand(3)
    torch.manual_seed(args.seed)  # one rank: pipeline and data-parallel rank 0 add nothing
    assert torch.equal(seeded, torch.rand(3))
    with pytest.raises(ValueError, match="te_rng_tracker"):
        initialize._set_random_seed(args.seed, te_rng_tracker=True)

    initialize._init_autoresume()  # nothing to start without --adlr-autoresume, as in Megatron
    args.adlr_autoresume = True
    with pytest.raises(ValueError, match="autoresume"):
        initialize._init_autoresume()
    del args.adlr_autoresume

    initialize._compile_dependencies()
    assert re.search(r"> fused kernels on \w+: scale_mask_softmax \w+, layer_norm", capsys.readouterr().out)
    state = torch.get_rng_state()
    initialize.set_jit_fusion_options()  # warms up bias-GeLU and bias-dropout-add; the RNG is left as it was
    assert torch.equal(state, torch.get_rng_state())

    class Writer:
        texts = {}

        def add_text(self, tag, text, global_step):
            self.texts[tag] = (text, global_step)

        def close(self):
            pass

    monkeypatch.setattr(global_vars, "_TENSORBOARD_WRITER", Writer())
    args.iteration = 5
    initialize.write_args_to_tensorboard()
    assert Writer.texts["hidden_size"] == ("32", 5) and len(Writer.texts) == len(vars(args))


# ----------------------------------------------------------------------------- two gloo ranks

def _average_and_gather(values):
    """On each of 2 ranks (data-parallel size 2): average_losses_across_data_parallel_group, and a
    tensor-parallel gather over an explicit group (Megatron-core's group= argument)."""
    import torch.distributed as dist

    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.training.utils import average_losses_across_data_parallel_group
    from tests.parallel.harness import init_parallel

    init_parallel(tp=1)
    rank = dist.get_rank()
    losses = [torch.tensor(v * (rank + 1)) for v in values]
    averaged = average_losses_across_data_parallel_group(losses)
    gathered = gather_from_tensor_model_parallel_region(torch.full((2, 1), float(rank)), group=dist.group.WORLD)
    return averaged.tolist(), gathered.tolist()


def test_average_losses_and_explicit_group_gather_on_two_ranks():
    from tests.parallel.harness import DistributedPool

    pool = DistributedPool(2, startup_timeout_s=600)  # spawning imports torch twice: slow on a busy machine
    try:
        results = pool.run(_average_and_gather, [1.0, 4.0])
    finally:
        pool.close()
    for averaged, gathered in results:
        assert averaged == [1.5, 6.0]  # the mean of (v, 2v) over the two data-parallel ranks
        assert gathered == [[0.0, 1.0], [0.0, 1.0]]  # the last dim gathered in rank order


def test_average_losses_on_one_rank_is_the_losses_detached():
    from megatron.training.utils import average_losses_across_data_parallel_group

    loss = torch.tensor(2.5, requires_grad=True) * 2
    averaged = average_losses_across_data_parallel_group([loss, torch.tensor(1.0)])
    assert averaged.tolist() == [5.0, 1.0] and not averaged.requires_grad


def test_set_global_variables_without_a_tokenizer_forgets_an_earlier_one():
    """Accelerate's initialize() sets the args with build_tokenizer=False; a tokenizer built for
    earlier args in the same process (a notebook's previous run) must not stand in for these."""
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import get_tokenizer, set_global_variables, unset_global_variables

    args = parse_and_validate_args(argv=TINY)
    try:
        set_global_variables(args)
        assert get_tokenizer().vocab_size == 100
        set_global_variables(parse_and_validate_args(argv=TINY), build_tokenizer=False)
        with pytest.raises(RuntimeError):
            get_tokenizer()
    finally:
        unset_global_variables()
