"""Writing one benchmark's section of benchmarks/RESULTS.md, keeping every other one, and
the machine line each section starts with."""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(text: str, start: str, end: str) -> None:
    """Replace the section between the ``start`` and ``end`` markers (or append it)."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(old):
        new = pattern.sub(lambda _: text, old)
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    RESULTS.write_text(new)


def load() -> str:
    """The 1, 5 and 15 minute load averages (the machine may be shared)."""
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def machine(detail: str, loads: tuple[str, str]) -> str:
    """One line describing where the numbers come from: the machine, Python and torch,
    ``detail`` (the benchmark's other versions and settings), and the load averages
    before and after the run."""
    return (
        f"{os.cpu_count()} CPUs (nproc), {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, {detail}, "
        f"load average (1, 5, 15 min) {loads[0]} before, {loads[1]} after, "
        f"{datetime.date.today().isoformat()}"
    )
