"""tools/data_collection/cleanup.py: OpenWebText's URL rules, ftfy repair, language identification
(py3langid) and the minimum length, each drop counted under its reason in the JSON report; a
malformed line names the file and line and leaves no output."""
import json
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("ftfy", reason="needs the data extra: pip install -e .[data]")
pytest.importorskip("py3langid", reason="needs the data extra: pip install -e .[data]")

from tools.data_collection import cleanup  # noqa: E402
from tools.data_collection.common import DataCollectionError  # noqa: E402
from tools.data_collection.synthetic import paragraph  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GERMAN = ("Die Stadt liegt am Ufer des Flusses und hat eine lange Geschichte. Im Mittelalter war sie ein "
          "wichtiger Handelsplatz, und noch heute kommen viele Besucher in die schöne Altstadt mit ihren "
          "Kirchen, Brücken und engen Gassen. ") * 3


@pytest.mark.parametrize("url,verdict", [
    ("https://www.youtube.com/watch?v=x", "blacklisted_domain"),
    ("http://i.imgur.com/abc", "blacklisted_domain"),
    ("https://news.bbc.co.uk/story", None),
    ("https://example.com/photo.JPG", "blacklisted_extension"),
    ("https://example.com/archive.tar.gz", "blacklisted_extension"),
    ("https://example.com/page.html", None),
    ("https://example.com/dir/", None),
    ("ftp://example.com/x", "bad_url"),
    ("not a url", "bad_url"),
])
def test_url_rules(url, verdict):
    assert cleanup.url_verdict(url) == verdict


def test_registered_name():
    assert [cleanup.registered_name(h) for h in ("www.youtube.com", "news.bbc.co.uk", "localhost", "a.b.reddit.com")] \
        == ["youtube", "bbc", "localhost", "reddit"]


def test_cleanup_drops_and_reports(tmp_path):
    rng = random.Random(0)
    english = [paragraph(rng, 12) for _ in range(4)]
    docs = [
        {"text": english[0], "url": "https://example.org/a"},
        {"text": english[1], "url": "https://www.youtube.com/watch?v=1"},
        {"text": english[2], "url": "https://example.org/b.pdf"},
        {"text": "Too short to keep.", "url": "https://example.org/c"},
        {"text": GERMAN, "url": "https://example.org/d"},
        {"text": english[3] + " It doesnâ€™t matter."},  # mojibake, no url: kept, repaired
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "domains.txt").write_text("# more\nexample-bad\n")
    report = cleanup.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                           "--min-words", "20", "--workers", "2", "--batch-size", "2",
                           "--blacklist-domains", str(tmp_path / "domains.txt")])
    out = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
    assert [d.get("url") for d in out] == ["https://example.org/a", None]
    assert out[1]["text"].endswith(" It doesn't matter.")
    assert report["dropped"] == {"blacklisted_domain": 1, "blacklisted_extension": 1, "bad_url": 0, "too_short": 1,
                                 "language": 1}
    assert report["kept"] == 2 and report["documents"] == 6 and report["ftfy_repaired"] == 1
    assert report["languages"]["de"] == 1 and report["languages"]["en"] == 2
    assert report["examples"]["language"] == [f"{tmp_path / 'in.jsonl'}:5"]
    assert json.load(open(tmp_path / "out.jsonl.report.json")) == report


def test_malformed_json_line_is_one_line_and_leaves_no_output(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n\n{"text": 3}\n')
    with pytest.raises(DataCollectionError, match=r"in\.jsonl:3: no 'text' string in the object"):
        cleanup.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--languages"])
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n{"text": "b",,}\n')
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "data_collection", "cleanup.py"),
                             "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                             "--workers", "2", "--languages"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"cleanup.py: error: {tmp_path / 'in.jsonl'}:2: not valid JSON (Expecting property name enclosed in "
        "double quotes, column 14)"]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_truncated_bz2_input_names_the_line_where_it_ends(tmp_path):
    import bz2
    rng = random.Random(1)
    lines = "".join(json.dumps({"text": paragraph(rng, 40)}) + "\n" for _ in range(400)).encode()
    data = bz2.compress(lines)
    (tmp_path / "in.jsonl.bz2").write_bytes(data[:-40])
    with pytest.raises(DataCollectionError, match=r"in\.jsonl\.bz2:\d+: the compressed data is damaged or truncated"):
        cleanup.main(["--input", str(tmp_path / "in.jsonl.bz2"), "--output", str(tmp_path / "out.jsonl"),
                      "--languages"])
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl.bz2"]


def test_missing_dependency_is_one_clear_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "py3langid" else real(name, *a))
    with pytest.raises(DataCollectionError, match=r"cleanup needs py3langid: pip install -e \.\[data\]"):
        cleanup.check_dependencies(["en"])
    cleanup.check_dependencies([])  # no language filter: py3langid is not needed
