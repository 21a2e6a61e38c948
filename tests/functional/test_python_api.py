"""The Python API (megatron.training.api.pretrain): a config built in Python trains to the losses of
the command line with the same flags, twice in one process.

    serial      GPT on mock data; BERT and T5 on a sentence-split slice of the real corpus
    TP2 x PP2   GPT, a Llama (RMSNorm, SwiGLU, rope, GQA, untied) and an MoE (4 experts, top-2) on
                4 gloo ranks: the CLI once, then pretrain(config) twice, in the same processes
"""

import json

import pytest

from megatron.training.api import pretrain
from megatron.training.arguments import parse_args
from megatron.training.config import MegatronConfig
from megatron.training.initialize import reset_megatron

ITERS = 3
GPT = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
       "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
       "--train-iters", str(ITERS), "--lr", "3e-3", "--num-workers", "0", "--eval-iters", "0", "--seed", "1234",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--log-interval", "1",
       "--cpu-threads", "1"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--moe-aux-loss-coeff", "1e-2",
       "--disable-bias-linear", "--swiglu"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]


def _losses(result):
    return [(r.iteration, r.losses) for r in result.history]


def _same(api, cli):
    assert [i for i, _ in api] == [i for i, _ in cli] == list(range(1, ITERS + 1))
    for (_, got), (_, want) in zip(api, cli):
        assert sorted(got) == sorted(want)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-6), key


def _cli_and_api_twice(argv, recipe):
    """(CLI losses, [API losses, API losses]) in this process; the config is built in Python from
    the groups, not by parsing argv (parsing only names the values to set)."""
    from megatron.training.recipes import bert, gpt, t5

    main = {"gpt": gpt.main, "bert": bert.main, "t5": t5.main}[recipe]
    try:
        cli = _losses(main(list(argv), record_history=True))
        parsed = vars(parse_args(t5.add_t5_args if recipe == "t5" else None, argv=list(argv)))
        default = vars(parse_args(t5.add_t5_args if recipe == "t5" else None, argv=[]))
        runs = []
        for _ in range(2):
            config = MegatronConfig()
            in_groups = set()
            for name in MegatronConfig.groups():
                group = getattr(config, name)
                for key in vars(group):
                    in_groups.add(key)
                    if parsed[key] != default[key]:
                        setattr(group, key, parsed[key])
            # T5's own settings (--decoder-seq-length, ...) are still rows of Megatron's flag table
            config.extra.update({k: v for k, v in parsed.items() if k not in in_groups and v != default[k]})
            runs.append(_losses(pretrain(config, recipe=recipe, record_history=True)))
    finally:
        reset_megatron()
    return cli, runs


def test_gpt_from_a_python_config_twice_equals_the_command_line():
    cli, runs = _cli_and_api_twice(GPT, "gpt")
    for api in runs:
        _same(api, cli)
    assert runs[0] == runs[1]


@pytest.fixture(scope="module")
def sentence_data(tmp_path_factory, corpus_path, bert_vocab_file, nltk_data_dir):
    """40 documents of the corpus, sentence-split with the BERT vocabulary (BERT's and T5's data)."""
    from tools import preprocess_data

    root = tmp_path_factory.mktemp("api_sentences")
    subset = root / "subset.jsonl"
    with open(corpus_path, encoding="utf-8") as src, open(subset, "w", encoding="utf-8") as dst:
        for _, line in zip(range(40), src):
            dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    preprocess_data.main(["--input", str(subset), "--output-prefix", str(root / "corpus"), "--split-sentences",
                          "--workers", "1", "--tokenizer-type", "BertWordPieceLowerCase",
                          "--vocab-file", str(bert_vocab_file)])
    return ["--data-path", str(root / "corpus_text_sentence"), "--vocab-file", str(bert_vocab_file),
            "--split", "90,5,5", "--data-cache-path", str(root / "cache")]


ENCODER = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "4",
           "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "3e-3", "--num-workers", "0",
           "--eval-iters", "0", "--seed", "1234", "--log-interval", "1", "--cpu-threads", "1"]


@pytest.mark.parametrize("recipe, shape", [
    ("bert", ["--seq-length", "64", "--max-position-embeddings", "64"]),
    ("t5", ["--encoder-seq-length", "64", "--decoder-seq-length", "16", "--max-position-embeddings", "64",
            "--vocab-extra-ids", "100", "--kv-channels", "8", "--ffn-hidden-size", "64"]),
])
def test_bert_and_t5_from_a_python_config_twice_equal_the_command_line(sentence_data, recipe, shape):
    cli, runs = _cli_and_api_twice([*ENCODER, *shape, *sentence_data], recipe)
    for api in runs:
        _same(api, cli)


@pytest.fixture(scope="module")
def pool4():
    from tests.parallel.harness import DistributedPool

    pool = DistributedPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize("name, extra", [("gpt", []), ("llama", LLAMA), ("moe", MOE)])
def test_tp2_pp2_from_a_python_config_twice_equals_the_command_line(pool4, name, extra):
    per_rank = pool4.run(_cli_and_api_twice, [*GPT, *TP2_PP2, *extra], "gpt")
    cli, runs = per_rank[-1]  # the last pipeline stage holds the losses
    assert cli, "the last rank recorded no iteration"
    for api in runs:
        _same(api, cli)
    if name == "moe":
        assert "load_balancing_loss" in cli[0][1]


def test_a_config_value_no_flag_can_give_is_refused_in_one_line():
    from megatron.training.arguments import ArgsError

    config = MegatronConfig()
    config.training.micro_batch_size = 2
    config.learning_rate.lr_decay_style = None  # its flag has a default and choices: None cannot be given
    with pytest.raises(ArgsError, match=r"^--lr-decay-style: None cannot be given on the command line"):
        pretrain(config)
