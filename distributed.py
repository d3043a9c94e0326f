"""More than one host: jax.distributed's multi-controller runtime, process 0 in charge.

Every process (one per host) runs the same program over one global mesh
(--tensor-parallel-size = every process's devices together). Process 0 owns the
scheduler, the block allocator and the HTTP server; before each step it posts the step's
host inputs (the very numpy arrays it hands the jitted program), and every other process
takes them in order and runs the same program with them: XLA's collectives inside the
step then keep the processes in lockstep. Loading, KV sizing and warm-up are
deterministic, so each process does them itself; only the KV block count, which depends
on each device's free memory, is taken from process 0.

The inputs travel through the key-value store of jax.distributed's coordination service
(the distributed runtime's own channel): a process waiting for the next step waits on
that store in short polls, not inside an XLA collective, so an idle server holds no
collective open, and no broadcast program is compiled per input shape. A process that
dies stops sending heartbeats; the coordination service then fails every other process
(HEARTBEAT_TIMEOUT_S bounds how long that takes), and a process waiting for a step sees
the coordinator go away as an error, not a hang.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import signal
import socket
import threading
import time
from typing import Any, Callable

import numpy as np

from config import EngineConfig, flag_name

HEARTBEAT_TIMEOUT_S = 10  # jax.distributed's default is 100 s: a dead peer should fail the group sooner
INIT_TIMEOUT_S = 300  # jax.distributed's default: how long the processes wait for each other at start-up
# How long an exiting process waits in jax.distributed's shutdown barrier for the others
# (default 300 s): a normal stop reaches it on every process within seconds (process 0
# posts STOP at exit), but one that is stuck (in a step's collectives, in start-up, or waiting
# for a step a process 0 that failed at start-up never posts) would hold the exit that long.
SHUTDOWN_TIMEOUT_S = 30
_POLL_MS = 1000
_PREFIX = "taxirank/"
# A step is two posts: its forward (DECODE or RAGGED), then its sample program, whose
# bitmask travels only when a row is constrained (SAMPLE_MASKED; else each process uses
# its own all-ones bitmask, already on its devices); a step with logit_bias or penalties
# is SAMPLE_PENALIZED, whose "tokens" are the width of its sparse lists.
STOP, DECODE, RAGGED, SAMPLE, SAMPLE_MASKED, SAMPLE_PENALIZED = 0, 1, 2, 3, 4, 5
_HEADER = np.dtype(np.int64).itemsize * 3
KEEP_POSTS = 8
# Flags that name something on each host (its rank, its own cache folder): they may differ.
HOST_LOCAL = frozenset({"process_id", "compilation_cache_dir"})


def initialize(config: EngineConfig, log: Callable[[str], None] = print) -> None:
    """jax.distributed.initialize from the config; must run before JAX picks its devices."""
    import jax

    if config.distributed_coordinator is None or jax.distributed.is_initialized():
        return
    if config.process_id == 0:  # jaxlib crashes (SIGSEGV) when the service's port is taken
        check_port_free(int(config.distributed_coordinator.rpartition(":")[2]))
    # CPU devices of different processes need a collectives transport (GPUs use NCCL).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # jax waits for the whole group silently, then aborts with "another task died": say what it waits for
    log(f"multi-host: process {config.process_id} of {config.num_processes}, coordinator "
        f"{config.distributed_coordinator}: waiting up to {INIT_TIMEOUT_S} s for every process to join")
    if config.process_id > 0:  # jax's own wait for a missing process 0 ends in an abort saying "another task died"
        wait_for_coordinator(config.distributed_coordinator, INIT_TIMEOUT_S)
    on_sigterm = signal.getsignal(signal.SIGTERM)
    jax.distributed.initialize(coordinator_address=config.distributed_coordinator,
                               num_processes=config.num_processes, process_id=config.process_id,
                               initialization_timeout=INIT_TIMEOUT_S, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    if on_sigterm is not None and threading.current_thread() is threading.main_thread():
        # jax's preemption notifier has taken SIGTERM over, and only records it (for
        # checkpointing jobs): the process stops on it as it did before (a start-up ends)
        signal.signal(signal.SIGTERM, on_sigterm)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Wait until process 0's coordination service accepts connections at HOST:PORT;
    raises OSError saying so after timeout_s."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise OSError(f"no coordination service at --distributed-coordinator {address} after {timeout_s:g} s "
                              f"({e}): start process 0 (--process-id 0) with the same --distributed-coordinator, "
                              "on the host it names") from e
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def check_port_free(port: int) -> None:
    """Raises OSError when a socket listens on `port`, where process 0's coordination service
    listens (every interface, as jax binds it). SO_REUSEADDR, as gRPC's: a port whose last
    connections are closing (TIME_WAIT) is free."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                return
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise OSError(e.errno, f"process 0 cannot start the coordination service: port {port} of "
                                  "--distributed-coordinator is in use (another server, or another process 0?)") from e


