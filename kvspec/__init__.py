"""kvspec: an executable spec of vLLM v1's paged KV-cache block management, a fast drop-in
implementation of it, and the machinery that checks any implementation against the spec.

One import package, so that installing kvspec next to vLLM adds one top-level name:

* ``kvspec.spec``: the model (``spec/`` in the repository) and ``kvspec.spec.conformance``;
* ``kvspec.impl``: the implementation, with vLLM 0.13's module names (``impl/``);
* ``kvspec.models``: KV-cache layouts of real architectures (``models/``);
* ``kvspec.cli``: the ``kvspec`` command; ``kvspec.vllm_plugin``: running impl inside vLLM.

In the repository ``kvspec/spec``, ``kvspec/impl`` and ``kvspec/models`` are links to the
top-level folders, so every tool (mypy, mypyc, pytest, setuptools) sees one module name per file.
"""

__version__ = "0.1.0"
