"""A pool of gloo worker processes for multi-rank CPU tests, spawned once and reused.

Megatron runs its unit tests under torchrun, one pytest process per GPU (FORMATS sec. 9). Here one
pytest process owns `world_size` spawned workers, each a rank of one gloo world, and sends them
tasks: module-level functions (pickled by reference, so the workers import the test module)
that every rank runs, e.g.

    def _tp_sum(value):                        # in tests/parallel/test_something.py
        init_parallel(tp=2)
        ...
        return result_of_this_rank

    def test_something(dist_pool):
        per_rank = dist_pool.run(_tp_sum, 3)   # results in rank order

Spawning costs seconds (every worker imports torch); a task costs milliseconds, because a
worker only re-creates the parallel groups: after each task it calls
`parallel_state.destroy_model_parallel()` and a barrier, so tasks do not see each other's
groups. Tasks return plain data and the test asserts in the parent, where pytest rewrites
asserts (inside workers a bare `assert` reports no values).

Failures never pass silently and never hang: a task raising on any rank becomes a WorkerError
holding every failing rank's traceback; ranks still silent at the deadline (or a few seconds
after another rank failed) are named, and the pool is killed and re-spawned on the next run.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing.connection as mp_connection
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core import parallel_state

_ROOT = str(Path(__file__).resolve().parents[2])
_CLOSE = b""  # an empty message tells a worker to leave


class WorkerError(RuntimeError):
    """A task failed on some ranks (`failures`: rank -> traceback), or ranks died or went silent."""

    def __init__(self, message: str, failures: Optional[dict[int, str]] = None,
                 silent: tuple[int, ...] = (), dead: Optional[dict[int, Optional[int]]] = None) -> None:
        super().__init__(message)
        self.failures = failures or {}
        self.silent = silent
        self.dead = dead or {}


# --------------------------------------------------------------------------- worker side

def init_parallel(tp: int = 1, pp: int = 1, vpp: Optional[int] = None, cp: int = 1, ep: int = 1,
                  order: str = "tp-cp-ep-dp-pp", etp: Optional[int] = None) -> None:
    """Task helper: `parallel_state.initialize_model_parallel` with short names."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        expert_model_parallel_size=ep, order=order, expert_tensor_parallel_size=etp)


def _answer(results: mp_connection.Connection, task_id: int, kind: str, ok: bool, payload: Any) -> None:
    """kind "result": the task's return value (ok) or traceback; "clean": state reset and barrier passed."""
    try:
        blob = pickle.dumps((task_id, kind, ok, payload))
    except Exception:
        blob = pickle.dumps((task_id, kind, False,
                             "the task's result could not be pickled:\n" + traceback.format_exc()))
    results.send_bytes(blob)


def _setup_worker(rank: int, world_size: int, store_port: int, timeout_s: float) -> None:
    # torchrun's variables, so code that reads them (arguments, device) sees this rank.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))
    # The pool is the CPU/gloo test path even on a GPU machine.
    os.environ.setdefault("MEGATRON_FORCE_CPU", "1")
    # Several workers share few cores: one intra-op thread each, or they thrash.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first inter-op work; harmless if too late
        pass
    # Tasks live in test modules (tests.parallel....): import them from the repository root.
    os.chdir(_ROOT)
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def _run_task(blob: bytes) -> tuple[int, bool, Any]:
    task_id, call = pickle.loads(blob)  # the call is pickled apart, so its import errors keep the id
    try:
        fn, args, kwargs = pickle.loads(call)
    except BaseException:
        return task_id, False, "the task could not be unpickled in the worker:\n" + traceback.format_exc()
    try:
        return task_id, True, fn(*args, **kwargs)
    except BaseException:  # pytest.fail/skip raise BaseException subclasses: report those too
        return task_id, False, traceback.format_exc()


def _clean_up() -> tuple[bool, Optional[str]]:
    """Forget the task's parallel groups and wait for every rank, so tasks stay independent."""
    try:
        parallel_state.destroy_model_parallel()
        dist.barrier()
        return True, None
    except BaseException:
        return False, "after the task, destroy_model_parallel() + barrier failed:\n" + traceback.format_exc()


def _worker_main(rank: int, world_size: int, store_port: int, timeout_s: float,
                 tasks: mp_connection.Connection, results: mp_connection.Connection) -> None:
    try:
        _setup_worker(rank, world_size, store_port, timeout_s)
    except BaseException:
        _answer(results, 0, "result", False, traceback.format_exc())
        return
    _answer(results, 0, "result", True, None)
    _answer(results, 0, "clean", True, None)
    while True:
        try:
            blob = tasks.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            break
        if blob == _CLOSE:
            break
        task_id, ok, payload = _run_task(blob)
        # Answer before the barrier: a rank stuck there has finished, unlike a silent one.
        _answer(results, task_id, "result", ok, payload)
        _answer(results, task_id, "clean", *_clean_up())
    dist.destroy_process_group()


# --------------------------------------------------------------------------- parent side

@dataclass
class _Worker:
    process: mp.Process
    tasks: mp_connection.Connection    # parent -> worker
    results: mp_connection.Connection  # worker -> parent


