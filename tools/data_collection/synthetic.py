"""Small synthetic inputs for the data-collection examples, tests and benchmarks (nothing is
downloaded): English-like documents, corpora with planted near-duplicates, MediaWiki dumps.

    python tools/data_collection/synthetic.py dump --output wiki.xml.bz2 --articles 200
    python tools/data_collection/synthetic.py corpus --output docs.jsonl --documents 1000
"""

from __future__ import annotations

import argparse
import bz2
import json
import os
import random
import sys
from typing import List, Optional, Sequence, Tuple
from xml.sax.saxutils import escape

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.data_collection.common import atomic_output

WORDS = """
the of and to in is was for on that with as by at from his her their which this are were be has had have
it not but or an its they one all been also who more would there after first when new most other some time
only over into can two about them years city river people state world during than many made such where used
through both between under while later several three well known part early since before century history
village family music water power school house church king war government country small large long great
north south east west high old years area land name work life day year town number found called being
around place because each built system became these however city along public around three around local
national service player season team club league film series book story writer painter island mountain lake
forest road bridge station railway market garden harbour valley coast field castle tower museum library
language word letter song album record label company member party election court law army ship battle
""".split()


def sentence(rng: random.Random, low: int = 6, high: int = 18) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(low, high))]
    return " ".join(words).capitalize() + "."


def paragraph(rng: random.Random, sentences: int = 5) -> str:
    return " ".join(sentence(rng) for _ in range(sentences))


def mutate(rng: random.Random, text: str, substitutions: int) -> str:
    """text with `substitutions` words (at distinct random places) replaced by other words."""
    words = text.split(" ")
    for position in rng.sample(range(len(words)), min(substitutions, len(words))):
        words[position] = rng.choice([w for w in ("zebra", "quartz", "nimbus", "fjord", "oxide", "plinth")
                                      if w != words[position]])
    return " ".join(words)


def planted_corpus(documents: int, pairs: int, words: int = 200, substitutions: Sequence[int] = range(41),
                   seed: int = 0) -> Tuple[List[str], List[Tuple[int, int]]]:
    """`documents` unrelated texts plus `pairs` near-duplicates of some of them (each with a
    number of words changed drawn from `substitutions`: with 200 words and 5-word shingles, 2
    changes leave a Jaccard similarity of about 0.9, 14 about 0.5), shuffled; returns the texts
    and the planted (i, j) pairs."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(documents)]
    planted = []
    for k in range(pairs):
        original = k % documents
        texts.append(mutate(rng, texts[original], rng.choice(substitutions)))
        planted.append((original, len(texts) - 1))
    order = list(range(len(texts)))
    rng.shuffle(order)
    position = {old: new for new, old in enumerate(order)}
    return [texts[i] for i in order], [tuple(sorted((position[i], position[j]))) for i, j in planted]


def write_corpus(path: str, documents: int, pairs: int, seed: int = 0) -> None:
    texts, _ = planted_corpus(documents, pairs, seed=seed)
    with atomic_output(path) as f:
        for k, text in enumerate(texts):
            f.write((json.dumps({"text": text, "url": f"https://example.org/{k}"}) + "\n").encode())


def wiki_page(rng: random.Random, title: str, page_id: int) -> str:
    body = (f"{{{{Infobox place\n| name = {title}\n| population = {{{{formatnum:{rng.randint(100, 99999)}}}}}\n}}}}\n"
            f"'''{title}''' is a [[village|small village]] on the [[{rng.choice(WORDS).capitalize()} River]]."
            f"<ref>{{{{cite book|title=Atlas}}}}</ref> {paragraph(rng)}\n\n== History ==\n{paragraph(rng, 8)}\n"
            f"{{| class=\"wikitable\"\n|-\n| 1900 || {rng.randint(1, 999)}\n|}}\n"
            f"== Geography ==\n{paragraph(rng, 8)} [[File:{title}.jpg|thumb|A [[view]] of {title}]]\n"
            f"* {sentence(rng)}\n* {sentence(rng)}\n[[Category:Villages]]\n")
    return (f"  <page>\n    <title>{escape(title)}</title>\n    <ns>0</ns>\n    <id>{page_id}</id>\n"
            f"    <revision>\n      <id>{page_id + 100000}</id>\n"
            f"      <text xml:space=\"preserve\">{escape(body)}</text>\n    </revision>\n  </page>\n")


def write_dump(path: str, articles: int, seed: int = 0, copies: int = 0, extra_text: Optional[str] = None) -> None:
    """A MediaWiki dump of `articles` synthetic articles, `copies` of which are repeated under
    another title (duplicates for the dedup stage), plus a redirect and a talk page;
    extra_text, when given, is in the middle of one more article. bz2-compressed when path ends in .bz2."""
    rng = random.Random(seed)
    pages = [wiki_page(rng, f"Place {k}", k + 1) for k in range(articles)]
    pages += [p.replace(f"<title>Place {k}</title>", f"<title>Place {k} (copy)</title>")
              .replace(f"<id>{k + 1}</id>", f"<id>{articles + k + 1}</id>") for k, p in enumerate(pages[:copies])]
    if extra_text is not None:
        pages.append(f"  <page>\n    <title>Extra</title>\n    <ns>0</ns>\n    <id>{2 * articles + 10}</id>\n"
                     f"    <revision><text>{escape(paragraph(rng) + ' ' + extra_text + ' ' + paragraph(rng))}</text>"
                     "</revision>\n  </page>\n")
    pages.append("  <page>\n    <title>Place</title>\n    <ns>0</ns>\n    <id>999999</id>\n"
                 "    <redirect title=\"Place 0\" />\n"
                 "    <revision><text>#REDIRECT [[Place 0]]</text></revision>\n  </page>\n")
    pages.append("  <page>\n    <title>Talk:Place 0</title>\n    <ns>1</ns>\n    <id>999998</id>\n"
                 "    <revision><text>Is this right?</text></revision>\n  </page>\n")
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">\n'
           "  <siteinfo>\n    <sitename>Wikipedia</sitename>\n    <base>https://en.wikipedia.org/wiki/Main_Page</base>\n"
           "  </siteinfo>\n" + "".join(pages) + "</mediawiki>\n").encode("utf-8")
    with atomic_output(path) as f:
        f.write(bz2.compress(xml) if path.endswith(".bz2") else xml)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump")
    dump.add_argument("--output", required=True)
    dump.add_argument("--articles", type=int, default=200)
    dump.add_argument("--copies", type=int, default=0, help="Articles repeated under another title")
    dump.add_argument("--extra-text", default=None, help="The text of one more article")
    dump.add_argument("--seed", type=int, default=0)
    corpus = sub.add_parser("corpus")
    corpus.add_argument("--output", required=True)
    corpus.add_argument("--documents", type=int, default=1000)
    corpus.add_argument("--pairs", type=int, default=0)
    corpus.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "dump":
        write_dump(args.output, args.articles, args.seed, args.copies, args.extra_text)
    else:
        write_corpus(args.output, args.documents, args.pairs, args.seed)


if __name__ == "__main__":
    main()
