"""Loads the Hypothesis profile and, when KVSPEC_MUTANT names one, plants that mutant."""

from __future__ import annotations

import os

import pytest

from spec.conformance.profiles import load_profile

load_profile()


def pytest_configure(config: pytest.Config) -> None:
    name = os.environ.get("KVSPEC_MUTANT")
    if name:
        from tests.mutants import plant

        plant(name)
