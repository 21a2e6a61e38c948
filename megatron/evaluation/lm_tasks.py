"""Local JSONL tasks for HarnessLM, their metrics as lm-evaluation-harness 0.4 defines them, and its table.

One JSON object a line; a line's keys say what it is:

| line | request(s) | metrics (lm-eval's) |
|---|---|---|
| {"type": "loglikelihood", "context": C, "continuation": X} | loglikelihood(C, X) | acc (is_greedy, mean), perplexity (exp(-mean log-prob)) |
| {"type": "loglikelihood_rolling", "text": T} | loglikelihood_rolling(T) | word_perplexity, byte_perplexity, bits_per_byte |
| {"type": "generate_until", "context": C, "until": [...], "max_gen_toks": N, "target": G?} | generate_until(C, {...}) | exact_match (with a target) |
| {"context": C, "choices": [...], "gold": i} (or "question" for "context") | loglikelihood(C, delimiter + choice) per choice | acc, acc_norm |

Multiple choice (ConfigurableTask, output_type multiple_choice): pred = argmax of the choices'
log-likelihoods, pred_norm = argmax of log-likelihood / len(choice) in characters (the choice
without the target delimiter, " " by default); acc and acc_norm are their means. Rolling perplexity:
word_perplexity = exp(-sum ll / sum words) (words: re.split(r"\\s+", text)), byte_perplexity =
exp(-sum ll / sum utf-8 bytes), bits_per_byte = -sum ll / sum bytes / ln 2. Standard errors are
the mean's (sample std / sqrt(n)) for acc-like metrics, N/A for the corpus-level ones, as the
harness prints them without bootstrap iterations.

A line that is not a JSON object or lacks a field is refused as `FILE:LINE: message`.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

REQUEST_TYPES = ("loglikelihood", "loglikelihood_rolling", "generate_until")
_HIGHER_IS_BETTER = {"acc": True, "acc_norm": True, "exact_match": True, "perplexity": False,
                     "word_perplexity": False, "byte_perplexity": False, "bits_per_byte": False}


class TaskFileError(ValueError):
    """A bad task line: its message starts FILE:LINE."""


@dataclass
class TaskLine:
    """One parsed line: kind is a request type or "multiple_choice"; doc the JSON object."""
    path: str
    line: int
    kind: str
    doc: Dict[str, Any]


@dataclass
class Task:
    name: str
    lines: List[TaskLine] = field(default_factory=list)


def _string(doc: Dict[str, Any], key: str, where: str, allow_empty: bool = True) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise TaskFileError(f"{where}: \"{key}\" must be a string, got {json.dumps(value)}")
    if not allow_empty and not value:
        raise TaskFileError(f"{where}: \"{key}\" must not be empty")
    return value


def parse_line(path: str, number: int, text: str) -> TaskLine:
    where = f"{path}:{number}"
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as error:
        raise TaskFileError(f"{where}: not JSON: {error.msg} (column {error.colno})") from None
    if not isinstance(doc, dict):
        raise TaskFileError(f"{where}: a line must be a JSON object, got {type(doc).__name__}")
    if "type" in doc:
        kind = doc["type"]
        if kind not in REQUEST_TYPES:
            raise TaskFileError(f"{where}: \"type\" must be one of {', '.join(REQUEST_TYPES)}, got {json.dumps(kind)}")
        if kind == "loglikelihood":
            _string(doc, "context", where), _string(doc, "continuation", where, allow_empty=False)
        elif kind == "loglikelihood_rolling":
            _string(doc, "text", where, allow_empty=False)
        else:
            _string(doc, "context", where, allow_empty=False)
            until = doc.get("until", [])
            if not (isinstance(until, str) or isinstance(until, list) and all(isinstance(u, str) for u in until)):
                raise TaskFileError(f"{where}: \"until\" must be a string or a list of strings")
            if "max_gen_toks" in doc and (not isinstance(doc["max_gen_toks"], int) or doc["max_gen_toks"] < 1):
                raise TaskFileError(f"{where}: \"max_gen_toks\" must be a positive integer")
            if "target" in doc:
                _string(doc, "target", where)
        return TaskLine(path, number, kind, doc)
    if "choices" in doc:
        if "context" not in doc and "question" in doc:
            doc = {**doc, "context": doc["question"]}
        _string(doc, "context", where)
        choices, gold = doc["choices"], doc.get("gold")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise TaskFileError(f"{where}: \"choices\" must be a list of at least two non-empty strings")
        if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
            raise TaskFileError(f"{where}: \"gold\" must be the index of a choice (0 to {len(choices) - 1}), "
                                f"got {json.dumps(gold)}")
        return TaskLine(path, number, "multiple_choice", doc)
    raise TaskFileError(f"{where}: a line needs \"type\" (a request) or \"choices\" (a multiple-choice question)")


def read_task(path: str) -> Task:
    """A JSONL task file -> Task named after the file (TaskFileError FILE:LINE on a bad line)."""
    task = Task(os.path.splitext(os.path.basename(path))[0])
    with open(path, encoding="utf-8") as handle:
        for number, text in enumerate(handle, 1):
            if text.strip():
                task.lines.append(parse_line(path, number, text))
    if not task.lines:
        raise TaskFileError(f"{path}: no requests (an empty task file)")
    return task


def _gen_kwargs(doc: Dict[str, Any]) -> Dict[str, Any]:
    kwargs = {"until": doc.get("until", [])}
    if "max_gen_toks" in doc:
        kwargs["max_gen_toks"] = doc["max_gen_toks"]
    return kwargs


def run_task(lm: Any, task: Task, target_delimiter: str = " ") -> Tuple[Dict[str, float], List[Dict[str, Any]]]:
    """Every request of task through lm (a HarnessLM or anything with its three methods), batched by
    type as the harness batches them. Returns (metrics, one sample dict per line)."""
    ll_args, ll_owner, rolling, generate = [], [], [], []
    for index, line in enumerate(task.lines):
        doc = line.doc
        if line.kind == "loglikelihood":
            ll_args.append((doc["context"], doc["continuation"]))
            ll_owner.append((index, None))
        elif line.kind == "multiple_choice":
            for choice_index, choice in enumerate(doc["choices"]):
                ll_args.append((doc["context"], f"{target_delimiter}{choice}"))
                ll_owner.append((index, choice_index))
        elif line.kind == "loglikelihood_rolling":
            rolling.append(index)
        else:
            generate.append(index)
    _check_boundaries(lm, task, ll_args, ll_owner)
    answers: Dict[int, Any] = {}
    for (index, choice_index), answer in zip(ll_owner, lm.loglikelihood(ll_args) if ll_args else []):
        if choice_index is None:
            answers[index] = answer
        else:
            answers.setdefault(index, []).append(answer)
    texts = [task.lines[i].doc["text"] for i in rolling]
    answers.update(zip(rolling, lm.loglikelihood_rolling(texts) if texts else []))
    requests = [(task.lines[i].doc["context"], _gen_kwargs(task.lines[i].doc)) for i in generate]
    answers.update(zip(generate, lm.generate_until(requests) if requests else []))
    samples = [_sample(line, answers[i]) for i, line in enumerate(task.lines)]
    return aggregate(samples), samples


def _check_boundaries(lm: Any, task: Task, ll_args: List[Tuple[str, str]], owners: List[Tuple[int, Any]]) -> None:
    """FILE:LINE for a continuation that leaves no token after the context's (lm-eval asserts on it):
    "the m" + "at" encodes as "the" " mat", and " mat" belongs to the context's length."""
    if not hasattr(lm, "encode_pair"):
        return
    for (context, continuation), (index, _) in zip(ll_args, owners):
        if not lm.encode_pair(context, continuation)[1]:
            line = task.lines[index]
            raise TaskFileError(f"{line.path}:{line.line}: the continuation {continuation!r} leaves no token after "
                                f"the context's tokens (the whole text encodes to as many tokens as the context)")


