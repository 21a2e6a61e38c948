"""tools/lm_eval_harness.py on a tiny random GPT-2 (--load-hf): every answer equals a direct HF
transformers computation on the same weights, with lm-evaluation-harness 0.4's rules re-derived
here (the context/continuation token boundary, left truncation, rolling windows, greedy until),
serially, at TP=2, and at PP=2 from our checkpoint of it (convert.py) with our GPT2BPETokenizer;
acc / acc_norm of a multiple-choice fixture; a bad line is one FILE:LINE; lm_eval's own command line
over megatron_compat when lm_eval is installed (the batch size given in model_args and as --batch_size;
two different ones are one line)."""

import contextlib
import io
import json
import math
import os
import socket
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "lm_eval_harness.py")
MAX_LENGTH = 16  # the model's n_positions: long requests truncate, long texts take several windows
EOT = 50256

LOGLIKELIHOOD = [
    ("The cat sat on the", " mat"),          # a continuation starting with a space
    ("The cat sat on the ", "mat"),          # the context's trailing space moves to the continuation
    ("She said hel", "lo there"),            # the context ends mid-word: " hello" is one token of the whole
    ("", "Hello world"),                     # an empty context: scored after the prefix token
    ("A quick", " brown fox jumps over"),
    ("one two three four five six seven eight nine ten eleven twelve thirteen", " fourteen fifteen"),  # truncated
]
ROLLING = ["In the beginning God created the heaven and the earth. And the earth was without form, and void; "
           "and darkness was upon the face of the deep. And God said, Let there be light.", "Short text.", "a b c d e f g h i j k l m n o p"]
GENERATE_CONTEXTS = ["Hello world", "The meaning of life is", "one two three four five six seven eight nine ten"]
MULTIPLE_CHOICE = [
    {"question": "Question: what is two plus two?\nAnswer:", "choices": ["four", "five", "twenty two"], "gold": 0},
    {"context": "The sky is", "choices": ["blue", "green with stripes", "red"], "gold": 1},
    {"context": "Paris is the capital of", "choices": ["France", "Spain"], "gold": 0},
    {"context": "Water freezes at", "choices": ["zero degrees", "a hundred degrees", "minus ten"], "gold": 2},
]


@pytest.fixture(scope="module")
def hf(tmp_path_factory, gpt2_vocab_dir):
    from tests.helpers.hf_models import gpt2_folder

    return gpt2_folder(tmp_path_factory.mktemp("lm_eval") / "hf", gpt2_vocab_dir, MAX_LENGTH)


