"""A deliberately broken eviction-policy plug-in, for ``kvspec audit --policy priority``.

It claims ``priority`` and gets one thing wrong that a real patch could: an expired priority
never reverts (``advance_clock`` is not overridden by its own bookkeeping). The audit must
catch it (tests/test_audit_policy.py); docs/policies.md shows the command.
"""

from __future__ import annotations

from kvspec.impl.eviction import PriorityPolicy


class ForgetfulPriorityPolicy(PriorityPolicy):
    """Priority eviction whose expiries never fire."""

    def advance_clock(self, now: int) -> None:
        return None  # the bug: expired priorities are still used
