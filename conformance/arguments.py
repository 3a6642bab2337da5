"""Argument types shared by the ``kvspec`` commands: each refuses a bad value with a message
that names the option's meaning and the value given (argparse prints it, exit 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def positive_seconds(what: str = "seconds") -> Callable[[str], float]:
    """A finite number of seconds > 0, e.g. ``--budget``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what} must be a number of seconds, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {text!r}")
        return value
    return parse


def whole_number(minimum: int, what: str = "count") -> Callable[[str], int]:
    """An int >= minimum, e.g. ``--workers`` (0 allowed) or ``--batches`` (1 at least)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what} must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be >= {minimum}, got {text!r}")
        return value
    return parse
