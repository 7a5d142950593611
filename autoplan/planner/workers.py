"""Running independent pieces of the stage search in forked processes, while the planner
goes on.

The stage search solves one intra-op ILP per distinct layer, logical mesh and microbatch count
(:mod:`autoplan.planner.pipeline.search`); the sub-meshes and microbatch counts are
independent of one another, so their searches can run side by side, one process per core, as
Alpa spreads its stage profiling over workers, and while the planner traces the next
microbatch size. Each task is forked once the graphs it reads are traced, so a child reads them
without copying or pickling them, and sends back only its answer (pickled through a pipe).
Answers are kept in the order the tasks were submitted, so the result is the one a single
process finds, whatever the core count.

Where ``fork`` is not available (or one job is asked for) each task runs when submitted.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from autoplan.errors import AutoplanError

T = TypeVar("T")


def default_jobs() -> int:
    """The cores this process may run on, shared with the other ranks of its node under
    torchrun (they all plan at once); one inside an initialised process group (a process
    holding its threads is not forked)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, cores // max(1, ranks_here))


def _child(task: Callable[[], T], pack: Callable[[T], Any], connection: multiprocessing.connection.Connection
           ) -> None:
    try:
        connection.send(("ok", pack(task())))
    except AutoplanError as e:
        connection.send(("autoplan", str(e)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        connection.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        connection.close()


@dataclass
class _Running:
    index: int
    task: Callable[[], Any]
    process: multiprocessing.process.BaseProcess
    connection: multiprocessing.connection.Connection


class TaskPool(Generic[T]):
    """Tasks submitted one by one, each run in a forked child as soon as fewer than ``jobs``
    run, while the parent goes on (tracing the next graph, say); :meth:`results` waits for
    them all and gives their answers in the order they were submitted. A child sends
    ``pack(answer)`` (which must pickle) and the parent keeps ``unpack(index, packed)``. With
    one job, or where ``fork`` is not available, each task runs here when it is submitted.

    An :class:`AutoplanError` raised by a task is raised by :meth:`results` with its message;
    any other error as a RuntimeError carrying the child's traceback (the first submitted
    task's error, whatever the order they failed in). A task whose child dies without an
    answer (killed, out of memory) runs again here."""

    def __init__(self, jobs: int, pack: Callable[[T], Any] = lambda x: x,
                 unpack: Callable[[int, Any], T] = lambda i, x: x) -> None:
        self.forked = jobs > 1 and "fork" in multiprocessing.get_all_start_methods()
        self.jobs, self.pack, self.unpack = jobs, pack, unpack
        self.answers: dict[int, T] = {}
        self.errors: dict[int, Exception] = {}
        self.pending: collections.deque[tuple[int, Callable[[], T]]] = collections.deque()
        self.running: list[_Running] = []
        self.submitted = 0

    def submit(self, task: Callable[[], T]) -> int:
        """Run ``task`` (now, or in a child when a place is free); its index among the results."""
        index = self.submitted
        self.submitted += 1
        if not self.forked:
            self.answers[index] = task()
            return index
        self.pending.append((index, task))
        self._collect(block=False)
        return index

    def answer(self, index: int) -> T:
        """Task ``index``'s answer, waiting for it (other tasks go on running)."""
        while index not in self.answers and index not in self.errors:
            self._collect(block=True)
        if index in self.errors:
            raise self.errors[index]
        return self.answers[index]

    def results(self) -> list[T]:
        """Every task's answer, in submission order, once all have run."""
        while self.pending or self.running:
            self._collect(block=True)
        if self.errors:
            raise self.errors[min(self.errors)]
        return [self.answers[i] for i in range(self.submitted)]

    def free_places(self) -> int:
        """How many more tasks would start now (finished children collected first); none where
        tasks run as they are submitted."""
        if not self.forked:
            return 0
        self._collect(block=False)
        return max(0, self.jobs - len(self.running) - len(self.pending))

    def cancel(self) -> None:
        """Drop the tasks not started and stop the running ones (their answers are not needed)."""
        self.pending.clear()
        for running in self.running:
            running.process.terminate()
            running.process.join()
            running.connection.close()
        self.running.clear()

    def _collect(self, block: bool) -> None:
        """Start pending tasks where places are free, receive what finished children sent
        (waiting for one if ``block``), and fill the places freed."""
        self._start_pending()
        if self.running:
            ready = multiprocessing.connection.wait([r.connection for r in self.running],
                                                    timeout=None if block else 0)
            for done in [r for r in self.running if r.connection in ready]:
                self._receive(done)
        self._start_pending()

    def _start_pending(self) -> None:
        context = multiprocessing.get_context("fork")
        while self.pending and len(self.running) < self.jobs:
            index, task = self.pending.popleft()
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(task, self.pack, send), daemon=True)
            with warnings.catch_warnings():
                # Python 3.12+ warns about forking a process with threads (torch may hold a few
                # idle ones); a child only runs the search's Python and the ILP solver
                warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks",
                                        category=DeprecationWarning)
                process.start()
            send.close()
            self.running.append(_Running(index, task, process, receive))

    def _receive(self, done: _Running) -> None:
        try:
            kind, payload = done.connection.recv()
        except EOFError:  # the child died (killed, out of memory): run its task here instead
            kind, payload = "died", None
        done.process.join()
        done.connection.close()
        self.running.remove(done)
        if kind == "died":
            try:
                self.answers[done.index] = done.task()
            except Exception as e:  # noqa: BLE001 - raised by results(), in submission order
                self.errors[done.index] = e
        elif kind == "ok":
            self.answers[done.index] = self.unpack(done.index, payload)
        else:
            self.errors[done.index] = AutoplanError(payload) if kind == "autoplan" else RuntimeError(payload)
