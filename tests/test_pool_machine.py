"""The block-pool conformance machine, run against impl/."""

from __future__ import annotations

from kvspec.spec.conformance.pool_machine import machine_for
from kvspec.spec.conformance.targets import VllmApiPool

TestImplConformsToSpec = machine_for(VllmApiPool).TestCase