class DistributedPool:
    """`world_size` gloo ranks in spawned processes; `run(fn, ...)` runs fn on all of them."""

    def __init__(self, world_size: int, timeout_s: float = 180, failure_grace_s: float = 5,
                 startup_timeout_s: float = 120) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s  # per task
        self.failure_grace_s = failure_grace_s  # how long to wait for the others once a rank failed
        self.startup_timeout_s = startup_timeout_s  # spawning imports torch in every worker: slow on a busy box
        self._workers: list[_Worker] = []
        self._store: Optional[dist.TCPStore] = None
        self._task_id = 0
        self._closed = False
        atexit.register(self.close)  # runs before multiprocessing's exit hook would join the workers
        self._start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """fn(*args, **kwargs) on every rank; the results in rank order, or WorkerError."""
        if self._closed:
            raise RuntimeError("the DistributedPool is closed")
        label = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        self._task_id += 1
        try:
            blob = pickle.dumps((self._task_id, pickle.dumps((fn, args, kwargs))))
        except Exception as error:
            raise TypeError(f"cannot send {label} to the workers: a task must be a module-level function "
                            f"and its arguments picklable ({error})") from error
        if not self._workers:
            self._start()
        for rank, worker in enumerate(self._workers):
            try:
                worker.tasks.send_bytes(blob)
            except OSError:
                self._kill()
                raise WorkerError(f"{label}: rank {rank} is gone (exit code {worker.process.exitcode}); "
                                  "the pool was shut down and restarts on the next run",
                                  dead={rank: worker.process.exitcode}) from None
        return self._collect(self._task_id, label, self.timeout_s)

    def close(self) -> None:
        """Ask the workers to leave, then make sure they have."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.tasks.send_bytes(_CLOSE)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for worker in self._workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    # ----------------------------------------------------------------- internals

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        # The parent holds the rendezvous store, so its free port cannot be taken by someone else
        # between choosing it and the workers connecting.
        # Store and gloo timeouts cover a slow start-up; hung tasks are the parent's timeout's job.
        gloo_timeout_s = max(self.timeout_s, self.startup_timeout_s)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=gloo_timeout_s))
        for rank in range(self.world_size):
            task_reader, task_writer = ctx.Pipe(duplex=False)
            result_reader, result_writer = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_worker_main, name=f"dist-pool-rank{rank}",
                                  args=(rank, self.world_size, self._store.port, gloo_timeout_s,
                                        task_reader, result_writer))
            process.start()
            # Keep only our ends: a worker then sees EOF when we die, and we see EOF when it dies.
            task_reader.close()
            result_writer.close()
            self._workers.append(_Worker(process, task_writer, result_reader))
        try:
            self._collect(0, "start-up (init_process_group)", self.startup_timeout_s)
        except WorkerError:
            self._kill()
            raise

    def _collect(self, task_id: int, label: str, timeout_s: float) -> list[Any]:
        """Wait for every rank's result and clean-up notes; WorkerError on any failure or silence."""
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        dead: dict[int, Optional[int]] = {}
        pending = {worker.results: rank for rank, worker in enumerate(self._workers)}
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for conn in mp_connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic())):
                rank = pending[conn]
                try:
                    answered_id, kind, ok, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    del pending[conn]
                    self._workers[rank].process.join(5)
                    dead[rank] = self._workers[rank].process.exitcode
                    continue
                if answered_id != task_id:  # cannot happen: every task is collected or the pool killed
                    failures[rank] = f"answered task {answered_id} while task {task_id} was expected"
                elif not ok:
                    failures[rank] = failures[rank] + "\n" + payload if rank in failures else payload
                elif kind == "result":
                    results[rank] = payload
                if kind == "clean" or answered_id != task_id:
                    del pending[conn]
            if (failures or dead) and pending:
                # The others are probably stuck in a collective with the failed rank.
                deadline = min(deadline, time.monotonic() + self.failure_grace_s)
        silent = tuple(sorted(r for r in pending.values() if r not in results and r not in failures))
        in_barrier = tuple(sorted(r for r in pending.values() if r in results or r in failures))
        if pending or dead:
            self._kill()
        if failures or dead or pending:
            message = self._describe(label, timeout_s, failures, dead, silent, in_barrier)
            raise WorkerError(message, failures, silent, dead)
        return [results[rank] for rank in range(self.world_size)]

    def _describe(self, label: str, timeout_s: float, failures: dict[int, str], dead: dict[int, Optional[int]],
                  silent: tuple[int, ...], in_barrier: tuple[int, ...]) -> str:
        def ranks(numbers) -> str:
            return f"rank{'s' if len(numbers) > 1 else ''} {', '.join(str(n) for n in sorted(numbers))}"

        lines = []
        if failures:
            lines.append(f"{label} failed on {ranks(failures)} of {self.world_size}")
            for rank in sorted(failures):
                lines += [f"--- rank {rank} ---", failures[rank].rstrip()]
        for rank, code in sorted(dead.items()):
            lines.append(f"{label}: rank {rank} died (exit code {code})")
        if silent:
            lines.append(f"{label}: {ranks(silent)} did not answer in time (timeout {timeout_s} s)")
        if in_barrier:
            lines.append(f"{label}: {ranks(in_barrier)} finished but waited for the others in the barrier after it")
        if silent or in_barrier or dead:
            lines.append("the pool was shut down; the next run spawns a new one")
        return "\n".join(lines)

    def _kill(self) -> None:
        for worker in self._workers:
            for conn in (worker.tasks, worker.results):
                conn.close()
            if worker.process.is_alive():
                worker.process.terminate()
        for worker in self._workers:
            worker.process.join(5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
        self._workers = []
        self._store = None
