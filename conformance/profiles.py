"""Hypothesis profiles shared by the test suite, the mutant runner and `kvspec audit`.

- ``dev`` (default): quick local runs.
- ``ci`` (chosen when ``CI=true``): derandomized, no deadline, sized so that every mutant in
  the catalogue dies.
- ``mutants``: the one profile ``python -m tests.mutants`` runs every mutant under, whoever
  runs it: derandomized, no example database, no shrinking (a kill needs one failure, not the
  smallest one), sized so that every mutant in the catalogue dies. ``ci-mutants`` is an alias.
- ``nightly``: large and randomized.

``KVSPEC_PROFILE`` overrides the choice. ``load_profile(database)`` gives the chosen profile
(but the mutant runner's) an example database it is handed: the test suite, ``kvspec audit``
and a campaign's shards hand it the shared one ``KVSPEC_HYPOTHESIS_DATABASE=redis://HOST:PORT/DB``
names (opened by `kvspec.campaign.redis_db.environment_database`), so that pytest runs of the
machines and HypoFuzz workers (docs/campaign.md) share their failures.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import ExampleDatabase

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile(
    "dev", max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "ci", max_examples=300, stateful_step_count=50, deadline=None, derandomize=True,
    database=None, print_blob=True, suppress_health_check=_SLOW_OK,
)
# The mutant runner's one profile (tests/mutants/__main__.py sets it in every checker, ignoring
# CI and KVSPEC_PROFILE): the ci profile's sizes, derandomized and without an example database
# so a verdict depends on nothing but the code, and without shrinking (a kill needs one
# failure, not the smallest one), so the whole catalogue runs in minutes.
MUTANTS_PROFILE = "mutants"
settings.register_profile(
    MUTANTS_PROFILE, settings.get_profile("ci"), derandomize=True, database=None,
    print_blob=False, phases=[Phase.explicit, Phase.generate],
)
settings.register_profile("ci-mutants", settings.get_profile(MUTANTS_PROFILE))  # the old name
settings.register_profile(
    "nightly", max_examples=5000, stateful_step_count=100, deadline=None,
    suppress_health_check=_SLOW_OK,
)


def profile_name() -> str:
    """The profile this process should run under."""
    explicit = os.environ.get("KVSPEC_PROFILE")
    if explicit:
        return explicit
    return "ci" if os.environ.get("CI", "").lower() == "true" else "dev"


def load_profile(database: ExampleDatabase | None = None) -> str:
    """Load the profile chosen by the environment and return its name; with ``database``,
    the profile uses that example database (never the mutant runner's profile, whose verdicts
    depend on nothing but the code)."""
    name = profile_name()
    if database is not None and name not in (MUTANTS_PROFILE, "ci-mutants"):
        settings.register_profile(f"{name}-shared", settings.get_profile(name),
                                  database=database)
        settings.load_profile(f"{name}-shared")
        return name
    settings.load_profile(name)
    return name