def _client() -> Any:
    from jax._src.distributed import global_state  # the initialized runtime's client

    assert global_state.client is not None, "jax.distributed is not initialized"
    return global_state.client


def check_same_config(config: EngineConfig, client: Any = None, process_index: int | None = None,
                      process_count: int | None = None) -> None:
    """Raises ValueError on every process whose engine flags differ from process 0's (or,
    on process 0, when any other's do), naming them. A follower runs process 0's steps with
    programs shaped by its own flags (slots, block size, model length, dtype, the model
    and its seed), so a difference would otherwise fail or hang inside a collective at
    the first request, or mix two models' weights into wrong tokens. client, process_index
    and process_count default to the initialized runtime's."""
    import jax

    client = _client() if client is None else client
    me = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    mine = {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in HOST_LOCAL}
    client.key_value_set_bytes(f"{_PREFIX}config/{me}", json.dumps(mine).encode())
    for other in range(1, count) if me == 0 else (0,):
        theirs = json.loads(_wait(client, me, f"{_PREFIX}config/{other}"))
        p0, pn = (mine, theirs) if me == 0 else (theirs, mine)
        diff = [f"{flag_name(k)} {pn.get(k)} (process 0: {p0.get(k)})" for k in mine if p0.get(k) != pn.get(k)]
        if diff:
            raise ValueError(f"process {other if me == 0 else me} was started with other engine flags than "
                             f"process 0: {'; '.join(diff)}. Every process of a multi-host run takes the same "
                             "engine flags (all but --process-id)")


class GroupFailedError(RuntimeError):
    """Another process of the group is gone (or never answered)."""


class StepChannel:
    """Process 0 posts each program's (kind, rows, tokens, input arrays); the others take
    them in order. A post's key is deleted four steps (eight posts) later: process 0 has
    by then read back the results of step n + 1 at least (async scheduling keeps at most
    two steps in flight), which no process could have computed without reading step n."""

    def __init__(self) -> None:
        import jax

        self.client = _client()
        self.process_index = jax.process_index()
        self.n = 0

    def post(self, kind: int, rows: int, tokens: int, args: Any) -> None:
        import jax

        if self.process_index != 0:
            raise RuntimeError(f"process {self.process_index} tried to schedule a step: in a multi-host group only "
                               "process 0 schedules; the others call LLMEngine.follow()")
        body = np.array([kind, rows, tokens], np.int64).tobytes()
        body += b"".join(np.ascontiguousarray(x).tobytes() for x in jax.tree.leaves(args))
        self.client.key_value_set_bytes(f"{_PREFIX}step/{self.n}", body)
        if self.n >= KEEP_POSTS:
            self.client.key_value_delete(f"{_PREFIX}step/{self.n - KEEP_POSTS}")
        self.n += 1

    def take(self, template: Callable[[int, int, int], Any]) -> tuple[int, Any] | None:
        """The next step's (kind, args), args shaped like template(kind, rows, tokens);
        None when process 0 stopped."""
        import jax

        body = self._wait(f"{_PREFIX}step/{self.n}")
        self.n += 1
        kind, rows, tokens = (int(x) for x in np.frombuffer(body[:_HEADER], np.int64))
        if kind == STOP:
            return None
        leaves, treedef = jax.tree.flatten(template(kind, rows, tokens))
        out, off = [], _HEADER
        for x in leaves:
            x = np.asarray(x)
            out.append(np.frombuffer(body[off:off + x.nbytes], x.dtype).reshape(x.shape))
            off += x.nbytes
        assert off == len(body), (off, len(body))
        return kind, jax.tree.unflatten(treedef, out)

    def share_int(self, name: str, value: int) -> int:
        """Process 0's value of `value`, on every process."""
        key = f"{_PREFIX}{name}"
        if self.process_index == 0:
            self.client.key_value_set_bytes(key, np.int64(value).tobytes())
            return value
        return int(np.frombuffer(self._wait(key), np.int64)[0])

    def _wait(self, key: str) -> bytes:
        return _wait(self.client, self.process_index, key)


def _wait(client: Any, process_index: int, key: str) -> bytes:
    """The value posted at `key`, waited for in short polls."""
    while True:
        try:
            return client.blocking_key_value_get_bytes(key, _POLL_MS)
        except Exception as e:  # jax raises its runtime error type, matched by status
            if "DEADLINE_EXCEEDED" in str(e):
                continue  # nothing posted yet: poll again
            raise GroupFailedError(f"process {process_index}: the group failed (a process or the coordinator "
                                   f"is gone) while waiting for {key}: {e}") from e
