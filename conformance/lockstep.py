"""Operations as data: one command vocabulary, run in lock step on the spec and a target.

Every layer of the checker (free queue, hash map, pool, manager, block table) is the same
three things:

- **commands**: frozen dataclasses, one per operation of the component's public API
  (`spec.pool.GetNewBlocks(2)`, `spec.pool.FreeBlocks((2, 1))`, ...). The first command of a
  program builds the component (`spec.pool.NewPool(...)`).
- **a spec step**: ``step(state, command) -> (state, output)``, a pure function in spec/
  (one per component). A call the component must refuse raises a ``ValueError`` or
  ``LookupError`` subclass and changes nothing.
- **an adapter** (`Adapter`): one table entry per command type (`Call`: which call to make,
  how to write it, how to read its output), from which it performs the same command on a
  target (``perform``) and writes it as a call on the target's own API (``call_source``,
  ``output_source``) for counterexamples; it reads the target's state back in the spec's
  terms (``view``) and runs the target's own representation check where it has one.

`Lockstep` runs one command on both and raises `Discrepancy` where they differ: outputs,
refusals (same base class, a message, the state left exactly as it was), representation.
The Hypothesis machines, the exhaustive explorer, the CrossHair program contract and the
audit all speak these commands; `counterexample_source` turns a program into a pytest file
of plain target API calls with the spec's expected values written in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

REFUSALS: tuple[type[Exception], ...] = (ValueError, LookupError)

S = TypeVar("S")

StepFunction = Callable[[Any, Any], tuple[Any, Any]]


class Discrepancy(AssertionError):
    """The target and the spec disagree on one command."""


class Unsupported(Exception):
    """Raised by an adapter for a command its target's API does not have (vLLM has no
    ``get_cached_prefix``, say): the command is checked on the spec only."""


@dataclass(frozen=True)
class Refused:
    """The output of a refused command: the base class a caller catches, and the spec's
    exception type (for the report)."""

    base: str  # "ValueError" or "LookupError"
    spec_error: str = field(compare=False, default="")


# --- Adapters as tables: one entry per command type -------------------------------------------


@dataclass(frozen=True)
class Arg:
    """An argument that is an object of the target's (a block, a request): how to get it
    (``get()``, only when the call runs), and how a written counterexample names it."""

    source: str
    get: Callable[[], object]


@dataclass(frozen=True)
class Reader:
    """How a target's raw output becomes the spec's: a function, and the same as source
    (``{}`` stands for the output expression)."""

    function: Callable[[Any], object]
    source: str = "{}"


AS_IS = Reader(lambda output: output)
NOTHING = Reader(lambda output: None)  # a call whose return value the spec does not compare


@dataclass(frozen=True)
class Call:
    """One command type on a target: ``run(adapter, command)`` makes the call (its raw
    output), ``write(adapter, command)`` writes it as source, ``read`` reads its output."""

    run: Callable[[Any, Any], Any]
    write: Callable[[Any, Any], str]
    read: Reader = AS_IS


def _value(argument: object) -> object:
    return argument.get() if isinstance(argument, Arg) else argument


def _source(argument: object) -> str:
    return argument.source if isinstance(argument, Arg) else repr(argument)


def method(name: str, arguments: Callable[[Any, Any], tuple[object, ...]] = lambda a, c: (),
           read: Reader = AS_IS) -> Call:
    """A call of the target's method ``name`` with ``arguments(adapter, command)``: plain
    values (written with ``repr``) or `Arg` objects of the target."""
    def run(adapter: Any, command: Any) -> Any:
        return getattr(adapter.target, name)(*map(_value, arguments(adapter, command)))

    def write(adapter: Any, command: Any) -> str:
        written = ", ".join(map(_source, arguments(adapter, command)))
        return f"{adapter.variable}.{name}({written})"

    return Call(run, write, read)


def attribute(name: str, read: Reader = AS_IS) -> Call:
    """A read of the target's attribute (or property) ``name``."""
    return Call(lambda adapter, command: getattr(adapter.target, name),
                lambda adapter, command: f"{adapter.variable}.{name}", read)


class Adapter:
    """How the checker drives one target of one layer. ``perform``, ``call_source`` and
    ``output_source`` derive from one table, ``calls``: a `Call` per command type. The
    target is the attribute named ``variable``, as a written counterexample names it."""

    variable: str  # "pool"
    calls: ClassVar[dict[type, Call]]

    @property
    def target(self) -> Any:
        return getattr(self, self.variable)

    def call_of(self, command: object) -> Call:
        try:
            return self.calls[type(command)]
        except KeyError:
            raise LookupError(f"not a {self.variable} command: {command!r}") from None

    def perform(self, command: object) -> object:
        """Run command on the target; the output in the spec's terms."""
        call = self.call_of(command)
        return call.read.function(call.run(self, command))

    def call_source(self, command: object) -> str:
        """The command as a Python expression on the target's own API; for the build
        command, the constructor call."""
        return self.call_of(command).write(self, command)

    def output_source(self, command: object, expression: str) -> str:
        """``expression`` (the target's raw output of command) in the spec's terms."""
        return self.call_of(command).read.source.format(expression)

    def view(self) -> Any:
        """The target's abstract state, in the spec's terms (comparable with the spec's)."""
        raise NotImplementedError

    def view_source(self) -> str:
        """An expression that reads the target's view (as ``view()`` returns it)."""
        raise NotImplementedError

    def imports(self) -> list[str]:
        """The import lines a written counterexample needs."""
        raise NotImplementedError

    def representation_target(self) -> Any:
        return self.target

    def check_representation(self) -> None:
        """The target's own representation check (impl's ``check_representation()``), if
        it has one."""
        check = representation_check_of(self.representation_target())
        if check is not None:
            getattr(self.representation_target(), check)()


