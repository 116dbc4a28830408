"""Isolated profiling: candidates timed in a worker process per GPU, each with a timeout.

As Inductor's subprocess autotuning (torch/_inductor/autotune_process.py): a kernel that faults (the CUDA
context is unusable afterwards) or hangs costs one failed row, not every later row. The parent sends tasks
(picklable descriptions of candidates) one at a time to a worker process on each GPU (spawned: CUDA cannot
be forked) and writes the rows that come back through one `RecordWriter`, appended and flushed one at a
time, so an interrupted run loses at most the rows in flight and a rerun skips the keys already recorded.

A worker calls `setup(device)` once (a picklable callable: a top-level function or class, or a
`functools.partial` of one), which returns the runner of its tasks' payloads. The runner reports through
a `Channel`: `start` names the candidates now in flight, `write` sends finished rows (ok or failed),
`recorded` asks whether the profile has a candidate already. The parent, for the candidates in flight
(those of the last `start`, else the task's own `candidates`), writes a failed row whose error says why:
- an exception escaping the runner: its type and text; the worker goes on with the next task;
- a CUDA error after which the context is unusable (`is_fatal_cuda_error`: illegal memory access,
  unspecified launch failure, misaligned address, ...), raised or in a written row: the CUDA error; the
  worker exits;
- the worker dies: 'worker died (exit code N)' or '(signal SIGSEGV)';
- no new `start` nor the task's end within `timeout` seconds: 'timeout after N s'; the parent kills it.
After a lost worker a fresh one starts, and a task cut short is sent to it again when the attempt recorded
something (its recorded candidates are then skipped), so the rest of a group of candidates is still timed.
A worker whose setup fails or times out raises IsolationError: every worker would fail alike.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn, Protocol

from tqdm import tqdm

from substation.errors import SubstationError
from substation.records import Candidate, ProfileRow, RecordWriter, candidate_key
from substation.sizes import Size

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0  # a candidate checks and times in well under a second; a hung one waits this long
STARTUP_TIMEOUT_S = 300.0  # spawn, import torch, create the CUDA context and the runner's handles
STOP_GRACE_S = 10.0  # how long a worker told to stop may take to exit before it is killed
MAX_ERROR_CHARS = 500
# CUDA errors after which the context is unusable: every later call of the process fails alike. Matched on
# the error's letters and digits, lower-cased, so the runtime's, driver's, CuPy's and PyTorch's spellings
# ("an illegal memory access", "CUDA_ERROR_ILLEGAL_ADDRESS", "cudaErrorIllegalAddress") all match.
FATAL_CUDA_ERRORS = ("illegalmemoryaccess", "illegaladdress", "unspecifiedlaunchfailure", "launchfailed",
                     "launchfailure", "misalignedaddress", "illegalinstruction", "devicesideassert",
                     "hardwarestackerror", "invalidprogramcounter", "launchtimedout", "uncorrectableecc",
                     "eccuncorrectable", "contextisdestroyed")

InFlight = tuple[Candidate, Size]


class IsolationError(SubstationError, RuntimeError):
    """A worker process could not start (its setup raised or timed out): every worker would fail alike."""


class ContextLost(BaseException):
    """In the worker: a row or exception says the CUDA context is unusable. A BaseException, so that it
    unwinds the runner past the `except Exception` that turns one candidate's failure into a row."""


@dataclass(frozen=True)
class Task:
    """One unit of work for a worker: `payload` goes to the runner. `candidates` are the rows it writes where
    known before it runs (empty where only the runner knows them): the parent skips the task when all are
    recorded, and writes them failed if the worker is lost before the runner starts others."""

    payload: Any
    candidates: tuple[InFlight, ...] = ()

    @property
    def label(self) -> str:
        return self.candidates[0][0].label if self.candidates else repr(self.payload)[:200]


class Runner(Protocol):
    def __call__(self, payload: Any, channel: Channel) -> None:
        """Time one task's payload, reporting through `channel`."""


Setup = Callable[[int], Runner]


def describe(error: BaseException) -> str:
    """An exception as one line of a row's error column: its type and text."""
    return " ".join(f"{type(error).__name__}: {error}".split())[:MAX_ERROR_CHARS]


def is_fatal_cuda_error(text: str) -> bool:
    """Whether an error's text is a CUDA error that leaves the context unusable."""
    letters = "".join(c for c in text.lower() if c.isalnum())
    return any(pattern in letters for pattern in FATAL_CUDA_ERRORS)


# -- the worker process ----------------------------------------------------------------------------------

