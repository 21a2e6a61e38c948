"""tasks/main.py --task WIKITEXT103 / LAMBADA (tasks/zeroshot_gpt) against HF transformers.

A tiny random GPT-2 on the real GPT-2 vocabulary is saved with save_pretrained and converted
with tools/checkpoint/convert.py --loader hf --saver megatron; tasks/main.py evaluates the
converted checkpoint and the test computes the same numbers with the HF model directly:

* WikiText: a WikiText-style file written from the shared corpus. The expected windows are built
  here from the definition (window 0 scores its SEQ targets, each next window starts STRIDE
  tokens later and scores the STRIDE targets after the previous one, no padding), each run
  through HF; loss = their summed cross entropy / (T - 1); the token ratio (T - 1) / (W - 1) with
  W the file's words split on single spaces, the adjusted ppl exp(min(20, loss * ratio)).
* LAMBADA: passages from the corpus plus planted ones whose last word the model predicts
  greedily (so the accuracy is not 0), and one whose last token it predicts but not the word's
  first token (so strict and non-strict accuracies differ); targets built from the definition
  with HF's tokenizer, correct = HF's argmax equal at every target token.
* TP = 2, PP = 2 and DP = 2 (a pool of 2 gloo processes) give the serial numbers.
* Bad input ends in one line: unknown task, a malformed JSON line (FILE:LINE), a missing file.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasks import main as tasks_main
from tasks.errors import TaskError
from tasks.zeroshot_gpt.datasets import LambadaDataset
from tasks.zeroshot_gpt.detokenizer import wikitext_detokenizer
from tasks.zeroshot_gpt.make_fixtures import write_lambada, write_wikitext
from tests.parallel.harness import DistributedPool

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SEQ, HIDDEN, LAYERS, HEADS = 64, 32, 2, 4
RESULT = re.compile(r"^ validation results on (\w+) \| (.*)$", re.M)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, gpt2_vocab_dir, corpus_path):
    from tools.checkpoint import convert

    root = tmp_path_factory.mktemp("zeroshot")
    config = transformers.GPT2Config(vocab_size=50257, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                     activation_function="gelu_new", bos_token_id=50256, eos_token_id=50256)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # biases and norms away from 0 and 1, so that a mix-up shows
        for name, param in hf.named_parameters():
            if name.endswith(".bias") or ".ln_" in name:
                param.add_(0.1 * torch.randn_like(param))
    hf.save_pretrained(root / "hf")
    convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir", str(root / "hf"),
                  "--save-dir", str(root / "ckpt"), "--no-verify"])
    hf.eval()
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(str(gpt2_vocab_dir))
    write_wikitext(str(corpus_path), str(root / "wiki.valid.tokens"), documents=2, max_chars=1200)
    write_lambada(str(corpus_path), str(root / "passages.jsonl"), documents=2, words=30, per_document=6)
    texts = [json.loads(line)["text"] for line in (root / "passages.jsonl").read_text().splitlines()]
    texts += _planted(hf, tokenizer, texts)
    (root / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    flags = ["--load", str(root / "ckpt"), "--no-load-optim", "--no-load-rng", "--num-layers", str(LAYERS),
             "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
             "--max-position-embeddings", str(SEQ), "--openai-gelu", "--tokenizer-type", "GPT2BPETokenizer",
             "--vocab-file", str(gpt2_vocab_dir / "vocab.json"), "--merge-file", str(gpt2_vocab_dir / "merges.txt"),
             "--micro-batch-size", "4", "--log-interval", "100"]
    return dict(root=root, hf=hf, tokenizer=tokenizer, flags=flags, texts=texts)


# ------------------------------------------------------------------ expected numbers, from HF

def _ids(tokenizer, text):
    return tokenizer(text)["input_ids"]


def _greedy(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].argmax(-1).tolist()  # the argmax after each position


def _planted(hf, tokenizer, texts):
    """Passages the model gets right: a context + its greedy next word (right in both modes), and
    a context + its greedy next token glued to the last word (right only without --strict-lambada:
    the word's earlier tokens are not the model's predictions)."""
    both, last_token_only = [], []
    for text in texts:
        for context in (text.rsplit(" ", 1)[0], text):
            ids = _ids(tokenizer, context)
            greedy = _greedy(hf, ids)[-1]
            piece = tokenizer.decode([greedy])
            if _ids(tokenizer, context + piece) != ids + [greedy]:
                continue  # the text would not tokenize back to the prediction
            if re.fullmatch(r" [A-Za-z]+", piece) and len(both) < 3:
                both.append(context + piece)
            elif re.fullmatch(r"[A-Za-z]+", piece) and context[-1].isalpha() and len(last_token_only) < 2:
                last_token_only.append(context + piece)
    assert both and last_token_only, "no passage to plant: change the fixture"
    return both + last_token_only


def _lambada_target(tokenizer, text, strict):
    if not strict:
        ids = _ids(tokenizer, text)
        return ids[:-1], ids[-1:]
    word = text.split()[-1]
    return _ids(tokenizer, text[:text.rfind(word)].strip()), _ids(tokenizer, " " + word)


def _hf_lambada_correct(hf, tokenizer, texts, strict):
    correct = 0
    for text in texts:
        context, target = _lambada_target(tokenizer, text, strict)
        predicted = _greedy(hf, context + target[:-1])[len(context) - 1:]
        correct += predicted == target
    return correct


def _hf_wikitext(hf, tokens, seq, stride):
    """Summed loss over the T - 1 targets, each scored once, in windows as defined."""
    total, scored, start = 0.0, 0, 0
    while scored < len(tokens) - 1:
        end = min(start + seq, len(tokens) - 1)  # the window's last target
        window = torch.tensor([tokens[start:end + 1]])
        with torch.no_grad():
            losses = torch.nn.functional.cross_entropy(hf(window[:, :-1]).logits[0].double(), window[0, 1:],
                                                       reduction="none")
        new = end - scored  # targets scored + 1 .. end are this window's
        total += losses[-new:].sum().item()
        scored, start = end, start + stride
    return total


def _run(argv, capsys):
    result = tasks_main.main(argv)
    return result, capsys.readouterr().out


# --------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("stride_flags, stride", [([], 32), (["--overlapping-eval", str(SEQ)], SEQ)],
                         ids=["overlapping-default-32", "non-overlapping"])
def test_wikitext_loss_ppl_token_ratio_equal_hf(setup, capsys, stride_flags, stride):
    path = setup["root"] / "wiki.valid.tokens"
    text = path.read_bytes().decode("utf-8")
    tokens = _ids(setup["tokenizer"], wikitext_detokenizer(text))
    words = len(text.strip().split(" "))
    result, out = _run(["--task", "WIKITEXT103", "--valid-data", str(path), *setup["flags"], *stride_flags], capsys)
    assert len(tokens) > 4 * SEQ  # several windows
    assert (result["num_tokenized_tokens"], result["num_original_tokens"]) == (len(tokens), words)
    expected = _hf_wikitext(setup["hf"], tokens, SEQ, stride) / (len(tokens) - 1)
    assert result["loss"] == pytest.approx(expected, rel=1e-5, abs=0)
    assert result["token_ratio"] == (len(tokens) - 1) / (words - 1)
    assert result["ppl"] == math.exp(min(20, result["loss"]))
    assert result["adjusted_ppl"] == math.exp(min(20, result["loss"] * result["token_ratio"]))
    assert f" > number of original tokens: {words}, number of detokenized tokens: {len(tokens)}" in out
    line = (f" validation results on WIKITEXT103 | avg loss: {result['loss']:.4E} | ppl: {result['ppl']:.4E} | "
            f"adjusted ppl: {result['adjusted_ppl']:.4E} | token ratio: {result['token_ratio']} |")
    assert f"{'-' * (len(line) + 1)}\n{line}\n{'-' * (len(line) + 1)}\n" in out


def test_wikitext_windows_differ_with_the_stride(setup, capsys):
    """Stride 16: each target gets more context than with the default 32, another number, still HF's."""
    path = str(setup["root"] / "wiki.valid.tokens")
    tokens = _ids(setup["tokenizer"], wikitext_detokenizer(Path(path).read_text()))
    expected = _hf_wikitext(setup["hf"], tokens, SEQ, 16) / (len(tokens) - 1)
    assert expected != pytest.approx(_hf_wikitext(setup["hf"], tokens, SEQ, SEQ) / (len(tokens) - 1))
    result, _ = _run(["--task", "WIKITEXT103", "--valid-data", path, *setup["flags"], "--overlapping-eval", "16"],
                     capsys)
    assert result["loss"] == pytest.approx(expected, rel=1e-5)


