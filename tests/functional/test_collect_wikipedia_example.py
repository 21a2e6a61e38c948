"""examples/collect_wikipedia.sh runs the whole chain on the dump it writes itself: the redirect,
the talk page and the 20 repeated articles go, the article quoting the LAMBADA passage goes, and
the rest becomes a .bin/.idx dataset."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ftfy", reason="needs the data extra: pip install -e .[data]")
pytest.importorskip("py3langid", reason="needs the data extra: pip install -e .[data]")
pytest.importorskip("tokenizers", reason="the example trains its tokenizer with HF tokenizers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_example_chain(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "WORKERS": "2"}
    env.pop("VOCAB_FILE", None)
    env.pop("MERGE_FILE", None)
    out = tmp_path / "wiki"
    result = subprocess.run(["bash", os.path.join(ROOT, "examples", "collect_wikipedia.sh"), str(out)],
                            capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    titles = [json.loads(line)["title"] for line in open(out / "wiki.final.jsonl")]
    assert len(titles) == 200 and "Extra" not in titles and not any("(copy)" in t for t in titles)
    assert json.load(open(out / "wiki.final.jsonl.report.json"))["contaminated_by_task"] == {"LAMBADA": 1}
    assert json.load(open(out / "dedup" / "dedup.report.json"))["dropped"] == 20
    assert (out / "wiki_text_document.bin").stat().st_size > 0 and (out / "wiki_text_document.idx").exists()
