"""``kvspec events check`` on vLLM's own publisher: vLLM's real Scheduler (tests/vllm_loop.py,
under 0.13 or 0.33) with its ``kv_event_publisher`` set to vLLM's
``ZmqEventPublisher`` (PUB and ROUTER replay on ipc sockets), once with vLLM's KV-cache code
and once with kvspec's through the plugin; the checker consumes it live in another process,
replaying what it missed before it subscribed, and must find nothing.

Run in a vLLM environment (skipped without vLLM)::

    .venv-vllm-0.13.0/bin/python -m pytest -q -p no:cacheprovider tests/test_events_check_vllm.py
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import pytest

pytest.importorskip("vllm")
pytest.importorskip("zmq")

REPO_ROOT = Path(__file__).resolve().parent.parent
VERSION = importlib.metadata.version("vllm")

# The workload process: vLLM's scheduler publishing through vLLM's ZmqEventPublisher; it
# prints "ready" once the sockets are bound, runs once it reads "go" (the checker has
# subscribed), then answers replays until stdin closes.
WORKLOAD = r"""
import os, sys, tempfile
from dataclasses import replace
from pathlib import Path
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import importlib
importlib.import_module("vllm.v1.core.sched.scheduler")
side, pub, replay, release = sys.argv[1:5]
if side == "kvspec":
    from kvspec import vllm_plugin
    vllm_plugin.install()
from vllm.distributed.kv_events import ZmqEventPublisher
from tests.vllm_loop import LOOP_WORKLOADS, Engine, build_scheduler
name = "priority-1" if release == "0.13" else "mamba-1"
workload = replace(LOOP_WORKLOADS[release][name], steps=400)
make = lambda scheduler: Engine(workload, scheduler, release)
publisher = ZmqEventPublisher(0, endpoint=pub, replay_endpoint=replay, topic="kv")

class Tee:
    def __init__(self, recorder):
        self.recorder = recorder
        self.events = recorder.events
    def publish(self, batch):
        self.recorder.publish(batch)
        publisher.publish(batch)
    def shutdown(self):
        pass

with tempfile.TemporaryDirectory() as tmp:
    scheduler = build_scheduler(workload, Path(tmp) / "model")
    engine = make(scheduler)
    engine.publisher = scheduler.kv_event_publisher = Tee(engine.publisher)
    print("ready", flush=True)
    sys.stdin.readline()  # "go": the checker has subscribed
    stored = 0
    for _ in range(workload.steps):
        record = engine.step()
        stored += sum(name.startswith("BlockStored") for name, _ in record.get("kv_events", ()))
print(f"stored {stored}", flush=True)
sys.stdin.read()
publisher.shutdown()
"""

# The checker: ``kvspec events check`` (the CLI's main) in its own process, which says
# "subscribed" once its SUB socket has connected to the publisher (ZMQ's monitor events). The
# workload starts on that word, not after a sleep: vLLM's PUB socket drops what it publishes
# before a subscriber is there, so a checker slow to start on a loaded machine would otherwise
# find the stream over (it replays from seq 0 what it missed before its first live batch).
CHECKER = r"""
import sys, threading
import zmq
from zmq.utils.monitor import recv_monitor_message
from kvspec.cli import main

plain_socket = zmq.Context.socket

def socket(context, kind, *args, **kwargs):
    made = plain_socket(context, kind, *args, **kwargs)
    if kind == zmq.SUB:
        monitor = made.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)

        def say_subscribed():
            recv_monitor_message(monitor)
            print("subscribed", flush=True)

        threading.Thread(target=say_subscribed, daemon=True).start()
    return made

zmq.Context.socket = socket
sys.exit(main(sys.argv[1:]))
"""


def _line_starting(stream: IO[str], prefix: str) -> str:
    """The first line that starts with ``prefix`` (vLLM logs to stdout too)."""
    for line in stream:
        if line.startswith(prefix):
            return line.strip()
    return ""


@pytest.mark.parametrize("side", ["vllm", "kvspec"])
def test_vllms_publisher_stream_conforms_live(side: str, tmp_path: Path) -> None:
    release = "0.13" if VERSION.startswith("0.13.") else "0.33"
    if not VERSION.startswith(("0.13.", "0.33.")):
        pytest.skip(f"needs vLLM 0.13 or 0.33, not {VERSION}")
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_TARGET_DEVICE="cpu")
    with tempfile.TemporaryDirectory(prefix="kvev", dir="/tmp") as tmp:
        pub, replay = f"ipc://{tmp}/pub", f"ipc://{tmp}/replay"
        workload = subprocess.Popen(
            [sys.executable, "-c", WORKLOAD, side, pub, replay, release], cwd=REPO_ROOT,
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert workload.stdout is not None
            assert _line_starting(workload.stdout, "ready") == "ready"
            out = tmp_path / "report.json"
            checker = subprocess.Popen(
                [sys.executable, "-c", CHECKER, "events", "check",
                 "--endpoint", pub, "--replay-endpoint", replay, "--topic", "kv",
                 "--idle-timeout", "10", "--json", str(out)],
                cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)
            try:
                assert checker.stdout is not None and workload.stdin is not None
                assert checker.stdout.readline() == "subscribed\n"
                workload.stdin.write("go\n")
                workload.stdin.flush()
                report_text, errors = checker.communicate(timeout=300)
            finally:
                if checker.poll() is None:
                    checker.kill()
                    checker.wait()
            stored = _line_starting(workload.stdout, "stored ")
        finally:
            assert workload.stdin is not None
            workload.stdin.close()
            workload.wait(timeout=60)
    assert checker.returncode == 0, report_text + errors
    report = json.loads(out.read_text())
    assert report["from_start"] and report["batches"] > 50, report
    assert any("compared with the live state" in note for note in report["notes"]), report
    shape = "array" if release == "0.13" else "map"
    assert set(report["encodings"]) == {shape}
    assert int(stored.split()[1]) > 0
    held = [(p["group_idx"], p["medium"], p["held_copies"]) for p in report["partitions"]]
    print(f"vLLM {VERSION}, {side}: {report['batches']} batches, {report['events']} events, "
          f"(group, medium, held copies) {held}")


def test_impl_pool_serving_033_next_to_vllm_013_publishes_033_events() -> None:
    """impl's pool built for 0.33's API next to vLLM 0.13 (as ``kvspec audit --profile
    vllm-0.33`` builds it there): vLLM 0.13's event classes lack 0.33's fields, so it uses
    impl's map-encoded 0.33 family, which decodes as a 0.33 stream. Next to vLLM 0.33 it
    uses vLLM's own."""
    import msgspec

    from kvspec.conformance.vllm_targets import request_for_033
    from kvspec.impl.block_pool import BlockPool
    from kvspec.spec.events import decode_batch

    pool = BlockPool(4, True, 2, enable_kv_cache_events=True, vllm_api="0.33")
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request_for_033([b"h" * 32], [1, 2]), blocks, 0, 1, 2, 0)
    events = pool.take_events()
    assert len(events) == 1
    module = type(events[0]).__module__
    assert module.startswith("vllm." if VERSION.startswith("0.33") else "kvspec."), module
    payload = msgspec.msgpack.encode([0.0, events, None])
    _, decoded, _ = decode_batch(payload)
    assert len(decoded) == 1