def test_lambada_targets_strict_and_not(setup):
    from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer

    vocab = Path(setup["flags"][setup["flags"].index("--vocab-file") + 1])
    ours = GPT2BPETokenizer(str(vocab), str(vocab.parent / "merges.txt"))  # the task's tokenizer
    path = str(setup["root"] / "lambada.jsonl")
    strict = LambadaDataset(path, ours.eod, ours, SEQ, strict=True)
    loose = LambadaDataset(path, ours.eod, ours, SEQ, strict=False)
    multi = 0
    for index, text in enumerate(setup["texts"]):
        for dataset, is_strict in ((strict, True), (loose, False)):
            context, target = _lambada_target(setup["tokenizer"], text, is_strict)
            assert (dataset.tokens[index], dataset.labels[index]) == (context, target)
            sample = dataset[index]
            assert sample["text"].tolist() == (context + target + [ours.eod] * SEQ)[:SEQ + 1]
            assert sample["pad_mask"].tolist() == ([0] * (len(context) - 1) + [1] * len(target) + [0] * SEQ)[:SEQ]
        multi += len(strict.labels[index]) > 1
    assert multi >= 2  # last words of several tokens: the two targets differ
    hf, tokenizer, texts = setup["hf"], setup["tokenizer"], setup["texts"]
    assert 0 < _hf_lambada_correct(hf, tokenizer, texts, True) < _hf_lambada_correct(hf, tokenizer, texts, False)


