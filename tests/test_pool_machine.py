"""The block-pool conformance machine, run against impl/."""

from __future__ import annotations

from kvspec.conformance.pool_machine import machine_for
from kvspec.conformance.targets import VllmApiPool

TestImplConformsToSpec = machine_for(VllmApiPool).TestCase
