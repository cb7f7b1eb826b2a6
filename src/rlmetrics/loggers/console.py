"""ConsoleLogger: a table per logged step, metrics grouped by prefix.

With rich installed (``rlmetrics[console]``) the table is a rich Table; without it, the
same rows print as plain text, so a plain ``pip install rlmetrics`` runs the demo.
Metric names are shown literally: ``acc[top1]`` is not rich markup.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from itertools import groupby
from typing import Any, TextIO

from rlmetrics._optional import available
from rlmetrics.loggers._text_table import format_table
from rlmetrics.loggers.base import FailureReporter, as_float, missing_extra


def prefix_of(name: str) -> str:
    """The group of a metric: the part before the first "/" ("" when there is none)."""
    head, sep, _ = name.partition("/")
    return head if sep else ""


class ConsoleLogger:
    """Prints every ``every``-th step (``step % every == 0``) as a table.

    Rows are grouped by prefix (``actor/pg_loss`` is in group ``actor``), one table
    section per group, metrics without a prefix first.

    Args:
        every: print steps that are multiples of this.
        console: a ``rich.console.Console`` (default: a new one on ``file``).
        digits: significant digits shown.
        plain: print plain text instead of a rich table (default: only when rich is
            not installed).
        file: where plain text (or the default rich console) goes (default: stdout).
    """

    name = "console"

    def __init__(
        self,
        *,
        every: int = 1,
        console: Any = None,
        digits: int = 6,
        plain: bool | None = None,
        file: TextIO | None = None,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"ConsoleLogger(every=...) must be an int >= 1, got {every!r}")
        if plain and console is not None:
            raise ValueError("ConsoleLogger: plain=True prints to file=, not to a rich console")
        self.every = every
        self.digits = digits
        self.plain = (console is None and not available("rich")) if plain is None else plain
        self.file = file
        self.console: Any = None  # a rich Console (plain=False)
        if not self.plain:
            try:
                from rich.console import Console
            except ImportError as err:  # plain=False asked for rich
                raise missing_extra("console", "rich", "console", err) from err
            self.console = console if console is not None else Console(file=file)
        self._failures = FailureReporter(self.name)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Print the step's table (when ``step`` is a multiple of ``every``)."""
        if step % self.every:
            return
        with self._failures.guard("print"):
            if self.plain:
                print(self.text(step, metrics), file=self.file or sys.stdout, flush=True)
            else:
                self.console.print(self.table(step, metrics))

    def rows(self, metrics: Mapping[str, float]) -> Iterator[tuple[str, str, str, bool]]:
        """(group, short name, value, first of its group) per metric, grouped by prefix."""
        names = sorted(metrics, key=lambda n: (prefix_of(n), n))
        for group, members in groupby(names, key=prefix_of):
            for row, name in enumerate(members):
                short = name[len(group) + 1 :] if group else name
                yield group if row == 0 else "", short, self.format(metrics[name]), row == 0

    def table(self, step: int, metrics: Mapping[str, float]) -> Any:
        """The rich Table for one step (names as plain Text: never parsed as markup)."""
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"step {step}", title_justify="left")
        table.add_column("group", style="bold cyan")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for index, (group, short, value, first) in enumerate(self.rows(metrics)):
            if first and index:
                table.add_section()
            table.add_row(Text(group), Text(short), Text(value))
        return table

    def text(self, step: int, metrics: Mapping[str, float]) -> str:
        """The plain-text table for one step (no rich)."""
        rows = [(g, n, v) for g, n, v, _ in self.rows(metrics)]
        return format_table(f"step {step}", ("group", "metric", "value"), rows, right=(2,))

    def format(self, value: Any) -> str:
        """A value with ``digits`` significant digits."""
        try:
            return f"{as_float(value):.{self.digits}g}"
        except (TypeError, ValueError):
            return repr(value)

    def close(self) -> None:
        """Nothing to release; the failures not reported one by one are counted."""
        self._failures.report_dropped()