def representation_check_of(target: object) -> str | None:
    """The name of the target's representation check: impl's ``check_representation`` (or
    ``_check``, its former name); None for a class without one (vLLM's)."""
    return next((name for name in ("check_representation", "_check")
                 if hasattr(target, name)), None)


def refusal_base(error: BaseException) -> str:
    """The caller-visible class of a refusal: ``LookupError`` or ``ValueError``."""
    return "LookupError" if isinstance(error, LookupError) else "ValueError"


class Lockstep(Generic[S]):
    """A spec state and a target, stepped together one command at a time.

    ``performed`` is the program so far (the build command first): what the audit writes out.
    """

    def __init__(self, step: StepFunction, adapter: Adapter,
                 check_representation: bool = True,
                 judge: Callable[[Any, Any], None] | None = None) -> None:
        self.step = step
        self.adapter = adapter
        # Named checks of a step's own output (``judge(command, target_output)``), run before
        # the output is compared with the spec's: a transition invariant (which blocks an
        # allocation may take) is reported by its name, not as a difference.
        self.judge = judge
        # False: the machine runs the target's representation check itself, as its last
        # invariant, so that a bug the spec's named invariants see is reported by them.
        self.check_representation = check_representation
        self.state: S | None = None
        self.performed: list[Any] = []

    def __call__(self, command: Any) -> Any:
        """Run command on both; return the spec's output (a `Refused` for a refused call)."""
        self.performed.append(command)
        try:
            new_state, expected = self.step(self.state, command)
        except REFUSALS as refused:
            self._expect_refusal(command, refused)
            return Refused(refusal_base(refused), type(refused).__name__)
        try:
            actual = self.adapter.perform(command)
        except Unsupported:
            self.state = new_state
            return expected
        except REFUSALS as error:
            raise Discrepancy(f"{command}: the spec accepts it (output {expected!r}); the "
                              f"target refused with {type(error).__name__}: {error}") from error
        self.state = new_state
        if self.judge is not None:
            self.judge(command, actual)
        if actual != expected:
            raise Discrepancy(f"{command}: target {actual!r}, spec {expected!r}")
        if self.check_representation:
            self.adapter.check_representation()
        return expected

    def _expect_refusal(self, command: Any, refused: Exception) -> None:
        before = self.adapter.view()
        base = refusal_base(refused)
        try:
            self.adapter.perform(command)
        except Unsupported:
            return
        except REFUSALS as error:
            if refusal_base(error) != base:
                raise Discrepancy(
                    f"{command}: spec refuses with {type(refused).__name__} ({refused}); target "
                    f"raised {type(error).__name__}, not a {base}: {error}") from error
            if not str(error):
                raise Discrepancy(f"{command}: {type(error).__name__} without a message") \
                    from error
        else:
            raise Discrepancy(f"{command}: spec refuses ({type(refused).__name__}: {refused}) "
                              f"but the target accepted it")
        if self.adapter.view() != before:
            raise Discrepancy(f"{command}: a refused call changed the target's state")
        if self.check_representation:
            self.adapter.check_representation()


def run_program(step: StepFunction, program: Sequence[Any]) -> list[tuple[Any, Any]]:
    """The spec's (state, output) after each command of program (a refusal: `Refused`)."""
    state: Any = None
    trace = []
    for command in program:
        try:
            state, output = step(state, command)
        except REFUSALS as refused:
            output = Refused(refusal_base(refused), type(refused).__name__)
        trace.append((state, output))
    return trace


def counterexample_source(step: StepFunction, program: Sequence[Any], adapter: Adapter,
                          view_of: Callable[[Any], object], docstring: str,
                          test_name: str = "test_counterexample",
                          preamble: Sequence[str] = (), fixtures: Sequence[str] = ()) -> str:
    """A pytest file that runs program as calls on the target's own API, each followed by
    what the spec says: the output, the refusal, the target's view. Nothing of the checker
    runs in it but the view reader; it runs with plain ``pytest`` from any directory."""
    trace = run_program(step, program)
    lines = [f'"""{docstring}"""', "", *(list(preamble) + [""] if preamble else []),
             "import pytest", "", *adapter.imports(), "", ""]
    if fixtures:
        lines += [*fixtures, "", ""]
    lines.append(f"def {test_name}() -> None:")
    check = getattr(adapter, "check_source", lambda: None)()
    target = adapter.variable
    for number, (command, (state, output)) in enumerate(zip(program, trace, strict=True)):
        call = adapter.call_source(command)
        if number == 0:
            lines.append(f"    {target} = {call}")
        elif isinstance(output, Refused):
            lines.append(f"    with pytest.raises({output.base}):  # the spec: "
                         f"{output.spec_error}")
            lines.append(f"        {call}")
        elif output is None:
            lines.append(f"    {call}")
        else:
            lines.append(f"    assert {adapter.output_source(command, call)} == {output!r}")
        # The state read back after every call, queries and refusals included: the target
        # may change where the spec says nothing changes (that may be the bug).
        lines.append(f"    assert {adapter.view_source()} == {view_of(state)!r}")
        if check:
            lines.append(f"    {check}")
    return "\n".join(lines) + "\n"
