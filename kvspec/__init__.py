"""kvspec: an executable spec of vLLM v1's paged KV-cache block management, a fast drop-in
implementation of it, and the machinery that checks any implementation against the spec.

One import package, so that installing kvspec next to vLLM adds one top-level name. Its
layers, from the bottom up (docs/architecture.md says what may import what):

* ``kvspec.spec``: the model, pure functions over immutable state (``spec/``);
* ``kvspec.impl``: the implementation, with vLLM 0.13's module names (``impl/``);
* ``kvspec.models``: KV-cache layouts of real architectures (``models/``);
* ``kvspec.conformance``: the checker: state machines, lockstep, adapters, explorer, audit
  (``conformance/``);
* ``kvspec.cli``: the ``kvspec`` command; ``kvspec.vllm_plugin``: running impl inside vLLM.

In a wheel the layers are folders inside ``kvspec/``. In a checkout they are the top-level
folders beside this one: pyproject.toml's ``package-dir`` table maps each import package to its
folder, and an editable install (``pip install -e .``, which ``make setup`` runs) follows it.
"""

__version__ = "0.1.0"
