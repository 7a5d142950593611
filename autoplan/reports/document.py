"""A small document model (sections of paragraphs, tables, preformatted text and figures) and
its two renderings: one self-contained HTML file (figures as base64 PNG ``data:`` URIs, inline
CSS, no scripts, no external resources) and Markdown with the figures as PNG files beside it.

Both renderings walk the same blocks, so the two files say the same things."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Text:
    text: str


@dataclass
class Pre:
    text: str


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    caption: str = ""
    collapsed: bool = False  # HTML: inside a <details> element, closed


@dataclass
class Figure:
    name: str  # file stem of the PNG beside the Markdown, e.g. "report_memory"
    png: bytes
    caption: str


Block = Text | Pre | Table | Figure


@dataclass
class Section:
    title: str
    blocks: list[Block] = field(default_factory=list)


@dataclass
class Document:
    title: str
    sections: list[Section]

    def figures(self) -> list[Figure]:
        return [b for s in self.sections for b in s.blocks if isinstance(b, Figure)]


CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1100px;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #4c72b0; padding-bottom: .2em; }
h2 { margin-top: 1.8em; border-bottom: 1px solid #ddd; padding-bottom: .15em; }
table { border-collapse: collapse; margin: .6em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f0f3f8; }
tr:nth-child(even) td { background: #fafafa; }
td code, p code { font-family: Menlo, Consolas, monospace; font-size: .95em; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: .9em; }
pre { background: #f6f8fa; padding: .8em; overflow-x: auto; font-size: .85em; }
details summary { cursor: pointer; color: #4c72b0; margin: .4em 0; }
.caption { color: #555; font-size: .9em; margin-bottom: .2em; }
"""


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _html_table(t: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.header)
    thead = f"<thead><tr>{head}</tr></thead>\n" if any(t.header) else ""  # key/value tables have none
    body = "\n".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in t.rows)
    table = f"<table>\n{thead}<tbody>\n{body}\n</tbody>\n</table>"
    if t.collapsed:
        label = html.escape(t.caption or "table") + f" ({len(t.rows)} rows)"
        return f"<details><summary>{label}</summary>\n{table}\n</details>"
    caption = f'<div class="caption">{html.escape(t.caption)}</div>\n' if t.caption else ""
    return caption + table


def _html_block(block: Block) -> str:
    if isinstance(block, Text):
        return f"<p>{html.escape(block.text)}</p>"
    if isinstance(block, Pre):
        return f"<pre>{html.escape(block.text)}</pre>"
    if isinstance(block, Table):
        return _html_table(block)
    return (f'<figure><img alt="{html.escape(block.caption)}" src="{data_uri(block.png)}">'
            f"<figcaption>{html.escape(block.caption)}</figcaption></figure>")


def render_html(doc: Document) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             f"<title>{html.escape(doc.title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
             f"<h1>{html.escape(doc.title)}</h1>"]
    for section in doc.sections:
        parts.append(f"<h2>{html.escape(section.title)}</h2>")
        parts += [_html_block(b) for b in section.blocks]
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"


def _md_cell(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _md_table(t: Table) -> str:
    lines = []
    if t.caption:
        lines.append(f"*{t.caption}*" + (f" ({len(t.rows)} rows)" if t.collapsed else ""))
        lines.append("")
    lines.append("| " + " | ".join(_md_cell(h) for h in t.header) + " |")
    lines.append("|" + "|".join("---" for _ in t.header) + "|")
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in t.rows]
    return "\n".join(lines)


def _md_block(block: Block) -> str:
    if isinstance(block, Text):
        return block.text
    if isinstance(block, Pre):
        return "```\n" + block.text + "\n```"
    if isinstance(block, Table):
        return _md_table(block)
    return f"![{block.caption}]({block.name}.png)\n\n*{block.caption}*"


def render_markdown(doc: Document) -> str:
    parts = [f"# {doc.title}"]
    for section in doc.sections:
        parts.append(f"## {section.title}")
        parts += [_md_block(b) for b in section.blocks]
    return "\n\n".join(parts) + "\n"


def write_document(doc: Document, folder: Path, stem: str = "report") -> list[Path]:
    """Write ``<stem>.html``, ``<stem>.md`` and the Markdown's PNG files into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for fig in doc.figures():
        path = folder / f"{fig.name}.png"
        path.write_bytes(fig.png)
        written.append(path)
    html_path, md_path = folder / f"{stem}.html", folder / f"{stem}.md"
    html_path.write_text(render_html(doc), encoding="utf-8")
    md_path.write_text(render_markdown(doc), encoding="utf-8")
    return [html_path, md_path, *written]
