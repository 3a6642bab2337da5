"""The argument checks that impl's public methods share, in one place.

A public method of impl checks its arguments in one block at its top, with these helpers, and
raises its layer's typed error (impl/errors.py) naming the value, before anything changes.

The rule for integers, the same across impl/ (docs/hostile-input.md): an integer argument is a
Python ``int`` or a NumPy integer scalar (``np.integer``), never a ``bool`` or a float. It is
converted to a plain ``int`` once, in the check block. Public parameters that take integers are
annotated ``SupportsIndex``: mypyc does not check that annotation at the call (it would raise a
bare ``TypeError`` for an ``int`` one), so the method's own check runs in both builds.
"""

from __future__ import annotations

import numpy as np


def as_int(value: object) -> int | None:
    """``value`` as an int when it is an integer (a Python or numpy one, never a bool)."""
    if type(value) is int:
        return value
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return int(value)
    return None