def _sample(line: TaskLine, answer: Any) -> Dict[str, Any]:
    sample = {"file": line.path, "line": line.line, "type": line.kind}
    doc = line.doc
    if line.kind == "loglikelihood":
        sample.update(loglikelihood=answer[0], is_greedy=answer[1])
    elif line.kind == "multiple_choice":
        sample.update(mc_scores(doc["choices"], doc["gold"], [ll for ll, _ in answer]))
    elif line.kind == "loglikelihood_rolling":
        text = doc["text"]
        sample.update(loglikelihood=answer, words=len(re.split(r"\s+", text)), bytes=len(text.encode("utf-8")))
    else:
        sample["text"] = answer
        if "target" in doc:
            sample["exact_match"] = float(answer == doc["target"])
    return sample


def mc_scores(choices: Sequence[str], gold: int, lls: Sequence[float]) -> Dict[str, Any]:
    """lm-eval's multiple_choice process_results: acc from argmax ll, acc_norm from argmax ll / len(choice)."""
    pred = max(range(len(lls)), key=lambda i: (lls[i], -i))  # np.argmax: the first of equal maxima
    normed = [ll / float(len(choice)) for ll, choice in zip(lls, choices)]
    pred_norm = max(range(len(normed)), key=lambda i: (normed[i], -i))
    return {"loglikelihoods": list(lls), "pred": pred, "pred_norm": pred_norm,
            "acc": float(pred == gold), "acc_norm": float(pred_norm == gold)}


