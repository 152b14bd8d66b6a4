"""Markdown building blocks for the reports: escaped text and tables."""

from __future__ import annotations


def md_escape(text: str) -> str:
    """Text shown as it is by a Markdown renderer: HTML and code-span characters escaped, one line.

    Node and output names are the model's, and may hold ``<b>``, ``&amp;``, backticks or newlines.
    """
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("`", "\\`").replace("\r", " ").replace("\n", " ")


def md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A GitHub-flavoured Markdown table as lines (cells escaped, ``|`` too), followed by an empty line."""

    def cell(x: str) -> str:
        return md_escape(x).replace("|", "\\|")

    out = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return out + [""]
