"""The argparse types of the command line's numeric flags: each checks its text with
the range check every numeric config field uses (``trainer.config.number_need``), so a
bad value is a usage error naming the flag. A leaf module, so that ``cli`` and
``cli.audit`` share them without importing each other."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any


def number_flag(
    kind: type, low: float = -math.inf, high: float = math.inf, *, open_low: bool = False
) -> Callable[[str], Any]:
    """An argparse ``type=`` for a numeric flag: the text as ``kind`` (int or float),
    finite and in its range (``rlmetrics.trainer.config.number_need``, the check of
    every numeric config field), else a usage error naming the flag, exit 2:
    ``argument --tol: must be a finite number > 0, got 'nan'``."""
    from rlmetrics.trainer.config import number_need

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError, OverflowError):
            value = None
        need = number_need(value, low, high, open_low=open_low, integer=kind is int)
        if need is not None:
            raise argparse.ArgumentTypeError(f"must be {need}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def number_list_flag(
    kind: type, low: float = -math.inf, high: float = math.inf, *, open_low: bool = False
) -> Callable[[str], list[Any]]:
    """``number_flag`` for a comma-separated list: ``"1,2,4"`` -> ``[1, 2, 4]``, each
    item checked alike (``""`` is the empty list)."""
    item = number_flag(kind, low, high, open_low=open_low)

    def parse(text: str) -> list[Any]:
        try:
            return [item(x.strip()) for x in text.split(",") if x.strip()]
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"each item {err}, in {text!r}") from None

    parse.__name__ = f"{kind.__name__} list"
    return parse