@pytest.mark.parametrize("strict", [False, True], ids=["last-token", "strict-last-word"])
def test_lambada_accuracy_equals_hf(setup, capsys, strict):
    path = str(setup["root"] / "lambada.jsonl")
    result, out = _run(["--task", "LAMBADA", "--valid-data", path, *setup["flags"],
                        *(["--strict-lambada"] if strict else [])], capsys)
    expected = _hf_lambada_correct(setup["hf"], setup["tokenizer"], setup["texts"], strict)
    total = len(setup["texts"])
    assert (result["correct"], result["total"]) == (expected, total)
    assert expected > 0  # the planted passages
    line = (f" validation results on LAMBADA | number correct: {float(expected):.4E} | total examples: "
            f"{float(total):.4E} | avg accuracy: {expected / total:.4E}")
    assert line in out.splitlines()


def _task_on_rank(argv):
    return tasks_main.main(argv)


def test_tensor_pipeline_and_data_parallel_give_the_serial_numbers(setup, capsys):
    wiki = ["--task", "WIKITEXT103", "--valid-data", str(setup["root"] / "wiki.valid.tokens"), *setup["flags"]]
    lambada = ["--task", "LAMBADA", "--strict-lambada", "--valid-data", str(setup["root"] / "lambada.jsonl"),
               *setup["flags"]]
    from tools.checkpoint import convert

    serial = {"wiki": _run(wiki, capsys)[0], "lambada": _run(lambada, capsys)[0]}
    pool = DistributedPool(2)
    try:
        for kind in ("tensor", "pipeline", "data"):
            layout = []  # two ranks: data-parallel size 2, each replica half the samples
            if kind != "data":
                checkpoint = setup["root"] / f"ckpt-{kind}2"  # a legacy checkpoint loads at the TP/PP it was saved at
                convert.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--no-verify",
                              "--load-dir", str(setup["root"] / "hf"), "--save-dir", str(checkpoint),
                              f"--target-{kind}-parallel-size", "2"])
                layout = [f"--{kind}-model-parallel-size", "2", "--load", str(checkpoint)]
            for name, argv in (("wiki", wiki), ("lambada", lambada)):
                per_rank = pool.run(_task_on_rank, [*argv, *layout])
                assert per_rank[0] == per_rank[1]  # every rank returns the result
                got, want = per_rank[0], serial[name]
                assert got.keys() == want.keys()
                for key in want:
                    assert got[key] == (want[key] if isinstance(want[key], (str, int)) else
                                        pytest.approx(want[key], rel=1e-6)), (layout, name, key)
    finally:
        pool.close()


