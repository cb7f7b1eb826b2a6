"""A mkdocs hook: a docstring example that renders as a quote fails the build.

mkdocstrings renders the ``>>>`` lines of a Google-style ``Examples:`` section as a code
block. Anywhere else (an ``Example:`` admonition, a plain paragraph) they are markdown:
``>>> t = Tracker()`` becomes three nested quotes and the example's lines run together
into one paragraph. A line of prose that starts with ``>`` turns into a quote the same
way. The site uses no quotes, so this hook reports every quote, and every ``>>>`` left
outside a code block, on every page. ``mkdocs build --strict`` (``make docs``) turns the
warnings into a failed build.
"""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger(__name__)

HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}


class _QuoteFinder(HTMLParser):
    """Records each outermost quote and each ``>>>`` outside code, under its heading."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.in_code = 0  # <pre>/<code> elements open around the current text
        self.in_quote = 0  # <blockquote> elements open
        self.heading = "the top"  # the id of the last heading seen
        self.problems: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in HEADINGS:
            self.heading = "#" + (dict(attrs).get("id") or "?")
        elif tag in ("pre", "code"):
            self.in_code += 1
        elif tag == "blockquote":
            if not self.in_quote:
                self.problems.append(f"a quote under {self.heading}")
            self.in_quote += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("pre", "code"):
            self.in_code = max(0, self.in_code - 1)
        elif tag == "blockquote":
            self.in_quote = max(0, self.in_quote - 1)

    def handle_data(self, data: str) -> None:
        if not self.in_code and ">>>" in data:
            self.problems.append(f"'>>>' outside a code block under {self.heading}")


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    """Warn once per quote or stray ``>>>`` in the page's rendered HTML."""
    finder = _QuoteFinder()
    finder.feed(html)
    for problem in finder.problems:
        log.warning(
            f"{page.file.src_uri}: {problem}. A docstring example belongs in an "
            "'Examples:' section (not 'Example:'); a line of prose must not start with '>'."
        )
    return html
