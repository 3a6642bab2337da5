"""The KV-cache manager conformance machine, run against impl/.

One run over every layout, and one over the layouts with several attention types only, where
the hybrid lookup's repeated passes matter (three types) and groups of one type must all hit.
"""

from __future__ import annotations

from dataclasses import replace

from kvspec.spec.conformance.manager_machine import (
    HAND_LAYOUTS,
    ImplManager,
    machine_for,
    model_layout,
)

HYBRID_LAYOUTS = (
    replace(HAND_LAYOUTS[0], blocks_per_group=(6, 12)),  # full + sliding window + Mamba
    replace(HAND_LAYOUTS[1], blocks_per_group=(4, 10)),  # full (bs 4) + sliding window (bs 2)
    model_layout("Gemma-3-27B", window=3, blocks_per_group=(2, 4)),
)

TestImplManagerConformsToSpec = machine_for(ImplManager).TestCase
TestImplManagerHybridLayouts = machine_for(ImplManager, HYBRID_LAYOUTS).TestCase
