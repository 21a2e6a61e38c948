"""tools/data_collection/wikitext.py, construct by construct: what WikiExtractor keeps of each."""
import pytest

from tools.data_collection.wikitext import clean_wikitext

CASES = [
    ("'''Paris''' is the [[capital city|capital]] of [[France]].<ref>x</ref>", "Paris is the capital of France."),
    ("A {{outer|x={{inner|y}}|z}} b.", "A b."),
    ("A [[File:x.jpg|thumb|caption with [[a link]] and [[b|c]]]] b.", "A b."),
    ("[[Category:Things|sort]][[de:Ding]][[simple:Thing]]Text.", "Text."),
    ("[[:Category:Things]] and [[wikt:cat|cat]] and [[Paris (France)|]].", "Category:Things and cat and Paris."),
    ("[[cat]]s and [[Foo#Bar|bar]].", "cats and bar."),
    ("x<ref name=a>{{cite|q}}</ref>y<ref name=a/>z<references/>", "xyz"),
    ("A<!-- hidden\nmulti-line -->B", "AB"),
    ("Before\n{|\n|-\n| {{t}} || [[x]]\n{|\n| nested\n|}\n|}\nAfter", "Before\nAfter"),
    ("[http://a.org label text] [http://b.org] [//c.org x]", "label text x"),
    ("== A ==\n=== B ===\n== C ==\ntext", "C.\ntext"),
    ("== Why? ==\ntext", "Why?\ntext"),
    ("* one\n** two\n# three\n; term\n: def", "one\ntwo\nthree\nterm\ndef"),
    ("<math>x^2</math>Formula<gallery>a.jpg</gallery>.", "Formula."),
    ("a&amp;b &lt;c&gt; d&nbsp;e", "a&b <c> d e"),
    ("<small>small</small> <span style='x'>span</span><br/>next", "small span next"),
    ("Born ({{birth date|1900|1|1}}) in X.", "Born in X."),
    ("Text {{unclosed template\nand more", "Text"),
    ("Stray }} and ]] stay harmless.", "Stray and ]] stay harmless."),
    ("<nowiki>[[not a link]]</nowiki>", "[[not a link]]"),
    ("__NOTOC__\n----\nOnly this.", "Only this."),
]


@pytest.mark.parametrize("wikitext,text", CASES)
def test_construct(wikitext, text):
    assert clean_wikitext(wikitext) == text


def test_deep_nesting_does_not_recurse():
    assert clean_wikitext("{{" * 50000 + "}}" * 50000 + "ok") == "ok"
    assert clean_wikitext("[[" * 50000 + "x" + "]]" * 50000) == "x"
