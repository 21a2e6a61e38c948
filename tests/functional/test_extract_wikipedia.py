"""tools/data_collection/extract_wikipedia.py on a hand-written dump: the texts WikiExtractor
would give (templates, infoboxes, tables, refs, files and categories gone, links reduced to their
text), redirects and other namespaces skipped; bad XML and a truncated bz2 stop the run with one
line naming the file and line, and leave no output."""
import bz2
import json
import os
import subprocess
import sys
from xml.sax.saxutils import escape

import pytest

from tools.data_collection import extract_wikipedia
from tools.data_collection.common import DataCollectionError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "data_collection", "extract_wikipedia.py")

ARTICLES = {
    "Paris": (
        "{{Short description|Capital of France}}\n"
        "{{Infobox settlement\n| name = Paris\n| population = {{formatnum:2102650}}\n| image = [[File:Paris.jpg|200px]]\n}}\n"
        "'''Paris''' ({{IPA-fr|paʁi}}) is the [[capital city|capital]] and largest city of [[France]].<ref name=\"pop\">"
        "{{cite web |url=http://insee.fr |title=Population}}</ref> It lies on the [[Seine]]s banks.<ref name=\"pop\" />\n"
        "[[File:Eiffel Tower.jpg|thumb|The [[Eiffel Tower|tower]] at [[night]]]]\n"
        "\n"
        "== History ==\n"
        "The [[Parisii (Gaul)|Parisii]] settled there.<!-- a hidden remark --> See [http://example.org the archive]"
        " or [http://example.org/2].\n"
        "{| class=\"wikitable\"\n|-\n! Year !! People\n|-\n| 1801 || {{n|546856}}\n|}\n"
        "=== Empty subsection ===\n"
        "== Climate ==\n"
        "* Summers are ''warm''.\n"
        "# Winters are ''cool'' &amp; wet.\n"
        "\n"
        "[[Category:Capitals in Europe]]\n[[fr:Paris]]\n"
    ),
    "Seine": (
        "The '''Seine''' is a river.<ref>Ref one</ref> Its length is 777&nbsp;km.__NOTOC__\n"
        "{{Main|Rivers of France}}\n"
        "It flows through [[Paris]] and into the [[English Channel|Channel]]."
    ),
}
EXPECTED = {
    "Paris": ("Paris is the capital and largest city of France. It lies on the Seines banks.\n"
              "History.\n"
              "The Parisii settled there. See the archive or.\n"
              "Climate.\n"
              "Summers are warm.\n"
              "Winters are cool & wet."),
    "Seine": "The Seine is a river. Its length is 777 km.\nIt flows through Paris and into the Channel.",
}


def page(title: str, ns: int, page_id: int, text: str, redirect: str = "") -> str:
    redirect_element = f'<redirect title="{redirect}" />' if redirect else ""
    return (f"  <page>\n    <title>{escape(title)}</title>\n    <ns>{ns}</ns>\n    <id>{page_id}</id>\n"
            f"    {redirect_element}\n    <revision>\n      <id>{page_id + 1000}</id>\n"
            f'      <text xml:space="preserve">{escape(text)}</text>\n    </revision>\n  </page>\n')


def write_dump(path, compress: bool = False) -> bytes:
    pages = [page("Paris", 0, 10, ARTICLES["Paris"]),
             page("Talk:Paris", 1, 11, "Is the '''population''' right? ~~~~"),
             page("Lutetia", 0, 12, "#REDIRECT [[Paris]]", redirect="Paris"),
             page("Category:Capitals", 14, 13, "Capital cities."),
             page("Seine", 0, 14, ARTICLES["Seine"]),
             page("Empty", 0, 15, "{{Disambiguation}}")]
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">\n'
           "  <siteinfo>\n    <sitename>Wikipedia</sitename>\n"
           "    <base>https://en.wikipedia.org/wiki/Main_Page</base>\n  </siteinfo>\n"
           + "".join(pages) + "</mediawiki>\n").encode("utf-8")
    path.write_bytes(bz2.compress(xml) if compress else xml)
    return xml


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("compress,workers", [(False, 1), (True, 2)])
def test_articles_give_exactly_the_expected_texts(tmp_path, compress, workers):
    dump = tmp_path / ("dump.xml.bz2" if compress else "dump.xml")
    write_dump(dump, compress)
    stats = extract_wikipedia.main(["--input", str(dump), "--output", str(tmp_path / "wiki.jsonl"),
                                    "--workers", str(workers), "--batch-size", "1"])
    records = read_jsonl(tmp_path / "wiki.jsonl")
    assert [r["title"] for r in records] == ["Paris", "Seine"]
    assert records[0] == {"id": "10", "url": "https://en.wikipedia.org/wiki?curid=10", "title": "Paris",
                          "text": EXPECTED["Paris"]}
    assert records[1]["text"] == EXPECTED["Seine"]
    assert (stats["pages"], stats["skipped_redirect"], stats["skipped_namespace"], stats["skipped_empty"]) == (6, 1, 2, 1)