class Channel:
    """The worker's side of the pipe: what a runner tells the parent while it runs a task."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.lost: str | None = None  # the CUDA error that left the context unusable, once one has

    def start(self, candidates: Iterable[InFlight]) -> None:
        """These candidates are now in flight (written failed if the worker is lost), with `timeout` seconds."""
        self._conn.send(("start", tuple(candidates)))

    def write(self, rows: Iterable[ProfileRow]) -> None:
        """Finished rows, ok or failed; raises ContextLost after a row whose error leaves the context unusable."""
        rows = tuple(rows)
        self._conn.send(("rows", rows))
        fatal = next((row.error for row in rows if row.status == "failed" and is_fatal_cuda_error(row.error)), None)
        if fatal is not None:
            self.lost = fatal
            raise ContextLost(fatal)

    def recorded(self, candidate: Candidate, size: Size) -> bool:
        """Whether the profile holds this candidate's row already (a resumed run skips it)."""
        self._conn.send(("recorded", (candidate, size)))
        return self._conn.recv()


def _serve(setup: Setup, device: int, conn: Connection) -> None:
    """The worker process: set up, then run tasks until the parent sends None or the CUDA context is lost."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the workers
    start_s = time.perf_counter()
    try:
        runner = setup(device)
    except Exception as error:  # noqa: BLE001 - reported to the parent, which raises IsolationError
        conn.send(("setup_failed", describe(error)))
        return
    log.debug("worker on device %d set up in %.1f s", device, time.perf_counter() - start_s)
    conn.send(("ready", None))
    channel = Channel(conn)
    while (task := conn.recv()) is not None:
        try:
            runner(task.payload, channel)
        except ContextLost:
            pass  # channel.lost says why
        except Exception as error:  # noqa: BLE001 - the candidates in flight fail; the next task runs
            text = describe(error)
            if is_fatal_cuda_error(text):
                channel.lost = channel.lost or text
            elif channel.lost is None:
                conn.send(("error", text))
        if channel.lost is not None:  # also where a runner's cleanup raised something else after the loss
            _exit_lost(conn, channel.lost)
        conn.send(("done", None))


def _exit_lost(conn: Connection, reason: str) -> NoReturn:
    conn.send(("lost", reason))
    conn.close()
    os._exit(0)  # no interpreter or CUDA teardown in a context that is broken


# -- the parent ------------------------------------------------------------------------------------------

def exit_reason(exitcode: int | None) -> str:
    """'exit code N' or 'signal SIGSEGV' for a process's exit code (negative: killed by that signal)."""
    if exitcode is None:
        return "still running, its pipe closed"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class _Lost(Exception):
    """The parent lost a worker: it died or said nothing in time. The text is the failed rows' error."""


class _Worker:
    """A worker process on one GPU, as the parent sees it."""

    def __init__(self, setup: Setup, device: int) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(setup, device, child), name=f"substation-gpu{device}",
                                       daemon=True)
        self.process.start()
        child.close()  # the child holds the only other end: its death reads as EOF here

    def receive(self, deadline: float, timeout: float) -> tuple[str, Any]:
        """The next message; _Lost if the worker dies or says nothing before `deadline` (time.monotonic)."""
        try:
            if not self.conn.poll(max(deadline - time.monotonic(), 0.0)):
                self.kill()
                raise _Lost(f"timeout after {timeout:g} s")
            return self.conn.recv()
        except (EOFError, OSError):  # its end closed: it died (or the parent is stopping and killed it)
            raise self.died() from None

    def send(self, message: object) -> None:
        try:
            self.conn.send(message)
        except OSError:
            raise self.died() from None

    def died(self) -> _Lost:
        self.process.join(STOP_GRACE_S)
        return _Lost(f"worker died ({exit_reason(self.process.exitcode)})")

    def stop(self) -> None:
        """Ask the worker to exit (it may have already), kill it if it does not."""
        try:
            self.conn.send(None)
        except OSError:
            pass  # it exited already
        self.process.join(STOP_GRACE_S)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(STOP_GRACE_S)
        if self.process.is_alive():  # stuck in the driver: leave it, a new worker still gets the GPU's next task
            log.error("worker %s (pid %s) is still alive after SIGKILL", self.process.name, self.process.pid)
        self.conn.close()


class _Sink:
    """The one writer of the profile, shared by the GPUs' threads."""

    def __init__(self, writer: RecordWriter, versions: Mapping[str, str], dropout: float | None) -> None:
        self.writer, self.versions, self.dropout, self.lock = writer, dict(versions), dropout, threading.Lock()

    def recorded(self, candidate: Candidate, size: Size, gpu: str) -> bool:
        with self.lock:
            return candidate_key(candidate, size, gpu) in self.writer

    def write(self, rows: Iterable[ProfileRow]) -> int:
        """Append the rows not yet recorded; how many were new."""
        new = 0
        with self.lock:
            for row in rows:
                if row.key in self.writer:
                    log.debug("%s: recorded already", row.label)
                    continue
                if row.status == "failed":
                    log.warning("%s: %s", row.label, row.error)
                self.writer.write(row)
                new += 1
        return new

    def fail(self, in_flight: Iterable[InFlight], gpu: str, reason: str) -> int:
        """Failed rows for the candidates in flight not yet recorded; how many were new."""
        return self.write(ProfileRow.make(c, size, gpu, self.versions, 0, None, None, "failed", reason,
                                          dropout=self.dropout) for c, size in in_flight)


