"""What the checker knows of example databases: the key of each audited machine, a count of
the examples an audit replays, and the directory databases on this machine.

A Hypothesis example database holds each failing example's choice sequence under a key
naming the test; every later run with the same database replays those examples first (the
``reuse`` phase) before generating new ones. kvspec keys each audited machine by layer,
target, profile, policy, scope and the exclusions in force (`audit_key`), so a counterexample
found against vLLM 0.13's pool is replayed by every later audit of that pool, on any machine
that reads the database, and never by an audit of another target.

The audit is handed a database object (`audit.run_audit`'s ``database``); it never opens one
from a URL. A directory database needs nothing but Hypothesis (`open_directory`); the shared
Redis database, its spool and the server a campaign starts are the campaign layer's
(`kvspec.campaign.redis_db`, whose ``open_database`` opens either kind for ``kvspec audit``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

# Where kvspec keeps its state on one machine: a campaign's Redis server's data, the spools of
# examples not yet pushed, the exported examples that `kvspec audit` replays, and what an
# audit that reads a shared database finds itself.
STATE_DIR = Path(".kvspec")
EXPORTED = STATE_DIR / "examples"
LOCAL_EXAMPLES = STATE_DIR / "local-examples"


class DatabaseError(ValueError):
    """A database spec that names nothing usable (not a redis:// URL, not a directory)."""


def audit_key(layer: str, target: str, profile: str, policy: str | None, scope: str,
              excluded: Iterable[str]) -> bytes:
    """The database key of one audited machine: which examples it replays. The exclusions are
    part of it because an excluded rule changes what a choice sequence means."""
    parts = [layer, target, profile, f"policy={policy or 'default'}", f"scope={scope}",
             "excluded=" + ",".join(sorted(excluded))]
    return "|".join(parts).encode()


class CountingDatabase(ExampleDatabase):
    """Counts the saved examples a run replays (those fetched from primary keys; Hypothesis's
    ``.secondary`` and ``.pareto`` keys hold shrinking material, not failures)."""

    def __init__(self, inner: ExampleDatabase) -> None:
        super().__init__()
        self.inner = inner
        self.replayed = 0

    def fetch(self, key: bytes) -> Iterable[bytes]:
        values = list(self.inner.fetch(key))
        if not key.endswith((b".secondary", b".pareto")):
            self.replayed += len(values)
        return values

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(src, dest, value)


def reading(shared: ExampleDatabase, local: Path | None) -> ExampleDatabase:
    """A reader's view of a shared database, Hypothesis's recipe: the shared one read-only
    (``shared`` already is), and what the reader finds itself written to its own directory
    ``local`` (``MultiplexedDatabase(local, shared)``); ``shared`` alone when ``local`` is
    None."""
    if local is None:
        return shared
    return MultiplexedDatabase(DirectoryBasedExampleDatabase(str(local)), shared)


def open_directory(spec: str, *, writer: bool, local: Path | None = None) -> ExampleDatabase:
    """The directory database at ``spec``: written by a writer; read-only for a reader, whose
    own finds go to ``local`` (`reading`)."""
    path = Path(spec)
    if path.exists() and not path.is_dir():
        raise DatabaseError(f"database {spec!r} is neither a redis:// URL nor a directory")
    if writer:
        return DirectoryBasedExampleDatabase(str(path))
    return reading(ReadOnlyDatabase(DirectoryBasedExampleDatabase(str(path))), local)