def _mean_stderr(values: Sequence[float]) -> Optional[float]:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) / math.sqrt(len(values))


def aggregate(samples: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """Metric name -> value, and "NAME_stderr" -> the mean's standard error where the harness gives one.
    With several line kinds in one file, a metric's name is prefixed by the kind ("multiple_choice/acc")."""
    by_kind: Dict[str, List[Dict[str, Any]]] = {}
    for sample in samples:
        by_kind.setdefault(sample["type"], []).append(sample)
    metrics: Dict[str, float] = {}
    for kind, group in by_kind.items():
        prefix = f"{kind}/" if len(by_kind) > 1 else ""
        values: Dict[str, Any] = {}
        if kind == "loglikelihood":
            values["acc"] = [float(s["is_greedy"]) for s in group]
            values["perplexity"] = math.exp(-sum(s["loglikelihood"] for s in group) / len(group))
        elif kind == "multiple_choice":
            values["acc"] = [s["acc"] for s in group]
            values["acc_norm"] = [s["acc_norm"] for s in group]
        elif kind == "loglikelihood_rolling":
            total = sum(s["loglikelihood"] for s in group)
            words, size = sum(s["words"] for s in group), sum(s["bytes"] for s in group)
            values["word_perplexity"] = math.exp(-total / words)
            values["byte_perplexity"] = math.exp(-total / size)
            values["bits_per_byte"] = -total / size / math.log(2)
        elif any("exact_match" in s for s in group):
            values["exact_match"] = [s.get("exact_match", 0.0) for s in group]
        for name, value in values.items():
            if isinstance(value, list):
                metrics[prefix + name] = sum(value) / len(value)
                metrics[prefix + name + "_stderr"] = _mean_stderr(value)
            else:
                metrics[prefix + name] = value
    return metrics


def results_table(results: Dict[str, Dict[str, Any]], n_shot: int = 0) -> str:
    """The harness's markdown table (lm_eval.utils.make_table's columns, one row per metric, metrics
    sorted by name, the task's name on its first row only)."""
    headers = ["Tasks", "Version", "Filter", "n-shot", "Metric", "", "Value", "", "Stderr"]
    rows = []
    for task, metrics in results.items():
        first = True
        for name in sorted(metrics):
            if name.endswith("_stderr"):
                continue
            value, stderr = metrics[name], metrics.get(name + "_stderr")
            arrow = {True: "↑", False: "↓"}.get(_HIGHER_IS_BETTER.get(name.rsplit("/", 1)[-1]), "")
            rows.append([task if first else "", "N/A" if first else "", "none" if first else "",
                         str(n_shot) if first else "", name, arrow, "%.4f" % value,
                         "±" if name + "_stderr" in metrics else "",
                         ("%.4f" % stderr if stderr is not None else "   N/A") if name + "_stderr" in metrics else ""])
            first = False
    right = {1, 3, 6, 8}  # the numeric columns, right-aligned as pytablewriter aligns them
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    widths = [max(w, 3) for w in widths]

    def render(cells: List[str], header: bool = False) -> str:
        out = []
        for i, (cell, width) in enumerate(zip(cells, widths)):
            out.append(cell.center(width) if header else cell.rjust(width) if i in right else cell.ljust(width))
        return "|" + "|".join(out) + "|"

    rule = "|" + "|".join("-" * (w - 1) + ":" if i in right else "-" * w for i, w in enumerate(widths)) + "|"
    return "\n".join([render(headers, header=True), rule] + [render(r) for r in rows])
