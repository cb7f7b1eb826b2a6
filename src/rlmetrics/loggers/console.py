"""ConsoleLogger: a rich table per logged step, metrics grouped by prefix."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import groupby
from typing import Any

from rlmetrics.loggers.base import FailureReporter, as_float, missing_extra


def prefix_of(name: str) -> str:
    """The group of a metric: the part before the first "/" ("" when there is none)."""
    head, sep, _ = name.partition("/")
    return head if sep else ""


class ConsoleLogger:
    """Prints every ``every``-th step (``step % every == 0``) as a rich table.

    Rows are grouped by prefix (``actor/pg_loss`` is in group ``actor``), one table
    section per group, metrics without a prefix first.

    Args:
        every: print steps that are multiples of this.
        console: a ``rich.console.Console`` (default: a new one on stdout).
        digits: significant digits shown.
    """

    name = "console"

    def __init__(self, *, every: int = 1, console: Any = None, digits: int = 6) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"ConsoleLogger(every=...) must be an int >= 1, got {every!r}")
        try:
            from rich.console import Console
        except ImportError as err:
            raise missing_extra("console", "rich", "console", err) from err
        self.every = every
        self.digits = digits
        self.console = console if console is not None else Console()
        self._failures = FailureReporter(self.name)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Print the step's table (when ``step`` is a multiple of ``every``)."""
        if step % self.every:
            return
        with self._failures.guard("print"):
            self.console.print(self.table(step, metrics))

    def table(self, step: int, metrics: Mapping[str, float]) -> Any:
        """The rich Table for one step."""
        from rich.table import Table

        table = Table(title=f"step {step}", title_justify="left")
        table.add_column("group", style="bold cyan")
        table.add_column("metric")
        table.add_column("value", justify="right")
        names = sorted(metrics, key=lambda n: (prefix_of(n), n))
        for index, (group, members) in enumerate(groupby(names, key=prefix_of)):
            if index:
                table.add_section()
            for row, name in enumerate(members):
                short = name[len(group) + 1 :] if group else name
                table.add_row(group if row == 0 else "", short, self.format(metrics[name]))
        return table

    def format(self, value: Any) -> str:
        """A value with ``digits`` significant digits."""
        try:
            return f"{as_float(value):.{self.digits}g}"
        except (TypeError, ValueError):
            return repr(value)

    def close(self) -> None:
        """Nothing to release."""
