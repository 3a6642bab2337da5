"""setuptools build hook: a wheel of kvspec carries impl's hot modules compiled with mypyc.

Everything else is in pyproject.toml. scripts/compile.py says which modules and how (the same
code builds them in place for a checkout, ``make compile``). Without a C compiler or mypyc,
or with KVSPEC_PURE_PYTHON=1, the wheel is pure Python, which is complete on its own.

mypyc runs once per build, in the command that builds: making the extensions type-checks impl
and writes its C (minutes). pip calls the build backend in three processes of their own
(``get_requires_for_build_wheel`` and ``prepare_metadata_for_build_wheel`` run ``egg_info`` /
``dist_info``, then ``build_wheel`` runs ``bdist_wheel``), and ``egg_info`` finalizes
``build_ext`` too, to list the extensions' sources in its manifest. Making the extensions
there tripled the time of ``pip install`` (3 x ~4 minutes); those commands only describe the
project, so they get none (tests/test_build.py counts the runs per pip phase).
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

# Commands that only describe the project (metadata, manifest, source archive): no extensions.
_DESCRIBING_COMMANDS = frozenset({"egg_info", "dist_info", "sdist"})


class _CompiledDistribution(Distribution):
    """A platform wheel when it will hold compiled modules, a pure one otherwise."""

    _extensions_made = False

    def has_ext_modules(self):
        return _compile.why_not_compiled() is None

    def make_extensions(self):
        """impl's extensions, made once: ``editable_wheel`` finalizes ``build_ext`` twice."""
        if not self._extensions_made:
            self._extensions_made = True
            self.ext_modules = _compile.mypyc_extensions()


class _BuildMypycExtensions(build_ext):
    def finalize_options(self):
        if not set(self.distribution.commands) <= _DESCRIBING_COMMANDS:
            self.distribution.make_extensions()
        if self.parallel is None:  # mypyc's groups compile side by side (scripts/compile.py)
            self.parallel = _compile.JOBS
        super().finalize_options()


setup(distclass=_CompiledDistribution, cmdclass={"build_ext": _BuildMypycExtensions})