def _cli(argv):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "tasks/main.py", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_bad_input_is_one_line(setup, tmp_path, capsys):
    unknown = _cli(["--task", "NOPE", *setup["flags"]])
    assert (unknown.returncode, unknown.stderr) == (
        1, "tasks/main.py: error: --task NOPE: unknown task (choices: WIKITEXT103, LAMBADA, MNLI, QQP, RACE)\n")
    bad = tmp_path / "lambada.jsonl"
    bad.write_text('{"text": "a fine passage"}\n{"text": "broken\n')
    malformed = _cli(["--task", "LAMBADA", "--valid-data", str(bad), *setup["flags"]])
    assert malformed.returncode == 1
    assert malformed.stderr.startswith(f"tasks/main.py: error: {bad}:2: not valid JSON")
    assert len(malformed.stderr.splitlines()) == 1
    with pytest.raises(TaskError, match=re.escape(f"--valid-data {tmp_path / 'missing.tokens'}: No such file")):
        tasks_main.main(["--task", "WIKITEXT103", "--valid-data", str(tmp_path / "missing.tokens"), *setup["flags"]])
    with pytest.raises(TaskError, match="--task LAMBADA needs --valid-data with exactly one file"):
        tasks_main.main(["--task", "LAMBADA", *setup["flags"]])
    from megatron.training.checkpointing import CheckpointError

    flags = list(setup["flags"])
    flags[flags.index("--load") + 1] = str(tmp_path / "no-checkpoint")
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        tasks_main.main(["--task", "LAMBADA", "--valid-data", str(setup["root"] / "lambada.jsonl"), *flags])


def test_pretrained_checkpoint_is_loaded_when_load_holds_none(setup, tmp_path, capsys):
    """--pretrained-checkpoint (Megatron's): with nothing under --load yet, the model comes from it."""
    path = str(setup["root"] / "lambada.jsonl")
    expected, _ = _run(["--task", "LAMBADA", "--valid-data", path, *setup["flags"]], capsys)
    flags = list(setup["flags"])
    flags[flags.index("--load") + 1] = str(tmp_path / "fresh")
    result, out = _run(["--task", "LAMBADA", "--valid-data", path, *flags, "--pretrained-checkpoint",
                        str(setup["root"] / "ckpt")], capsys)
    assert result == expected
    assert f"no checkpoint under --load {tmp_path / 'fresh'}: finetuning from --pretrained-checkpoint" in out


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("script, task", [("evaluate_wikitext.sh", "WIKITEXT103"), ("evaluate_lambada.sh", "LAMBADA")])
def test_example_script_builds_its_file_and_evaluates(setup, corpus_path, tmp_path, script, task):
    """examples/evaluate_*.sh on a tiny checkpoint: the eval file written from a corpus, Megatron's lines."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(corpus_path.read_text().splitlines(keepends=True)[:2]))
    flags = setup["flags"]
    vocab = flags[flags.index("--vocab-file") + 1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, CORPUS=str(corpus),
               EVAL_DIR=str(tmp_path / "eval"), SEQ_LENGTH=str(SEQ), MASTER_PORT=str(_free_port()))
    proc = subprocess.run(["bash", str(ROOT / "examples" / script), str(setup["root"] / "ckpt"), vocab,
                           str(Path(vocab).parent / "merges.txt")], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == [
        "wiki.valid.tokens" if task == "WIKITEXT103" else "lambada.jsonl"]
    found = RESULT.findall(proc.stdout)
    assert [name for name, _ in found] == [task]
    fields = "avg loss: .* \\| ppl: .* \\| adjusted ppl: .* \\| token ratio: .* \\|" if task == "WIKITEXT103" else \
        "number correct: .* \\| total examples: .* \\| avg accuracy: .*"
    assert re.fullmatch(fields, found[0][1])


def test_load_hf_evaluates_the_transformers_directory(setup, capsys):
    """--load-hf HF_DIR instead of a converted checkpoint: the same numbers (the shape from config.json)."""
    path = str(setup["root"] / "wiki.valid.tokens")
    flags = setup["flags"]
    expected, _ = _run(["--task", "WIKITEXT103", "--valid-data", path, *flags], capsys)
    tokenizer = flags[flags.index("--tokenizer-type"):flags.index("--merge-file") + 2]
    result, _ = _run(["--task=WIKITEXT103", "--valid-data", path, "--load-hf", str(setup["root"] / "hf"), *tokenizer,
                      "--seq-length", str(SEQ), "--micro-batch-size", "4"], capsys)
    assert result.pop("task") == expected.pop("task")
    assert result == pytest.approx(expected, rel=1e-6)
