"""An MkDocs hook (mkdocs.yml `hooks:`): a name in a table cell (`trainer.batch_prompts`,
`STEADYRL_TRAINER_CHECKPOINT__EVERY`) may wrap after a `.` or a `_` and nowhere else (docs/stylesheets/extra.css
keeps the browser from breaking it inside a word), so a reference table fits the page without cutting a name in
two mid-word. It marks those places with `<wbr>` in the finished page (the search index is made before), in every
cell but a row's first, whose name stays on one line."""

from __future__ import annotations

import re

ROW = re.compile(r"<tr\b[^>]*>.*?</tr>", re.S)
CELL = re.compile(r"<td\b[^>]*>.*?</td>", re.S)
CODE = re.compile(r"(<code\b[^>]*>)([^<]*)(</code>)")
AFTER_SEPARATOR = re.compile(r"(?<=\S[._])(?=[A-Za-z])")  # after `.`, `_` or `__`, before the next word


def breakable(cell: re.Match) -> str:
    return CODE.sub(lambda code: code[1] + AFTER_SEPARATOR.sub("<wbr>", code[2]) + code[3], cell[0])


def row(match: re.Match) -> str:
    first = CELL.search(match[0])
    if first is None:  # a header row
        return match[0]
    return match[0][: first.end()] + CELL.sub(breakable, match[0][first.end() :])


def on_post_page(output: str, page, config) -> str:
    return ROW.sub(row, output)
