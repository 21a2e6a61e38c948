"""tasks/main.py's flags and dispatch, and tasks/zeroshot_gpt's windows and detokenizer (no model)."""

import argparse

import numpy as np
import pytest

from tasks import main as tasks_main
from tasks.errors import TaskError
from tasks.zeroshot_gpt.datasets import LMDataset, count_original_tokens
from tasks.zeroshot_gpt.detokenizer import get_detokenizer, lambada_detokenizer, ptb_detokenizer, wikitext_detokenizer


def test_task_flags_have_megatrons_names_and_defaults():
    parser = tasks_main.get_tasks_args(argparse.ArgumentParser())
    args = parser.parse_args(["--task", "LAMBADA"])
    assert (args.epochs, args.keep_last, args.train_data, args.valid_data, args.overlapping_eval,
            args.strict_lambada, args.eval_micro_batch_size) == (None, False, None, None, 32, False, None)
    args = parser.parse_args(["--task", "MNLI", "--train-data", "a", "b", "--valid-data", "c", "d", "--epochs", "3"])
    assert (args.train_data, args.valid_data, args.epochs) == (["a", "b"], ["c", "d"], 3)
    assert parser.parse_args(["--task", "X", "--valid-data"]).valid_data == []  # nargs="*", as Megatron's


def test_unknown_and_retrieval_tasks_are_refused_naming_the_choices():
    with pytest.raises(TaskError, match=r"^--task NOPE: unknown task \(choices: WIKITEXT103, LAMBADA, MNLI, QQP, RACE\)$"):
        tasks_main.task_module("NOPE")
    with pytest.raises(TaskError, match="--task RETRIEVER-EVAL: Megatron's retrieval tasks are not supported yet"):
        tasks_main.task_module("RETRIEVER-EVAL")
    assert tasks_main.task_module("LAMBADA").main is tasks_main.task_module("WIKITEXT103").main


def _targets(dataset):
    """Which token positions (1 .. T - 1) each window scores."""
    scored = []
    for index in range(len(dataset)):
        start = index * dataset.stride
        mask = dataset[index]["pad_mask"]
        scored += [start + 1 + i for i in np.flatnonzero(mask)]
    return scored


@pytest.mark.parametrize("num_tokens, seq, stride", [(10, 4, None), (11, 4, 4), (23, 8, 3), (9, 8, 1), (3, 8, 32),
                                                     (40, 8, 8), (41, 8, 5)])
def test_windows_score_every_target_once(num_tokens, seq, stride):
    dataset = LMDataset(list(range(100, 100 + num_tokens)), seq, 0, num_tokens, num_tokens, stride)
    assert _targets(dataset) == list(range(1, num_tokens))
    o = seq if stride is None else stride
    assert len(dataset) == max(-(-max(num_tokens - 1 - o, 0) // o) + 1, 1)  # Megatron's count
    first = dataset[0]
    assert first["text"].shape == (seq + 1,) and first["pad_mask"].shape == (seq,)


def test_overlapping_windows_keep_the_context_and_pad_with_eod():
    dataset = LMDataset(list(range(1, 13)), 8, 50256, 12, 12, 4)  # 12 tokens, windows at 0 and 4
    assert len(dataset) == 3
    assert dataset[1]["text"].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 50256]
    assert dataset[1]["pad_mask"].tolist() == [0, 0, 0, 0, 1, 1, 1, 0]  # targets 10, 11, 12 (9 was window 0's)
    assert dataset[2]["pad_mask"].tolist() == [0] * 8  # Megatron's count has a window with nothing left


def test_wikitext_detokenizer_undoes_the_word_level_spacing():
    text = (" = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese : 戦場 ) , "
            "is a tactical role @-@ playing game , released in 2 @,@ 011 at 1 @.@ 5 times . The game 's \" best \" "
            "part ; it is . \n")
    assert wikitext_detokenizer(text) == (
        " = Valkyria Chronicles III =\n\nSenjō no Valkyria 3: Unrecorded Chronicles (Japanese: 戦場), is a tactical "
        "role-playing game, released in 2,011 at 1.5 times. The game's \"best\" part; it is.\n")
    assert wikitext_detokenizer(" = = Heading = = \n") == " == Heading ==\n"
    assert ptb_detokenizer("it is n't \n the N dogs") == "it isn't\nthe1 dogs"


def test_detokenizer_chosen_by_path_as_megatron():
    assert get_detokenizer("data/wikitext-103/wiki.test.tokens") is wikitext_detokenizer
    assert get_detokenizer("ptb.test.txt") is ptb_detokenizer
    assert get_detokenizer("lambada_test.jsonl") is lambada_detokenizer
    assert get_detokenizer("/wiki/lambada.jsonl") is wikitext_detokenizer  # the first key the path holds
    assert get_detokenizer("corpus.txt") is None


def test_original_tokens_are_the_text_split_on_single_spaces():
    assert count_original_tokens(" a  b \n c ") == 5  # "a", "", "b", "\n", "c", as Megatron counts