def _hf_greedy(hf, context, max_gen_toks):
    model, tokenizer, _ = hf
    ids = tokenizer.encode(context)[-(MAX_LENGTH - max_gen_toks):]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_gen_toks, pad_token_id=EOT,
                             eos_token_id=EOT)[0, len(ids):].tolist()
    return tokenizer.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def generate_requests(hf):
    """Stop strings taken from the middle of each greedy text, so that until really cuts."""
    requests = []
    for context in GENERATE_CONTEXTS:
        text = _hf_greedy(hf, context, 6)
        requests.append({"type": "generate_until", "context": context, "until": [text[len(text) // 2:][:3] or "\n"],
                         "max_gen_toks": 6})
    requests.append({"type": "generate_until", "context": "Hello world", "until": "zzzz never", "max_gen_toks": 4})
    return requests


@pytest.fixture(scope="module")
def task_files(hf, generate_requests):
    directory = hf[2].parent
    requests = [{"type": "loglikelihood", "context": c, "continuation": x} for c, x in LOGLIKELIHOOD]
    requests += [{"type": "loglikelihood_rolling", "text": t} for t in ROLLING] + generate_requests
    (directory / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    (directory / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MULTIPLE_CHOICE))
    return [str(directory / "requests.jsonl"), str(directory / "mc.jsonl")]


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _flags(hf, task_files, out):
    return ["--load-hf", str(hf[2]), "--task-data", *task_files, "--eval-batch-size", "3", "--output-path", str(out)]


@pytest.fixture(scope="module")
def serial(hf, task_files):
    """The tool's main in this process (the TP=2 and bad-input runs are real command lines)."""
    from megatron.training.initialize import reset_megatron
    from tools import lm_eval_harness

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        lm_eval_harness.main(_flags(hf, task_files, hf[2].parent / "serial.json"))
    reset_megatron()
    return stdout.getvalue(), json.loads((hf[2].parent / "serial.json").read_text())


def _hf_log_probs(model, inputs):
    with torch.no_grad():
        return model(torch.tensor([inputs])).logits[0].log_softmax(-1)  # [s, v]


def _hf_loglikelihood(hf, context, continuation):
    """lm-eval's rule, re-derived: whole-text encoding split after the context's tokens."""
    model, tokenizer, _ = hf
    if context == "":
        context_ids, continuation_ids = [EOT], tokenizer.encode(continuation)
    else:
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        context_ids = tokenizer.encode(stripped)
        continuation_ids = tokenizer.encode(stripped + continuation)[len(context_ids):]
    inputs = (context_ids + continuation_ids)[-(MAX_LENGTH + 1):][:-1]
    log_probs = _hf_log_probs(model, inputs)[-len(continuation_ids):]
    target = torch.tensor(continuation_ids)
    return float(log_probs.gather(1, target[:, None]).sum()), bool((log_probs.argmax(-1) == target).all())


def _hf_rolling(hf, text):
    """Windows of MAX_LENGTH predicted tokens; each later one conditions on the MAX_LENGTH tokens
    before its last token (the last, partial window on the tokens it overlaps)."""
    model, tokenizer, _ = hf
    ids = tokenizer.encode(text)
    first = ids[:MAX_LENGTH]
    total = float(_hf_log_probs(model, [EOT] + first[:-1]).gather(1, torch.tensor(first)[:, None]).sum())
    for start in range(MAX_LENGTH, len(ids), MAX_LENGTH):
        end = min(start + MAX_LENGTH, len(ids))
        inputs = ids[end - 1 - MAX_LENGTH:end - 1]
        predicted = torch.tensor(ids[start:end])
        total += float(_hf_log_probs(model, inputs)[-len(predicted):].gather(1, predicted[:, None]).sum())
    return total


def test_loglikelihood_and_is_greedy_equal_hf(hf, serial):
    samples = [s for s in serial[1]["samples"]["requests"] if s["type"] == "loglikelihood"]
    _, tokenizer, _ = hf
    assert tokenizer.encode("She said hello there")[:3] != tokenizer.encode("She said hel")  # the boundary case is one
    for (context, continuation), sample in zip(LOGLIKELIHOOD, samples):
        log_prob, greedy = _hf_loglikelihood(hf, context, continuation)
        assert sample["loglikelihood"] == pytest.approx(log_prob, abs=1e-4), (context, continuation)
        assert sample["is_greedy"] == greedy


def test_rolling_loglikelihood_equals_hf_over_independent_windows(hf, serial):
    samples = [s for s in serial[1]["samples"]["requests"] if s["type"] == "loglikelihood_rolling"]
    length = len(hf[1].encode(ROLLING[0]))
    assert length > 2 * MAX_LENGTH and length % MAX_LENGTH  # several windows, the last one partial
    for text, sample in zip(ROLLING, samples):
        assert sample["loglikelihood"] == pytest.approx(_hf_rolling(hf, text), abs=1e-3)
    total = sum(s["loglikelihood"] for s in samples)
    size = sum(len(t.encode("utf-8")) for t in ROLLING)
    metrics = serial[1]["results"]["requests"]
    assert metrics["loglikelihood_rolling/bits_per_byte"] == pytest.approx(-total / size / math.log(2))
    assert metrics["loglikelihood_rolling/word_perplexity"] == pytest.approx(
        math.exp(-total / sum(len(t.split()) for t in ROLLING)))


def test_generate_until_equals_hf_greedy_cut_at_until(hf, serial, generate_requests):
    samples = [s for s in serial[1]["samples"]["requests"] if s["type"] == "generate_until"]
    for request, sample in zip(generate_requests, samples):
        expected = _hf_greedy(hf, request["context"], request["max_gen_toks"])
        until = request["until"] if isinstance(request["until"], list) else [request["until"]]
        for term in until + ["<|endoftext|>"]:
            expected = expected.split(term)[0]
        assert sample["text"] == expected, request
    assert any(len(s["text"]) < len(_hf_greedy(hf, r["context"], 6)) for r, s in zip(generate_requests, samples))


def test_multiple_choice_acc_and_acc_norm_equal_a_direct_computation(hf, serial):
    accs, norms = [], []
    for doc, sample in zip(MULTIPLE_CHOICE, serial[1]["samples"]["mc"]):
        context = doc.get("context", doc.get("question"))
        lls = [_hf_loglikelihood(hf, context, " " + choice)[0] for choice in doc["choices"]]
        assert sample["loglikelihoods"] == pytest.approx(lls, abs=1e-4)
        accs.append(float(int(torch.tensor(lls).argmax()) == doc["gold"]))
        normed = torch.tensor(lls) / torch.tensor([float(len(c)) for c in doc["choices"]])
        norms.append(float(int(normed.argmax()) == doc["gold"]))
    metrics = serial[1]["results"]["mc"]
    assert metrics["acc"] == pytest.approx(sum(accs) / len(accs))
    assert metrics["acc_norm"] == pytest.approx(sum(norms) / len(norms))
    table = [line for line in serial[0].splitlines() if line.startswith("|")]
    assert table[0].split("|")[1:-1] == [h.center(len(h0)) for h, h0 in zip(
        ["Tasks", "Version", "Filter", "n-shot", "Metric", "", "Value", "", "Stderr"], table[0].split("|")[1:-1])]
    assert any(row.split("|")[5].strip() == "acc_norm" and row.split("|")[7].strip() == "%.4f" % metrics["acc_norm"]
               for row in table)


@pytest.fixture(scope="module")
def our_checkpoint(hf):
    """The HF directory converted to our checkpoint at PP=2 (tools/checkpoint/convert.py --loader hf)."""
    ckpt = hf[2].parent / "ckpt"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"), "--model-type", "GPT",
                          "--loader", "hf", "--saver", "megatron", "--load-dir", str(hf[2]), "--save-dir", str(ckpt),
                          "--target-pipeline-parallel-size", "2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    return ckpt


@pytest.mark.slow
@pytest.mark.parametrize("source", ["tp2_load_hf", "pp2_our_checkpoint"])
def test_parallel_answers_equal_the_serial_ones(hf, task_files, serial, source, request, gpt2_vocab_dir):
    """TP=2 from the HF directory; PP=2 from our checkpoint of it, with our GPT2BPETokenizer."""
    out = hf[2].parent / f"{source}.json"
    flags = _flags(hf, task_files, out)
    if source == "tp2_load_hf":
        flags += ["--tensor-model-parallel-size", "2"]
    else:
        flags = ["--load", str(request.getfixturevalue("our_checkpoint")), "--use-checkpoint-args",
                 "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(gpt2_vocab_dir / "vocab.json"),
                 "--merge-file", str(gpt2_vocab_dir / "merges.txt"), *flags[2:], "--pipeline-model-parallel-size", "2"]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(_free_port()), TOOL, *flags],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    got, want = json.loads(out.read_text())["samples"], serial[1]["samples"]
    for task in want:
        for a, b in zip(got[task], want[task]):
            assert a.get("text") == b.get("text") and a.get("is_greedy") == b.get("is_greedy")
            assert a.get("loglikelihood", 0) == pytest.approx(b.get("loglikelihood", 0), abs=1e-4)
            assert a.get("loglikelihoods", [0]) == pytest.approx(b.get("loglikelihoods", [0]), abs=1e-4)


def test_a_bad_line_is_one_file_line_error(hf, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "loglikelihood", "context": "a", "continuation": " b"}\n\n{"type": "loglikelihood", \n')
    run = subprocess.run([sys.executable, TOOL, "--load-hf", str(hf[2]), "--task-data", str(bad)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith(f"lm_eval_harness.py: error: {bad}:3: not JSON: ")
    assert "Traceback" not in run.stderr


TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
{body}
"""
TASK_BODIES = {
    "tiny_mc": ("multiple_choice", 'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\n'
                "metric_list:\n  - metric: acc\n  - metric: acc_norm"),
    "tiny_rolling": ("loglikelihood_rolling", 'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
                     "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte"),
    "tiny_generate": ("generate_until", 'doc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
                      'generation_kwargs:\n  until: ["\\n\\n", "ot"]\n  max_gen_toks: 5\n  do_sample: false\n'
                      "metric_list:\n  - metric: exact_match"),
}


def _write_yaml_tasks(hf, directory):
    """TASK_BODIES as lm_eval YAML tasks over local JSONL files in directory (lm_eval needed)."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm_eval is not installed (pip install lm-eval>=0.4.9)")
    mc = [{"context": d.get("context", d.get("question")), "choices": d["choices"], "gold": d["gold"]}
          for d in MULTIPLE_CHOICE]
    generate = [{"context": c, "target": _hf_greedy(hf, c, 5)} for c in GENERATE_CONTEXTS]
    rows = {"tiny_mc": mc, "tiny_rolling": [{"text": t} for t in ROLLING], "tiny_generate": generate}
    for name, (output_type, body) in TASK_BODIES.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows[name]))
        (directory / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data, output_type=output_type,
                                                                  body=body))
    return {**os.environ, "PYTHONPATH": ROOT, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(directory / "hf_home")}


