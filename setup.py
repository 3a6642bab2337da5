"""setuptools build hook: a wheel of kvspec carries impl's hot modules compiled with mypyc.

Everything else is in pyproject.toml. scripts/compile.py says which modules and how (the same
code builds them in place for a checkout, ``make compile``). Without a C compiler or mypyc,
or with KVSPEC_PURE_PYTHON=1, the wheel is pure Python, which is complete on its own.

The extensions are made only when ``build_ext`` runs (mypyc type-checks and writes C for them,
which takes a while): setuptools evaluates this file for its metadata hooks too.
"""

import importlib.util
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

_spec = importlib.util.spec_from_file_location(
    "kvspec_compile", Path(__file__).resolve().parent / "scripts" / "compile.py")
assert _spec is not None and _spec.loader is not None
_compile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_compile)


class _CompiledDistribution(Distribution):
    """A platform wheel when it will hold compiled modules, a pure one otherwise."""

    def has_ext_modules(self):
        return _compile.why_not_compiled() is None


class _BuildMypycExtensions(build_ext):
    def finalize_options(self):
        if not self.distribution.ext_modules:
            self.distribution.ext_modules = _compile.mypyc_extensions()
        super().finalize_options()


setup(distclass=_CompiledDistribution, cmdclass={"build_ext": _BuildMypycExtensions})
