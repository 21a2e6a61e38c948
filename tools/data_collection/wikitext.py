"""Wikitext to plain text, as WikiExtractor (with --json, no template expansion) makes it.

    clean_wikitext("'''Paris''' is the [[capital city|capital]] of [[France]].<ref>x</ref>")
    -> "Paris is the capital of France."

What goes, in this order:
  * comments `<!-- -->`, `<ref>` (both forms), `<references/>` and the content of tags that
    carry no prose (gallery, math, timeline, imagemap, score, syntaxhighlight, source, pre);
  * templates and infoboxes `{{...}}` and tables `{| ... |}`, nested to any depth;
  * links `[[File:...]]`, `[[Image:...]]`, `[[Category:...]]` and interlanguage links whole
    (their captions hold links of their own); other links become their text:
    `[[a|b]]` -> b, `[[a]]s` -> as, `[[a (b)|]]` -> a, `[[:Category:x]]` -> Category:x;
  * external links `[http://x label]` -> label (none without one); bold and italic quotes;
    other HTML tags (their content stays); HTML entities are decoded; magic words (`__TOC__`).
What stays, one line each: a paragraph; a list item (`*`, `#`, `:` and `;` markers dropped); a
heading, as its text with a full stop added unless it ends in punctuation, and only when some
text follows in its section (WikiExtractor's --sections rule). Spaces are collapsed.

Pure string work with no recursion on the input (a scanner with a depth count), so a hostile
page cannot exhaust the stack, and the cost is linear in the page's length.
"""

from __future__ import annotations

import html
import re
from typing import List

# Namespaces whose links are dropped whole (English names and the canonical aliases).
DROPPED_LINK_NAMESPACES = {"file", "image", "category", "media"}
# Interlanguage prefixes are language codes: 2-3 letters, or forms like "zh-min-nan", and a few
# longer ones. (Other interwiki links, e.g. [[wikt:word|word]], show their label as MediaWiki does.)
_INTERWIKI = re.compile(r"^([a-z]{2,3}(-[a-z]+)*|simple|be-tarask|map-bms|nds-nl|roa-rup|bat-smg|fiu-vro)$")
_DROPPED_TAGS = ("ref", "references", "gallery", "math", "timeline", "imagemap", "score", "syntaxhighlight",
                 "source", "pre", "chem", "ce", "graph", "mapframe", "templatedata")

_COMMENT = re.compile(r"<!--.*?(-->|\Z)", re.S)
_SELF_CLOSING = re.compile(r"<(%s)\b[^>]*/>" % "|".join(_DROPPED_TAGS), re.I)
_DROPPED_ELEMENT = re.compile(r"<(%s)\b[^>]*>.*?(</\1\s*>|\Z)" % "|".join(_DROPPED_TAGS), re.I | re.S)
_NOWIKI = re.compile(r"<nowiki\s*>(.*?)</nowiki\s*>", re.I | re.S)
_NOWIKI_ESCAPES = {ord(c): f"&#{ord(c)};" for c in "[]{}|'<>&=*#:;_"}
_BR = re.compile(r"<br\s*/?>", re.I)
_ANY_TAG = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*\b[^<>]*/?>")
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:|//)[^\s\]]*(?:\s+([^\]]*))?\]", re.I)
_BOLD_ITALIC = re.compile(r"'{2,5}")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_HEADING = re.compile(r"^(={1,6})\s*(.+?)\s*\1\s*$")
_LIST_MARKER = re.compile(r"^[*#:;]+\s*")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:]?\s*\)")
_SPACES = re.compile(r"[ \t\u00a0]+")
_SPACE_BEFORE_PUNCT = re.compile(r" +([,.;:!?])")
# Openers and closers of the nested constructs: templates, tables (at a line start), links.
_BRACES = re.compile(r"\{\{|\}\}|(?m:^[ \t]*\{\|)|(?m:^[ \t]*\|\})")
_BRACKETS = re.compile(r"\[\[|\]\]")


