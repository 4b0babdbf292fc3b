"""EngineProcess: the engine loop in a process of its own (`EngineClient`).

In the caller's process the engine's Python (scheduling, sampling, detokenizing, building each
step's outputs) and the caller's event loop take turns on one GIL: every torch call lets the
GIL go and takes it back, and while the loop handles a burst of requests or streams the
engine waits to get it back (and the loop waits while the engine runs Python, or collects its
garbage). In a process of its own each has its own interpreter: the loop's work costs the
engine CPU time only, not turns.

The process is started with the spawn method (forking a process that runs torch's threads or
holds a CUDA context is not safe), its OpenMP workers' wait bounded
(`engine.process.openmp_wait`), and builds its engine with ``build``, a picklable callable (a
module-level function, or a functools.partial of one). Commands go down one pipe, read by a
thread of the engine's process so the pipe never fills while a step runs; each step's
outputs, then its statistics, come up another, read by a thread of the caller's
(``tiergate-engine-reader``) that hands them to the callers' event loops.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.core.llm_engine import LLMEngine
from engine.core.request_limits import RequestLimits
from engine.core.scheduler_stats import SchedulerStats
from engine.errors import EngineDeadError, EngineError
from engine.process.engine_client import EngineClient
from engine.process.engine_loop import EngineCommand, EngineLoop, Stop
from engine.process.openmp_wait import engine_openmp_environment, spawn_environment
from engine.step_outputs import StepOutputs

logger = logging.getLogger(__name__)

# -- what the engine's process sends -----------------------------------------------------------


@dataclass(frozen=True)
class _Ready:
    limits: RequestLimits
    stats: SchedulerStats
    weight_format: str  # ModelRunner.weight_format_label


@dataclass(frozen=True)
class _Outputs:
    outputs: StepOutputs  # one step's, in columns


@dataclass(frozen=True)
class _Stats:
    stats: SchedulerStats


@dataclass(frozen=True)
class _AddFailed:
    request_id: str
    error: EngineError


@dataclass(frozen=True)
class _Failed:
    """Building the engine, or its loop, raised."""

    error: str  # the exception's type and message
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> _Failed:
        return cls(f"{type(exc).__name__}: {exc}", traceback.format_exc())


_Message = _Ready | _Outputs | _Stats | _AddFailed | _Failed


class EngineProcess(EngineClient):
    """Starts the engine's process and returns once its engine is built (the model loaded);
    raises EngineDeadError if building it failed."""

    def __init__(self, build: Callable[[], LLMEngine], *, name: str = "tiergate-engine") -> None:
        context = multiprocessing.get_context("spawn")
        commands_end, self._commands = context.Pipe(duplex=False)
        self._messages, messages_end = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_serve,
            args=(build, commands_end, messages_end, logging.getLogger().getEffectiveLevel()),
            name=name,
            daemon=True,
        )
        with spawn_environment(engine_openmp_environment(os.environ)):
            self._process.start()
        # Before multiprocessing's own exit handler, which would wait for the process (it
        # ignores the SIGTERM that handler sends), should this process exit without shutdown.
        atexit.register(self._leave)
        # Only the engine's process holds these ends now: its exit is an EOF here.
        commands_end.close()
        messages_end.close()
        self._send_lock = threading.Lock()
        # Commands of this turn of the caller's event loop, sent down the pipe as one list at
        # its end: 32 requests arriving together cost one pickle and one wake-up there.
        self._outbox: list[EngineCommand] = []
        self._stopped = False
        self._ended = False
        try:
            first = self._messages.recv()
        except EOFError:
            first = _Failed(f"it exited with code {self._exit_code()}", "")
        if not isinstance(first, _Ready):
            self._leave()
            if isinstance(first, _Failed) and first.traceback:
                logger.error("the engine process could not start:\n%s", first.traceback.rstrip())
            detail = first.error if isinstance(first, _Failed) else repr(first)
            raise EngineDeadError(f"the engine process could not start: {detail}")
        super().__init__(first.limits, first.stats, first.weight_format)
        self._reader = threading.Thread(
            target=self._read, name="tiergate-engine-reader", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopped = True
        self._send(Stop())
        self._process.join(timeout_s)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %.1f s: killing it", timeout_s)
            self._process.kill()
            self._process.join(timeout_s)
        self._reader.join(timeout_s)
        self._leave()

    @property
    def is_running(self) -> bool:
        return not self._stopped and not self._ended and self._process.is_alive()

    def _send(self, command: EngineCommand) -> None:
        """On an event loop: sent at the end of this turn of it, with the turn's other
        commands; elsewhere (and Stop): at once."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._send_lock:
            self._outbox.append(command)
            first = len(self._outbox) == 1
        if loop is None or isinstance(command, Stop):
            self._flush()
        elif first:
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        with self._send_lock:
            commands, self._outbox = self._outbox, []
            if not commands:
                return
            try:
                self._commands.send(commands)
            except OSError:  # the process has gone; the reader fails the open streams
                if not self._stopped:
                    logger.warning("the engine process is gone: %d commands not delivered",
                                   len(commands))

    def _read(self) -> None:
        """The reader thread: each message of the engine's process, until it ends."""
        try:
            while True:
                message: _Message = self._messages.recv()
                if isinstance(message, _Outputs):
                    self._deliver(message.outputs)
                elif isinstance(message, _Stats):
                    self._stats = message.stats
                elif isinstance(message, _AddFailed):
                    self._fail(message.request_id, message.error)
                elif isinstance(message, _Failed):
                    logger.error("engine loop stopped:\n%s", message.traceback.rstrip())
        except (EOFError, OSError):
            pass
        except Exception:  # a message that does not read back: no telling what the rest are
            logger.exception("reading the engine process's messages failed: stopping it")
            self._process.kill()
        self._ended = True
        if not self._stopped:
            logger.error("the engine process ended (exit code %s)", self._exit_code())
        self._fail_all()

    def _exit_code(self) -> int | None:
        self._process.join(1.0)
        return self._process.exitcode

    def _leave(self, timeout_s: float = 5.0) -> None:
        """Close the pipes (the process's loop leaves at their end) and kill the process if
        it is still there after timeout_s (it was still building its engine)."""
        atexit.unregister(self._leave)
        self._commands.close()
        self._messages.close()
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


