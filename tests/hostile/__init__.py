"""The hostile-input suite: bad input to every public operation of impl/.

The promise: a bad argument to a public operation gets a typed error (a ``ValueError`` or
``LookupError`` subclass) whose message names the value, and leaves everything a caller can
observe exactly as it was, in the compiled and the pure-Python build, with and without
``python -O``. The exceptions are few and each is written down in docs/hostile-input.md:
values vLLM's own callers pass and rely on being accepted.

How a component is checked (tests/hostile/test_*.py):

* a Hypothesis strategy of *subjects*: the object in an interesting state (a pool with blocks
  in use, cached, free, shared; a manager with running requests; a block table with rows);
* a *snapshot* of the subject: everything a caller can observe (ref counts, the free order,
  the prefix-cache map, pending events, tables, the device copy of a block table...);
* per public operation, a strategy of ``BadCall``s: wrong types, out-of-range and negative
  values, duplicates within one call, blocks of another pool, freed blocks, iterators that
  raise halfway, empty and enormous sizes (tests/hostile/values.py has the shared ones);
* ``check`` runs one call on one subject and fails, with the call as the counterexample,
  unless the verdict is one the promise allows.

``KVSPEC_HOSTILE_RECORD=path`` makes every judged call append its verdict and error to a JSON
lines file; test_builds_agree.py runs the suite in both builds, derandomized, and compares.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import event, note

__all__ = ["BadCall", "Verdict", "check", "judge", "names_value"]


@dataclass(frozen=True)
class BadCall:
    """One bad call on a subject.

    ``describe`` is the call as a user would write it (the counterexample), ``run`` makes it,
    ``bad`` is the offending value, which the error message must name (its ``repr`` or
    ``str``; ``named`` overrides what counts as naming it). ``propagates`` is set for a call
    whose own argument raises (an iterator failing halfway): that exception must come
    through unchanged, and the state too. ``accepted`` is set, with the reason, for a value
    vLLM's callers rely on being accepted (docs/hostile-input.md lists each).
    """

    describe: str
    run: Callable[[Any], object]
    bad: object = None
    named: tuple[str, ...] = ()
    propagates: type[BaseException] | None = None
    accepted: str = ""
    operation: str = field(default="", compare=False)


class Verdict(enum.Enum):
    REFUSED = "refused: typed, named, nothing changed"
    PROPAGATED = "the caller's own exception came through, nothing changed"
    ACCEPTED = "accepted, as documented"
    UNTYPED = "an error that is neither a ValueError nor a LookupError"
    UNNAMED = "a typed error whose message does not name the value"
    CHANGED = "refused, but the state changed"
    SILENT = "accepted without a word"


ALLOWED = {Verdict.REFUSED, Verdict.PROPAGATED, Verdict.ACCEPTED}


def names_value(message: str, call: BadCall) -> bool:
    """Whether ``message`` names the bad value (``repr`` or ``str``, or a ``named`` form)."""
    forms = call.named or _forms(call.bad)
    return any(form and form in message for form in forms)


def _forms(value: object) -> tuple[str, ...]:
    forms = [repr(value), str(value)]
    if isinstance(value, float) and value != value:  # nan
        forms.append("nan")
    return tuple(dict.fromkeys(forms))


def judge(subject: Any, snapshot: Callable[[Any], object], call: BadCall) -> tuple[Verdict, str]:
    """Run ``call`` on ``subject`` and say what happened, with the detail for a report."""
    before = snapshot(subject)
    try:
        call.run(subject)
    except BaseException as error:
        after = _readable(snapshot, subject)
        detail = f"{type(error).__module__}.{type(error).__qualname__}: {error}"
        if call.propagates is not None and isinstance(error, call.propagates):
            return (Verdict.PROPAGATED if after == before else Verdict.CHANGED), detail
        if not isinstance(error, ValueError | LookupError):
            return Verdict.UNTYPED, detail
        if after != before:
            return Verdict.CHANGED, f"{detail}\nbefore: {before!r}\nafter:  {after!r}"
        if not names_value(str(error), call):
            return Verdict.UNNAMED, detail
        return Verdict.REFUSED, detail
    if call.accepted:
        return Verdict.ACCEPTED, call.accepted
    return Verdict.SILENT, "no error"


def _readable(snapshot: Callable[[Any], object], subject: Any) -> object:
    """The snapshot, or what stopped it: a refusal that corrupted the state may leave it
    unreadable, which is a change like any other."""
    try:
        return snapshot(subject)
    except Exception as error:
        return f"<the state cannot be read any more: {type(error).__name__}: {error}>"


def check(subject: Any, snapshot: Callable[[Any], object], call: BadCall) -> None:
    """Judge one call; fail with the call as the counterexample unless its verdict is allowed."""
    note(call.describe)
    verdict, detail = judge(subject, snapshot, call)
    event(f"verdict: {verdict.name.lower()}")
    if call.operation:
        event(f"operation: {call.operation}")
    _record(call, verdict, detail)
    if verdict not in ALLOWED:  # not an assert: the suite also runs under python -O
        raise AssertionError(f"{call.describe}\n  {verdict.value}\n  {detail}")


def _record(call: BadCall, verdict: Verdict, detail: str) -> None:
    path = os.environ.get("KVSPEC_HOSTILE_RECORD")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps({"call": call.describe, "verdict": verdict.name,
                              "error": detail.split(":", 1)[0]}) + "\n")
