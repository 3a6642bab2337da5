"""kvspec's executable specification of vLLM v1 paged KV-cache block management.

`spec.pool` is the abstract model of the block pool, `spec.pool_invariants` its named
invariants, and `conformance` the machinery that checks any implementation against it.
"""