@dataclass
class _Session:
    """What every GPU's thread shares: the setup, the sink, the timeouts, the live workers and the stop flag."""

    setup: Setup
    sink: _Sink
    timeout: float
    startup_timeout: float

    def __post_init__(self) -> None:
        self.stopping = threading.Event()
        self.workers: set[_Worker] = set()
        self.lock = threading.Lock()

    def start_worker(self, device: int) -> _Worker:
        """A worker that is set up; IsolationError if its setup fails or takes too long."""
        worker = _Worker(self.setup, device)
        with self.lock:
            self.workers.add(worker)
        if self.stopping.is_set():  # stop() ran while this one was spawning: it missed it
            worker.kill()
        try:
            tag, body = worker.receive(time.monotonic() + self.startup_timeout, self.startup_timeout)
        except _Lost as lost:
            tag, body = "lost", str(lost)
        if tag != "ready":
            self.end_worker(worker)
            raise IsolationError(f"the worker on GPU {device} did not start: {body}")
        return worker

    def end_worker(self, worker: _Worker) -> None:
        worker.stop()
        with self.lock:
            self.workers.discard(worker)

    def stop(self) -> None:
        """Stop every GPU's thread and kill the workers: nothing in flight is recorded as failed."""
        self.stopping.set()
        with self.lock:
            workers = list(self.workers)
        for worker in workers:
            worker.kill()


class _GpuShare:
    """One GPU's tasks, run in turn by one worker at a time (a fresh one after each loss)."""

    def __init__(self, session: _Session, device: int, gpu: str) -> None:
        self.session, self.device, self.gpu = session, device, gpu
        self.worker: _Worker | None = None
        self.started = 0

    def recorded(self, task: Task) -> bool:
        return bool(task.candidates) and all(self.session.sink.recorded(c, s, self.gpu) for c, s in task.candidates)

    def run(self, tasks: Sequence[Task], desc: str, position: int) -> None:
        queue = deque(tasks)
        with tqdm(total=len(tasks), desc=desc, position=position, disable=None) as bar:
            try:
                while queue and not self.session.stopping.is_set():
                    task = queue.popleft()
                    if not self.recorded(task) and self.run_task(task):
                        queue.appendleft(task)  # cut short after recording something: its rest goes to a new worker
                    else:
                        bar.update()
            finally:
                if self.worker is not None:
                    self.session.end_worker(self.worker)
        log.info("%s: %d tasks, %d workers started", desc, len(tasks), self.started)

    def run_task(self, task: Task) -> bool:
        """Run one task; True when the worker was lost partway and the attempt recorded a row (send it again)."""
        if self.worker is None:
            self.worker = self.session.start_worker(self.device)
            self.started += 1
        worker, in_flight, new = self.worker, task.candidates, 0
        deadline = time.monotonic() + self.session.timeout
        try:
            worker.send(task)
            while True:
                tag, body = worker.receive(deadline, self.session.timeout)
                if tag == "done":
                    return False
                if tag == "start":
                    in_flight, deadline = body, time.monotonic() + self.session.timeout
                elif tag == "rows":
                    new += self.session.sink.write(body)
                elif tag == "recorded":
                    worker.send(self.session.sink.recorded(*body, self.gpu))
                elif tag == "error":
                    new += self.fail(task, in_flight, body)
                    in_flight = ()
                elif tag == "lost":
                    raise _Lost(body)
        except _Lost as lost:
            self.session.end_worker(worker)
            self.worker = None
            if self.session.stopping.is_set():
                return False
            new += self.fail(task, in_flight, str(lost))
            return new > 0

    def fail(self, task: Task, in_flight: Sequence[InFlight], reason: str) -> int:
        if not in_flight:
            log.warning("%s: %s, with no candidate in flight", task.label, reason)
        return self.session.sink.fail(in_flight, self.gpu, reason)


def run_isolated(setup: Setup, tasks: Sequence[Task], path: Path, gpus: Mapping[int, str],
                 versions: Mapping[str, str], dropout: float | None, timeout: float = DEFAULT_TIMEOUT_S,
                 desc: str = "profile", startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Run `tasks` in worker processes, one per GPU (`gpus`: device index -> GPU name as rows record it), the
    tasks shared round-robin, and append their rows to `path`. `versions` and `dropout` (the run's probability,
    None for a run without dropout) stamp the failed rows the parent writes. `timeout`: seconds one task, or one
    candidate the runner starts, may take."""
    if timeout <= 0 or startup_timeout <= 0:
        raise ValueError(f"{timeout=} and {startup_timeout=} must be positive")
    devices = list(gpus)
    with RecordWriter(path) as writer:
        session = _Session(setup, _Sink(writer, versions, dropout), timeout, startup_timeout)
        with ThreadPoolExecutor(max_workers=len(devices)) as pool:
            futures = [pool.submit(_GpuShare(session, device, gpus[device]).run, tasks[i::len(devices)],
                                   f"{desc} gpu{device}", i) for i, device in enumerate(devices)]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                session.stop()
                raise
