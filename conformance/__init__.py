"""Conformance machinery: Hypothesis state machines, target adapters, exploration and audit."""
