"""AsyncEngine: the engine loop on its own thread, for the servers (server.py, serve_ray.py).

HTTP handlers hand requests and aborts to the loop thread through a lock-guarded inbox and
read each request's token deltas from an asyncio queue, so the event loop stays responsive
while a step runs. Only the loop thread changes the LLMEngine; other threads call the two
of its members documented as safe from any thread (AsyncEngine says which and why).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable

from config import EngineConfig
from engine import EngineDeadError, EngineRequest, LLMEngine, PreemptionRefusedError, QueueFullError
from outputs import RequestOutputDelta
from sequence import DuplicateRequestError

__all__ = ["AsyncEngine"]


class AsyncEngine:
    """The engine loop on its own thread, so HTTP stays responsive while a step runs.

    Only the loop thread changes the LLMEngine: add_request and abort hand work to it
    through a lock-guarded inbox, and deltas (a request's last one too, however it ended)
    come back on the event loop through call_soon_threadsafe. Callers' threads use two
    LLMEngine members alone, each safe from any thread: validate (it reads only what never
    changes after start-up, and compiles through the thread-safe GrammarCompiler) and
    num_waiting_unreserved (one int the scheduler's queue keeps, read whole under the GIL). The shared
    grammars and stats lock themselves; config, model_config, tokenizer and
    sampling_defaults never change after start-up."""

    def __init__(self, config: EngineConfig, log: Callable[[str], None] = print):
        self.engine = LLMEngine(config, log=log)
        self.config = self.engine.config
        self.model_config = self.engine.model_config
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.loaded.name
        self.stats = self.engine.stats
        self.grammars = self.engine.grammars  # the server compiles constraints on its executor
        self.sampling_defaults = self.engine.sampling_defaults  # the server's defaults of a request
        self._inbox: deque[tuple[str, object]] = deque()
        self._queues: dict[str, asyncio.Queue] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # adds handed over but not yet in the scheduler's waiting queue, less those in reserved places
        self._num_waiting_inbox = 0
        # places in the waiting queue held by beam searches for the requests of their steps
        # (reserve_waiting), each counted as waiting once, whether its request waits (in the
        # inbox or the queue, which then count it as reserved, not as their own), runs, or
        # is not there yet
        self._num_reserved = 0
        self.error: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None  # called on the event loop

    def validate(self, request: EngineRequest) -> EngineRequest:
        """LLMEngine.validate, on the caller's thread (see the class docstring): a check
        without queueing; the request with its constraint compiled."""
        return self.engine.validate(request)

    def follow(self) -> None:
        """Multi-host, processes other than 0: run process 0's steps (LLMEngine.follow)."""
        self.engine.follow()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="taxirank-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop taking work, abort everything in flight (each stream gets a final event)."""
        with self._lock:  # under the lock: no add or reset gets in after the loop's last look
            self._stop.set()
            for rid in list(self._queues):
                self._inbox.append(("abort", (rid, None)))
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def add_request(self, request: EngineRequest, reserved: bool = False) -> AsyncIterator[RequestOutputDelta]:
        """Check the request here, on the caller's thread (LLMEngine.validate: its grammar,
        unless compiled already, is compiled here too), and hand it to the loop. reserved: its
        place in the waiting queue is one that reserve_waiting() gave, so the queue's limit
        does not refuse it."""
        request = self.validate(request)
        # The loop takes it later: it arrived now, and keeps its own copy of the prompt (the
        # caller's list may change meanwhile).
        arrival = time.monotonic() if request.arrival_time is None else request.arrival_time
        request = dataclasses.replace(request, prompt_token_ids=list(request.prompt_token_ids), arrival_time=arrival)
        with self._lock:  # the loop sets _stop and error under it: a stream registered here is ended
            self._check_alive()
            if request.request_id in self._queues:
                raise DuplicateRequestError(request.request_id)
            limit = self.config.max_waiting_requests
            assert not reserved or self._num_reserved > 0, "reserved=True without a reserve_waiting()"
            if limit is not None and not reserved and self._num_waiting() >= limit:
                raise QueueFullError(f"{limit} requests are already waiting (max_waiting_requests)")
            queue: asyncio.Queue = asyncio.Queue()
            self._queues[request.request_id] = queue
            self._inbox.append(("add", (request, reserved)))
            self._num_waiting_inbox += not reserved
        self._wake.set()
        return self._stream(request.request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutputDelta]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect): free the slot now
                self._abort(request_id, queue)

    def _num_waiting(self) -> int:
        """Under self._lock: the places in the waiting queue taken. Requests handed over but
        not yet scheduled, in places of their own: those in the inbox and those in the
        scheduler's queue right now, not the gauge of the last step, which a burst during a
        long step would outrun; and the places reserved, each once. (A request enters the
        queue before it leaves the inbox's count: a read between the two counts it twice,
        never none.)"""
        return self.engine.num_waiting_unreserved + self._num_waiting_inbox + self._num_reserved

    def reserve_waiting(self, n: int) -> None:
        """Hold n places in the waiting queue (QueueFullError if they are not free) until
        release_waiting(n): a beam search's steps each add up to n requests, and a search
        the server has admitted must not be refused at a later step (its work thrown away,
        and under load no search would ever end)."""
        with self._lock:
            self._check_alive()
            limit = self.config.max_waiting_requests
            if limit is not None and self._num_waiting() + n > limit:
                raise QueueFullError(f"{limit} requests are already waiting (max_waiting_requests)")
            self._num_reserved += n

    def release_waiting(self, n: int, after_aborts: bool = False) -> None:
        """Free n places reserve_waiting() held (the search has ended, or its client left).
        after_aborts: requests in those places may still wait, their aborts handed over but
        not yet done: the loop frees the places after those aborts, so that they count until
        the requests have left the queue (freed at once, the queue could hold more than its
        limit meanwhile)."""
        if not after_aborts:
            self._free_reserved(n)
            return
        with self._lock:
            self._inbox.append(("release", n))
        self._wake.set()

    def _free_reserved(self, n: int) -> None:
        with self._lock:
            self._num_reserved -= n
            assert self._num_reserved >= 0

    def abort(self, request_id: str) -> None:
        """End the request in flight under request_id, whichever it is when the loop gets to it."""
        self._abort(request_id, None)

    def _abort(self, request_id: str, queue: asyncio.Queue | None) -> None:
        """queue: abort only the request whose stream it is. A stream's cleanup runs after
        its request may have ended (failed, or finished while its consumer left) and its id
        been taken by a new request, which that cleanup must leave alone (as vLLM's
        generate() aborts its own internal request id, never the client's)."""
        with self._lock:
            self._inbox.append(("abort", (request_id, queue)))
        self._wake.set()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """LLMEngine.reset_prefix_cache, run on the loop thread between two steps."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._check_alive()
            self._inbox.append(("reset_prefix_cache", (done, reset_running_requests)))
        self._wake.set()
        return await done

    def _check_alive(self) -> None:
        """Under self._lock: refuse new work once shutdown() or the loop's death began."""
        if self._stop.is_set():
            raise RuntimeError("the engine is shutting down")
        if self.error is not None:
            raise RuntimeError(f"the engine loop died: {self.error!r}")

    # ---- the loop thread -----------------------------------------------------------
    def _deliver(self, deltas: list[RequestOutputDelta]) -> None:
        """Each to its request's stream, all in one hand-over to the event loop (one wake-up
        of it, one self-pipe write, a step, not one a request); a request that failed alone
        (finish_reason "error") ends its stream with that error instead (the engine goes on)."""
        items = []
        with self._lock:
            for delta in deltas:
                queue = self._queues.get(delta.request_id)
                if delta.finished:
                    self._queues.pop(delta.request_id, None)
                if queue is not None:
                    items.append((queue, delta if delta.error is None else
                                  RuntimeError(f"request failed: {delta.error!r}")))
        if items:
            self._loop.call_soon_threadsafe(_put_all, items)

    def _drain_inbox(self) -> None:
        with self._lock:
            work = list(self._inbox)
            self._inbox.clear()
        for kind, arg in work:
            if kind == "add":
                request, reserved = arg
                try:
                    self.engine.enqueue(request, place_reserved=reserved)  # add_request validated it
                except ValueError as e:  # refused at queueing (an id the engine still holds): it alone ends
                    self._fail(request.request_id, e)
                finally:
                    with self._lock:
                        self._num_waiting_inbox -= not reserved
            elif kind == "release":
                self._free_reserved(arg)
            elif kind == "reset_prefix_cache":
                done, reset_running = arg
                try:
                    ok = self.engine.reset_prefix_cache(reset_running)
                except PreemptionRefusedError as e:  # refused before anything changed
                    self._loop.call_soon_threadsafe(_settle, done, e)
                    continue
                except BaseException as e:  # a step it collected failed: the loop dies (_run)
                    self._loop.call_soon_threadsafe(_settle, done, EngineDeadError(f"engine failure: {e!r}"))
                    raise
                self._loop.call_soon_threadsafe(_settle, done, ok)
            else:
                rid, queue = arg
                with self._lock:
                    if queue is not None and self._queues.get(rid) is not queue:
                        continue  # that stream's request has ended; the id may name a newer one
                last = self.engine.abort(rid)
                if last is not None:
                    self._deliver([last])

    def _fail(self, request_id: str, error: Exception) -> None:
        """End one request's stream with an error (the engine goes on)."""
        with self._lock:
            queue = self._queues.pop(request_id, None)
        if queue is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, error)

    def _run(self) -> None:
        try:
            while True:
                self._drain_inbox()
                if self._stop.is_set() and not self.engine.has_unfinished():
                    with self._lock:  # work queued between the drain and here is served first
                        if not self._inbox:
                            return
                    continue
                if not self.engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
        except BaseException as e:  # surface engine failures to every waiting stream and reset
            with self._lock:
                self.error = e
                queues = list(self._queues.values())
                self._queues.clear()
                resets = [arg[0] for kind, arg in self._inbox if kind == "reset_prefix_cache"]
                self._inbox.clear()
            dead = EngineDeadError(f"engine failure: {e!r}")
            for q in queues:
                self._loop.call_soon_threadsafe(q.put_nowait, dead)
            for f in resets:
                self._loop.call_soon_threadsafe(_settle, f, dead)
            if self.on_death is not None:  # after the errors above, so they are delivered first
                self._loop.call_soon_threadsafe(self.on_death, e)
            raise


def _settle(future: asyncio.Future, result: object) -> None:
    """A caller's answer, unless it gave up waiting (cancelled): an exception is raised to it."""
    if not future.done():
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