def _drop_nested(text: str) -> str:
    """Text with every template `{{...}}` and table `{|...|}` removed, nested ones included; an
    unclosed opener drops the rest of the page (as MediaWiki shows it broken), a stray closer is
    dropped."""
    out: List[str] = []
    depth, last = 0, 0
    for match in _BRACES.finditer(text):
        token = match.group().strip()
        if token in ("{{", "{|"):
            if depth == 0:
                out.append(text[last:match.start()])
            depth += 1
        else:
            if depth == 0:
                out.append(text[last:match.start()])
            else:
                depth -= 1
            last = match.end()
    if depth == 0:
        out.append(text[last:])
    return "".join(out)


def _link_text(inner: str) -> str:
    """The visible text of a link whose inside (between [[ and ]], nested links already
    replaced) is `inner`; "" for files, categories and interlanguage links."""
    target, bar, label = inner.partition("|")
    target = target.strip()
    leading_colon = target.startswith(":")
    if leading_colon:
        target = target[1:].strip()
    prefix, colon, _ = target.partition(":")
    prefix = prefix.strip().lower()
    if colon and not leading_colon and (prefix in DROPPED_LINK_NAMESPACES or _INTERWIKI.match(prefix)):
        return ""
    if bar:
        label = label.strip()
        if label:
            return label.rsplit("|", 1)[-1].strip() if "|" in label else label
        return re.sub(r"\s*\(.*\)\s*$", "", target.rpartition(":")[2] if colon else target)  # pipe trick
    return target


def _replace_links(text: str) -> str:
    """Every `[[...]]` replaced by its visible text, innermost first, with a stack of openers."""
    out: List[str] = []  # pieces of the text outside any link, and the replaced links
    stack: List[List[str]] = []  # the pieces of each open link
    last = 0
    for match in _BRACKETS.finditer(text):
        piece = text[last:match.start()]
        (stack[-1] if stack else out).append(piece)
        last = match.end()
        if match.group() == "[[":
            stack.append([])
        elif stack:
            visible = _link_text("".join(stack.pop()))
            (stack[-1] if stack else out).append(visible)
        else:
            out.append("]]")
    tail = text[last:]
    while stack:  # unclosed links: keep their text as written
        tail = "[[" + "".join(stack.pop()) + tail
    out.append(tail)
    return "".join(out)


def _inline(text: str) -> str:
    text = text.replace("{{!}}", "|")  # the escaped pipe, before templates go
    text = _drop_nested(text)
    text = _replace_links(text)
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1) or "", text)
    text = _BOLD_ITALIC.sub("", text)
    text = _MAGIC_WORD.sub("", text)
    text = _BR.sub(" ", text)
    text = _ANY_TAG.sub("", text)
    return html.unescape(text)


def clean_wikitext(wikitext: str) -> str:
    """The plain text of one page's wikitext (see the module docstring); "" when nothing is left."""
    text = _COMMENT.sub("", wikitext)
    text = _SELF_CLOSING.sub("", text)
    text = _DROPPED_ELEMENT.sub("", text)
    # <nowiki> content is literal: its markup characters become entities, decoded at the end.
    text = _NOWIKI.sub(lambda m: m.group(1).translate(_NOWIKI_ESCAPES), text)
    text = _inline(text)
    lines: List[str] = []
    pending_headings: List[str] = []
    for line in text.split("\n"):
        heading = _HEADING.match(line.strip())
        if heading:
            level = len(heading.group(1))
            title = _tidy(heading.group(2))
            # A heading replaces pending ones of its level and below (their sections were empty).
            pending_headings = [h for h in pending_headings if h[0] < level]
            if title:
                pending_headings.append((level, title if title[-1] in ".!?:;" else title + "."))
            continue
        if line.strip() == "----":
            continue
        line = _tidy(_LIST_MARKER.sub("", line.strip()))
        if not line:
            continue
        lines.extend(title for _, title in pending_headings)
        pending_headings = []
        lines.append(line)
    return "\n".join(lines)


def _tidy(line: str) -> str:
    line = _EMPTY_PARENS.sub("", line)
    line = _SPACES.sub(" ", line).strip()
    return _SPACE_BEFORE_PUNCT.sub(r"\1", line)
