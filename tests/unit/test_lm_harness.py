"""megatron/evaluation's pure rules: lm-eval's rolling windows, stop strings, task lines, acc / acc_norm, the table."""

import importlib.util

import pytest

from megatron.evaluation.lm_harness import make_disjoint_window, rolling_token_windows, stop_sequences
from megatron.evaluation.lm_tasks import TaskFileError, mc_scores, parse_line, results_table


def test_rolling_windows_by_hand():
    windows = rolling_token_windows(list(range(10)), -1, max_seq_len=4)
    assert windows == [([-1, 0, 1, 2], [0, 1, 2, 3]), ([3, 4, 5, 6], [4, 5, 6, 7]), ([5, 6, 7, 8], [8, 9])]
    assert [make_disjoint_window(w) for w in windows] == [([-1], [0, 1, 2, 3]), ([3], [4, 5, 6, 7]),
                                                         ([5, 6, 7], [8, 9])]
    assert rolling_token_windows([], -1, 4) == []
    assert rolling_token_windows([7, 8], -1, 4) == [([-1, 7], [7, 8])]


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm_eval is not installed")
@pytest.mark.parametrize("length,max_seq_len,context_len", [(1, 4, 1), (10, 4, 1), (33, 8, 1), (20, 5, 3), (8, 8, 8)])
def test_rolling_windows_equal_lm_evals(length, max_seq_len, context_len):
    from lm_eval.utils import get_rolling_token_windows

    tokens = list(range(100, 100 + length))
    assert rolling_token_windows(tokens, 0, max_seq_len, context_len) == list(
        get_rolling_token_windows(tokens, 0, max_seq_len, context_len))


def test_stop_sequences_add_eos_once():
    assert stop_sequences(None, "<eos>") == ["<eos>"]
    assert stop_sequences("\n", "<eos>") == ["\n", "<eos>"]
    assert stop_sequences(["a", "<eos>"], "<eos>") == ["a", "<eos>"]


@pytest.mark.parametrize("text,message", [
    ('{"type": "loglikelihood", "context": "a"', "f.jsonl:7: not JSON: "),
    ("[1, 2]", "f.jsonl:7: a line must be a JSON object, got list"),
    ('{"type": "rank"}', 'f.jsonl:7: "type" must be one of loglikelihood, loglikelihood_rolling, generate_until'),
    ('{"type": "loglikelihood", "context": "a", "continuation": ""}', 'f.jsonl:7: "continuation" must not be empty'),
    ('{"type": "generate_until", "context": "a", "until": 3}', 'f.jsonl:7: "until" must be a string or a list'),
    ('{"context": "q", "choices": ["a", "b"], "gold": 2}', 'f.jsonl:7: "gold" must be the index of a choice'),
    ('{"context": "q"}', 'f.jsonl:7: a line needs "type"'),
])
def test_bad_lines_name_file_and_line(text, message):
    with pytest.raises(TaskFileError) as error:
        parse_line("f.jsonl", 7, text)
    assert str(error.value).startswith(message)


def test_question_stands_for_context():
    assert parse_line("f", 1, '{"question": "q", "choices": ["a", "b"], "gold": 0}').doc["context"] == "q"


def test_acc_norm_divides_by_the_choice_length_in_characters():
    # acc: the largest ll (-3, "a"); acc_norm: the largest ll per character (-4 / 8 = -0.5, "a long b")
    scores = mc_scores(["a", "a long b", "cc"], 1, [-3.0, -4.0, -6.0])
    assert (scores["pred"], scores["pred_norm"], scores["acc"], scores["acc_norm"]) == (0, 1, 0.0, 1.0)
    assert mc_scores(["x", "y"], 0, [-1.0, -1.0])["pred"] == 0  # ties: the first, as np.argmax


def test_results_table_has_the_harness_columns():
    table = results_table({"arc": {"acc": 0.5, "acc_stderr": 0.25, "acc_norm": 0.75, "acc_norm_stderr": None}})
    lines = table.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["Tasks", "Version", "Filter", "n-shot", "Metric", "",
                                                             "Value", "", "Stderr"]
    assert [c.strip() for c in lines[2].split("|")[1:-1]] == ["arc", "N/A", "none", "0", "acc", "↑", "0.5000", "±",
                                                             "0.2500"]
    assert [c.strip() for c in lines[3].split("|")[1:-1]] == ["", "", "", "", "acc_norm", "↑", "0.7500", "±", "N/A"]


def test_a_continuation_with_no_token_of_its_own_names_its_line():
    from megatron.evaluation.lm_tasks import Task, run_task

    class MergingLM:  # "the m" + "at" encodes as "the" " mat": the whole is as long as the context
        def encode_pair(self, context, continuation):
            return [1, 2], []

    task = Task("t", [parse_line("t.jsonl", 4, '{"type": "loglikelihood", "context": "the m", "continuation": "at"}')])
    with pytest.raises(TaskFileError, match=r"^t.jsonl:4: the continuation 'at' leaves no token"):
        run_task(MergingLM(), task)
