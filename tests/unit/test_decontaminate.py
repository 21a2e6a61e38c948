"""tools/data_collection/decontaminate.py removes exactly the documents that carry a 13-gram of
an evaluation file (LAMBADA, WikiText-103, RACE, MNLI, QQP, in the formats tasks/ reads), whatever
their case and punctuation, and keeps those with only 12 of its words; --mode split cuts around the
match as Megatron's filter_ngrams does; bad task files name the file and line."""
import json
import os
import random

import pytest

from tools.data_collection import decontaminate
from tools.data_collection.common import DataCollectionError
from tools.data_collection.synthetic import paragraph

NATO = ("alfa bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa "
        "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def eval_sentence(rng, words=20):
    return " ".join(rng.choice(NATO) + str(rng.randint(0, 9)) for _ in range(words))


def write_tasks(root, rng):
    """One evaluation file of each task; returns {task: [its texts]} and the --task flags."""
    texts = {task: [eval_sentence(rng) for _ in range(3)] for task in ("LAMBADA", "WIKITEXT103", "RACE", "MNLI", "QQP")}
    (root / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts["LAMBADA"]))
    (root / "wiki.test.tokens").write_text(" \n = Title = \n \n" + "".join(f" {t} \n" for t in texts["WIKITEXT103"]))
    race = root / "RACE" / "test" / "high"
    race.mkdir(parents=True)
    (race / "1.txt").write_text(json.dumps({"article": texts["RACE"][0], "questions": [texts["RACE"][1]],
                                            "options": [[texts["RACE"][2], "b", "c", "d"]], "answers": ["A"],
                                            "id": "high1.txt"}))
    head = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
            "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]
    short = "the quick brown fox jumps over lazy dogs"  # 8 words: shorter than 13, counts whole
    texts["MNLI_short"] = [short]
    rows = ["\t".join(head)] + ["\t".join(["0", "1", "1", "fiction", "", "", "", "", texts["MNLI"][0], short,
                                           "neutral", "neutral"])]
    rows += ["\t".join(["1", "2", "2", "fiction", "", "", "", "", texts["MNLI"][1], texts["MNLI"][2],
                        "neutral", "neutral"])]
    (root / "dev_matched.tsv").write_text("\n".join(rows) + "\n")
    (root / "qqp_dev.tsv").write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n" + "".join(
        f"{k}\t{k}\t{k}\t{texts['QQP'][k]}\t{texts['QQP'][(k + 1) % 3]}\t0\n" for k in range(3)))
    flags = ["--task", f"LAMBADA:{root / 'lambada.jsonl'}", "--task", f"WIKITEXT103:{root / 'wiki.test.tokens'}",
             "--task", f"RACE:{root / 'RACE' / 'test'}", "--task", f"MNLI:{root / 'dev_matched.tsv'}",
             "--task", f"qqp:{root / 'qqp_dev.tsv'}"]
    return texts, flags


def plant(doc: str, words, rng, shout=False) -> str:
    gram = " ".join(words)
    gram = gram.upper().replace(" ", ", ", 3) if shout else gram  # case and punctuation do not matter
    cut = rng.randint(0, len(doc))
    cut = doc.find(" ", cut) if doc.find(" ", cut) > 0 else len(doc)
    return doc[:cut] + " " + gram + doc[cut:]


@pytest.mark.parametrize("workers", [1, 2])
def test_removes_exactly_the_documents_with_a_planted_13gram(tmp_path, workers):
    rng = random.Random(4)
    texts, flags = write_tasks(tmp_path, rng)
    docs = [paragraph(rng, 6) for _ in range(120)]
    planted = {}
    for k, task in enumerate(("LAMBADA", "WIKITEXT103", "RACE", "MNLI", "QQP")):
        for j, text in enumerate(texts[task][:3]):
            doc = 7 * k + 2 * j + 3
            words = text.split()
            start = rng.randint(0, len(words) - 13)
            docs[doc] = plant(docs[doc], words[start:start + 13], rng, shout=j == 1)
            planted[doc] = task
    docs[100] = plant(docs[100], texts["MNLI_short"][0].split(), rng)
    planted[100] = "MNLI"
    for doc in (101, 102, 103):  # 12 words of an evaluation text, or 13 with one word changed: kept
        words = texts["LAMBADA"][0].split()
        docs[doc] = plant(docs[doc], words[:12] if doc == 101 else words[:6] + ["other"] + words[7:13], rng)
    docs[104] = plant(docs[104], texts["MNLI_short"][0].split()[:7], rng)
    with open(tmp_path / "in.jsonl", "w") as f:
        for k, doc in enumerate(docs):
            f.write(json.dumps({"text": doc, "id": k}) + "\n")
    report = decontaminate.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                                 "--workers", str(workers), "--batch-size", "7", *flags])
    kept = [json.loads(line)["id"] for line in open(tmp_path / "out.jsonl")]
    assert sorted(set(range(len(docs))) - set(kept)) == sorted(planted)
    assert report["removed"] == len(planted) and report["split"] == 0
    assert report["contaminated_by_task"] == {"LAMBADA": 3, "WIKITEXT103": 3, "RACE": 3, "MNLI": 4, "QQP": 3}
    assert json.load(open(tmp_path / "out.jsonl.report.json"))["removed"] == len(planted)


def test_split_mode_cuts_around_the_match(tmp_path):
    rng = random.Random(1)
    texts, flags = write_tasks(tmp_path, rng)
    gram = " ".join(texts["QQP"][0].split()[:13])
    left, right = "a" * 300, "b" * 50
    docs = [f"{left} {'x ' * 100}{gram} {'y ' * 100}{right}", f"{'x ' * 10}{gram} {'y' * 10}"]
    with open(tmp_path / "in.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    report = decontaminate.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                                 "--mode", "split", *flags])
    pieces = [json.loads(line)["text"] for line in open(tmp_path / "out.jsonl")]
    assert pieces == [left]  # the 200 chars on each side go; the right piece and the short doc are too short
    assert (report["split"], report["removed"]) == (1, 1)


def test_bad_task_and_input_files_name_file_and_line(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "fine"}\n')
    (tmp_path / "lambada.jsonl").write_text('{"text": "ok"}\n{"txt": "x"}\n')
    with pytest.raises(DataCollectionError, match=r"lambada\.jsonl:2: no \"text\" string"):
        decontaminate.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                            "--task", f"LAMBADA:{tmp_path / 'lambada.jsonl'}"])
    (tmp_path / "qqp.tsv").write_text("id\tq1\tq2\n")
    with pytest.raises(DataCollectionError, match=r"qqp\.tsv:1: the header has no question1, question2 column"):
        decontaminate.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                            "--task", f"QQP:{tmp_path / 'qqp.tsv'}"])
    (tmp_path / "lambada.jsonl").write_text(json.dumps({"text": " ".join(NATO)}) + "\n")
    (tmp_path / "in.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n')
    with pytest.raises(DataCollectionError, match=r"in\.jsonl:2: not valid JSON"):
        decontaminate.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                            "--task", f"LAMBADA:{tmp_path / 'lambada.jsonl'}", "--workers", "2"])
    assert not [n for n in os.listdir(tmp_path) if n.startswith((".o.jsonl", "o.jsonl"))]
    with pytest.raises(DataCollectionError, match=r"--task SQUAD:x: expected TASK:PATH"):
        decontaminate.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                            "--task", "SQUAD:x"])