# -- the engine's process ----------------------------------------------------------------------


def _serve(
    build: Callable[[], LLMEngine], commands: Connection, messages: Connection, log_level: int
) -> None:
    """The engine process's main: build the engine, then run its loop until told to stop or
    until the caller has gone. It leaves with os._exit: an interpreter teardown would walk
    the frozen heap (and the extension modules' leak reports) for nothing.

    SIGINT and SIGTERM are the caller's to handle: a Ctrl-C reaches the terminal's whole
    process group, and a service manager may signal every process of the service, while
    the caller drains its open requests, which need this process until they end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s"
    )
    code = 1
    try:
        engine = build()
        # What exists now (modules, the model) lives as long as the process: out of the
        # cyclic collector's reach, so its full collections walk only what steps create.
        gc.collect()
        gc.freeze()
        messages.send(_Ready(engine.limits, engine.stats(), engine.runner.weight_format_label))
        loop = EngineLoop(
            engine,
            deliver=lambda outputs: messages.send(_Outputs(outputs)),
            publish_stats=lambda stats: messages.send(_Stats(stats)),
            add_failed=lambda request_id, exc: messages.send(_AddFailed(request_id, exc)),
        )
        threading.Thread(
            target=_receive, args=(commands, loop), name="tiergate-engine-commands", daemon=True
        ).start()
        loop.run()
        code = 0
    except BaseException as exc:
        with contextlib.suppress(OSError):
            messages.send(_Failed.of(exc))
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _receive(commands: Connection, loop: EngineLoop) -> None:
    """The command thread: moves each list of commands from the pipe to the loop. At the
    pipe's end (the caller has gone) the loop is told to stop."""
    while True:
        try:
            batch: list[EngineCommand] = commands.recv()
        except (EOFError, OSError):
            batch = [Stop()]
        loop.submit_all(batch)
        if any(isinstance(command, Stop) for command in batch):
            return
