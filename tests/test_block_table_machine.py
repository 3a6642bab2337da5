"""The block-table conformance machine (conformance/block_table_machine.py), run against
impl's MultiGroupBlockTable."""

from __future__ import annotations

from kvspec.conformance.block_table_machine import machine_for

TestBlockTableMachine = machine_for().TestCase
