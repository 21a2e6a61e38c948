"""megatron/training/load_hf.py given_dests: which settings a command line gives explicitly (those --load-hf
compares with the HF config instead of taking the config's), with a script's own flags, append ones too
(tools/generate_text.py --load-hf DIR --prompt A --prompt B crashed in argparse before)."""

from megatron.training.load_hf import given_dests


def _generate_text_flags(parser):
    group = parser.add_argument_group(title="text generation")
    group.add_argument("--prompt", action="append", default=None)
    group.add_argument("--tokens-to-generate", type=int, default=48)
    return parser


def test_given_dests_with_append_and_default_valued_flags():
    argv = ["--load-hf", "hf-dir", "--prompt", "a", "--prompt", "b", "--num-layers", "2", "--seq-length", "1024"]
    assert given_dests(argv, _generate_text_flags) == {"load_hf", "prompt", "num_layers", "seq_length"}
    # a flag given at its default value is given all the same; an append flag left out is not
    assert given_dests(["--tokens-to-generate", "48"], _generate_text_flags) == {"tokens_to_generate"}