def test_regex_sentence_splitting(tmp_path):
    dump = tmp_path / "dump.xml"
    write_dump(dump)
    extract_wikipedia.main(["--input", str(dump), "--output", str(tmp_path / "wiki.jsonl"), "--split-sentences", "regex"])
    assert read_jsonl(tmp_path / "wiki.jsonl")[0]["text"].split("\n")[:2] == [
        "Paris is the capital and largest city of France.", "It lies on the Seines banks."]
    assert extract_wikipedia.regex_sentences("Dr. Smith met Mr. J. Doe. He left!") == ["Dr. Smith met Mr. J. Doe.", "He left!"]


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT)


def test_bad_xml_names_file_and_line_and_writes_nothing(tmp_path):
    xml = write_dump(tmp_path / "good.xml").decode()
    lines = xml.split("\n")
    lines[8] = lines[8].replace("</id>", "</idd>")  # line 9: the first page's <id>
    (tmp_path / "bad.xml").write_text("\n".join(lines))
    (tmp_path / "out.jsonl").write_text("old\n")
    result = run_script("--input", str(tmp_path / "bad.xml"), "--output", str(tmp_path / "out.jsonl"), "--workers", "2")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"extract_wikipedia.py: error: {tmp_path / 'bad.xml'}:9: bad XML (mismatched tag, column 13)"]
    assert (tmp_path / "out.jsonl").read_text() == "old\n"  # the old output stays; no temporary is left
    assert sorted(os.listdir(tmp_path)) == ["bad.xml", "good.xml", "out.jsonl"]


def test_truncated_bz2_names_file_and_line(tmp_path):
    data = bz2.compress(write_dump(tmp_path / "good.xml") * 1)
    (tmp_path / "cut.xml.bz2").write_bytes(data[: len(data) - 20])
    with pytest.raises(DataCollectionError, match=r"cut\.xml\.bz2:\d+: the compressed data is damaged or truncated"):
        extract_wikipedia.main(["--input", str(tmp_path / "cut.xml.bz2"), "--output", str(tmp_path / "o.jsonl")])
    result = run_script("--input", str(tmp_path / "cut.xml.bz2"), "--output", str(tmp_path / "o.jsonl"))
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    assert not any(name.startswith((".o.jsonl", "o.jsonl")) for name in os.listdir(tmp_path))


def test_not_a_mediawiki_dump(tmp_path):
    (tmp_path / "x.xml").write_text("<html><body/></html>\n")
    with pytest.raises(DataCollectionError, match=r"x\.xml:1: bad XML \(the root element is <html>"):
        extract_wikipedia.main(["--input", str(tmp_path / "x.xml"), "--output", str(tmp_path / "o.jsonl")])


def test_dumps_without_ns_elements_use_the_title_prefix(tmp_path):
    (tmp_path / "old.xml").write_text(
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.5/" version="0.5">\n'
        "  <siteinfo><base>https://en.wikipedia.org/wiki/Main_Page</base>\n"
        '    <namespaces><namespace key="0" /><namespace key="1">Talk</namespace></namespaces></siteinfo>\n'
        "  <page><title>Talk:X</title><id>1</id><revision><text>talk</text></revision></page>\n"
        "  <page><title>X: the letter</title><id>2</id><revision><text>Article.</text></revision></page>\n"
        "</mediawiki>\n")
    stats = extract_wikipedia.main(["--input", str(tmp_path / "old.xml"), "--output", str(tmp_path / "o.jsonl")])
    assert [r["title"] for r in read_jsonl(tmp_path / "o.jsonl")] == ["X: the letter"]
    assert stats["skipped_namespace"] == 1


def test_nltk_sentences(tmp_path, nltk_data_dir):
    import nltk

    dump = tmp_path / "dump.xml"
    write_dump(dump)
    extract_wikipedia.main(["--input", str(dump), "--output", str(tmp_path / "wiki.jsonl"),
                            "--split-sentences", "nltk", "--workers", "2"])
    text = read_jsonl(tmp_path / "wiki.jsonl")[0]["text"]
    assert text.split("\n") == [s for line in EXPECTED["Paris"].split("\n") for s in nltk.sent_tokenize(line)]
    assert text.split("\n")[:2] == ["Paris is the capital and largest city of France.", "It lies on the Seines banks."]


def test_missing_punkt_is_one_clear_error_before_any_work(tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "empty")])
    write_dump(tmp_path / "dump.xml")
    with pytest.raises(DataCollectionError, match=r"punkt_tab data is not installed.*or use --split-sentences regex"):
        extract_wikipedia.main(["--input", str(tmp_path / "dump.xml"), "--output", str(tmp_path / "o.jsonl"),
                                "--split-sentences", "nltk"])
    assert not (tmp_path / "o.jsonl").exists()
