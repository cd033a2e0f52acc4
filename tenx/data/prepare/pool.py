"""The worker pool of `tenx data prepare`'s passes: a function over items in processes, results in order.

A worker that fails, panics in native code or dies (a signal, out of memory) ends the pass with a
DataError naming what happened, never a hang: a multiprocessing Pool catches only Exception, restarts a
worker whose initializer fails for ever, and waits for ever on the task of a worker that died.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tenx.errors import DataError
from tenx.utils.text import first_line


def ordered_map(
    fn: Callable[[Any], Any],
    items: Iterable[Any],
    workers: int,
    initializer: Callable[..., None] | None = None,
    initargs: tuple = (),
) -> Iterator[Any]:
    """fn over items in `workers` processes, results in the items' order, at most 2 x workers in flight
    (Pool.imap would read the whole input ahead). Workers are forked where the platform can (a fast start:
    tests and small corpora pay little), spawned elsewhere, and run one thread each (tokenizers' own
    parallelism off), so `workers` is the number of cores used."""
    env = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the spawned workers
    try:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        context = multiprocessing.get_context(method)
        with context.Pool(workers, initializer=_guarded_init, initargs=(initializer, initargs)) as pool:
            pending: collections.deque = collections.deque()
            try:
                seen: dict[int, Any] = {p.pid: p for p in getattr(pool, "_pool", ())}  # see _result
                for item in items:
                    pending.append(pool.apply_async(_guarded_call, (fn, item)))
                    if len(pending) >= 2 * workers:
                        yield _result(pending.popleft(), pool, seen)
                while pending:
                    yield _result(pending.popleft(), pool, seen)
            except BaseException:
                # Leaving the `with` terminates the workers. One killed while writing its result keeps the
                # result queue's lock, and Pool.terminate then waits on that lock forever (seen once in the
                # test suite, after a worker's failure): let the tasks in flight finish writing first.
                deadline = time.monotonic() + _DRAIN_S
                for result in pending:
                    result.wait(max(0.0, deadline - time.monotonic()))
                raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_INIT_ERROR: list[BaseException] = []
_DRAIN_S = 10.0
"""How long a failing ordered_map waits, in all, for its tasks in flight before terminating the workers."""


def _guarded_init(initializer: Callable[..., None] | None, initargs: tuple) -> None:
    """A worker's initializer whose failure is raised by its first task (a Pool would restart it forever)."""
    try:
        if initializer is not None:
            initializer(*initargs)
    except BaseException as e:  # noqa: BLE001 - handed to the main process by _guarded_call
        _INIT_ERROR.append(e)


def _guarded_call(fn: Callable[[Any], Any], item: Any) -> Any:
    if _INIT_ERROR:
        raise _INIT_ERROR[0]
    try:
        return fn(item)
    except Exception:
        raise
    except BaseException as e:  # noqa: BLE001 - a Rust panic (pyo3's PanicException) would kill the worker
        # A Pool catches only Exception: anything else ends the worker, its task is never answered, and the
        # main process would wait for ever. Hand it back as an error the main process can raise.
        raise DataError(
            f"a `tenx data prepare` worker failed ({type(e).__name__}: {first_line(e)})"
        ) from None


_POLL_S = 1.0
"""How often a waiting ordered_map checks that its workers are alive."""


def _result(result: Any, pool: Any, seen: dict[int, Any]) -> Any:
    """The value of an ordered_map task, or DataError when a worker died meanwhile (killed by a signal, out of
    memory, a crash in native code): its task would never be answered, and a Pool waits for ever."""
    while True:
        try:
            return result.get(_POLL_S)
        except multiprocessing.TimeoutError:
            pass
        for process in list(getattr(pool, "_pool", ())):  # the Pool replaces a dead worker and forgets it
            seen.setdefault(process.pid, process)
        for process in seen.values():
            code = process.exitcode
            if code is not None and code != 0:
                how = f"signal {-code}" if code < 0 else f"exit status {code}"
                raise DataError(
                    f"a `tenx data prepare` worker process died ({how}; out of memory?) and its batch was lost; "
                    "re-run the same command to resume"
                )
