"""Loads the Hypothesis profile and, when KVSPEC_MUTANT names one, plants that mutant."""

from __future__ import annotations

import os

import pytest

from kvspec.campaign.redis_db import environment_database
from kvspec.conformance.profiles import load_profile

# KVSPEC_HYPOTHESIS_DATABASE: the machines share a campaign's Redis (docs/campaign.md).
load_profile(environment_database())

# Audits run by the tests replay no example database a campaign left on this machine (a test
# that wants one passes --database); subprocesses inherit this.
os.environ.setdefault("KVSPEC_DATABASE", "none")


def pytest_configure(config: pytest.Config) -> None:
    name = os.environ.get("KVSPEC_MUTANT")
    if name:
        from kvspec import impl
        from tests.mutants import plant

        if impl.COMPILED:
            raise pytest.UsageError("mutants are planted in the Python sources: set "
                                    "KVSPEC_PURE_PYTHON=1 (python -m tests.mutants does)")
        plant(name)