def _adapter_cli(directory, env, *flags):
    """The documented command line: lm_eval's own, with megatron_compat registered."""
    return subprocess.run([sys.executable, "-m", "megatron.evaluation.lm_eval_adapter", "--model", "megatron_compat",
                           "--include_path", str(directory), *flags],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)


def test_lm_eval_runs_megatron_compat_on_local_yaml_tasks(hf, serial, tmp_path):
    """lm_eval's own command line (when it is installed) over YAML tasks on local JSONL files: the
    registered megatron_compat model gives our tool's scores and HF's greedy text. The batch size
    is given both ways, as lm_eval 0.4.13 hands its --batch_size beside model_args (lm_eval alone
    stopped there with "got multiple values for keyword argument 'batch_size'")."""
    env = _write_yaml_tasks(hf, tmp_path)
    run = _adapter_cli(tmp_path, env, "--model_args", f"load_hf={hf[2]},batch_size=3", "--batch_size", "3",
                       "--tasks", ",".join(TASK_BODIES), "--output_path", str(tmp_path / "out"), "--log_samples")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "batch_size: 3" in run.stdout
    [results] = (tmp_path / "out").glob("**/results_*.json")
    got = json.loads(results.read_text())["results"]
    ours = serial[1]["results"]
    assert got["tiny_mc"]["acc,none"] == pytest.approx(ours["mc"]["acc"])
    assert got["tiny_mc"]["acc_norm,none"] == pytest.approx(ours["mc"]["acc_norm"])
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert got["tiny_rolling"][f"{metric},none"] == pytest.approx(
            ours["requests"][f"loglikelihood_rolling/{metric}"], rel=1e-5)
    [samples] = (tmp_path / "out").glob("**/samples_tiny_generate_*.jsonl")
    samples = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(samples) == len(GENERATE_CONTEXTS)
    for sample in samples:
        expected = _hf_greedy(hf, sample["doc"]["context"], 5)
        for term in ("\n\n", "ot", "<|endoftext|>"):
            expected = expected.split(term)[0]
        assert sample["filtered_resps"][0] == expected


def test_two_different_batch_sizes_are_one_line_before_lm_eval_loads_tasks(tmp_path):
    """batch_size=8 in model_args against lm_eval's --batch_size (its default 1 here): one line,
    exit status 1, no traceback, before lm_eval indexes its task library or the model is built."""
    pytest.importorskip("lm_eval")
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = _adapter_cli(tmp_path, env, "--model_args", f"load_hf={tmp_path / 'never_read'},batch_size=8",
                       "--tasks", "tiny_mc")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "lm_eval_adapter: error: batch_size=8 in --model_args and --batch_size 1 differ (lm_eval's --batch_size "
        "defaults to 1 when not given): give it once, e.g. --batch_size 8"]
