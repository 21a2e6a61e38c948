"""--load-hf compares the run's model with the HF config's as two ModelArchitecture descriptions
(megatron/training/load_hf.py): an architecture flag the command line gives otherwise is named with both
values; one that shapes nothing in this model (a rope scaling factor without --use-rope-scaling) is not."""

import dataclasses

import pytest

from megatron.convert.hf_files import ARCHITECTURE_FLAGS
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import CheckpointError
from megatron.training.config.architecture import ModelArchitecture
from megatron.training.load_hf import apply_hf_args
from tests.helpers.hf_models import llama_family, make_hf

RUN = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny Llamas (2 layers, h 64, 4 heads): with 2 key/value groups, and with one per head."""
    out = {}
    for name, groups in (("gqa", 2), ("mha", 4)):
        out[name] = tmp_path_factory.mktemp(name)
        make_hf(llama_family("llama", num_key_value_heads=groups)).save_pretrained(out[name])
    return out


def _refusal(folder, *flags) -> str:
    argv = ["--load-hf", str(folder), *RUN, *flags]
    with pytest.raises(CheckpointError) as refused:
        apply_hf_args(parse_args(argv=argv), argv)
    return str(refused.value)


@pytest.mark.parametrize("name, flags, named", [
    ("gqa", ["--num-layers", "3"], "the HF config gives --num-layers 2 but the command line has --num-layers 3"),
    ("gqa", ["--num-query-groups", "4"],
     "the HF config gives --num-query-groups 2 but the command line has --num-query-groups 4"),
    ("gqa", ["--norm-epsilon", "1e-6"],
     "the HF config gives --norm-epsilon 1e-05 but the command line has --norm-epsilon 1e-06"),
    ("gqa", ["--norm-epsilon", "1e-6", "--num-layers", "3"],  # every one, in the HF config's order
     "the HF config gives --num-layers 2 but the command line has --num-layers 3; "
     "the HF config gives --norm-epsilon 1e-05 but the command line has --norm-epsilon 1e-06"),
    ("mha", ["--group-query-attention", "--num-query-groups", "2"],
     "the HF config gives no --group-query-attention but the command line has --group-query-attention "
     "--num-query-groups 2"),
], ids=["num-layers", "num-query-groups", "norm-epsilon", "two-flags", "gqa-against-none"])
def test_a_flag_that_describes_another_model_is_named(folders, name, flags, named):
    assert _refusal(folders[name], *flags) == \
        f"--load-hf {folders[name]}: {named} (leave the flag out to take the HF config's)"


def test_flags_that_agree_or_shape_nothing_pass(folders):
    argv = ["--load-hf", str(folders["gqa"]), *RUN, "--swiglu", "--num-layers", "2", "--rope-scaling-factor", "4"]
    args = parse_args(argv=argv)
    apply_hf_args(args, argv)
    assert (args.num_layers, args.num_query_groups, args.rope_scaling_factor, args.use_rope_scaling) == \
        (2, 2, 4.0, False)
    # one key/value group per head, said either way, is the same model
    argv = ["--load-hf", str(folders["mha"]), *RUN, "--group-query-attention", "--num-query-groups", "4"]
    apply_hf_args(parse_args(argv=argv), argv)


def test_every_architecture_flag_is_a_field_of_the_description():
    fields = {field.name for field in dataclasses.fields(ModelArchitecture)}
    assert set(ARCHITECTURE_FLAGS) - fields == {"group_query_attention"}  # (folded into num_query_groups)
