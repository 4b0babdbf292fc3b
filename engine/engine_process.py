"""EngineProcess: the engine loop in a process of its own (`EngineClient`).

In the caller's process the engine's Python (scheduling, sampling, detokenizing, building each
step's outputs) and the caller's event loop take turns on one GIL: every torch call lets the
GIL go and takes it back, and while the loop handles a burst of requests or streams the
engine waits to get it back (and the loop waits while the engine runs Python, or collects its
garbage). In a process of its own each has its own interpreter: the loop's work costs the
engine CPU time only, not turns.

The process is started with the spawn method (forking a process that runs torch's threads or
holds a CUDA context is not safe) and builds its engine with ``build``, a picklable callable
(a module-level function, or a functools.partial of one). Commands go down one pipe, read by
a thread of the engine's process so the pipe never fills while a step runs; each step's
outputs, then its statistics, come up another, read by a thread of the caller's
(``tiergate-engine-reader``) that hands them to the callers' event loops.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.engine_client import EngineClient
from engine.errors import EngineDeadError, EngineError
from engine.llm_engine import LLMEngine, TenantContext
from engine.outputs import RequestOutput
from engine.request_limits import RequestLimits
from engine.sampling_params import SamplingParams
from engine.scheduler_stats import SchedulerStats

logger = logging.getLogger(__name__)

# -- what the caller sends ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    tenant: TenantContext


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Refused:
    num_prompt_tokens: int
    tenant: TenantContext


@dataclass(frozen=True)
class _Stop:
    pass


_Command = _Add | _Abort | _Refused | _Stop

# -- what the engine's process sends -----------------------------------------------------------


@dataclass(frozen=True)
class _Ready:
    limits: RequestLimits
    stats: SchedulerStats


@dataclass(frozen=True)
class _Outputs:
    outputs: list[RequestOutput]


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
        self._process.start()
        # Before multiprocessing's own exit handler, which would wait for the process (it
        # ignores the SIGTERM that handler sends), should this process exit without shutdown.
        atexit.register(self._leave)
        # Only the engine's process holds these ends now: its exit is an EOF here.
        commands_end.close()
        messages_end.close()
        self._send_lock = threading.Lock()
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
        super().__init__(first.limits, first.stats)
        self._reader = threading.Thread(
            target=self._read, name="tiergate-engine-reader", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def record_refused(self, num_prompt_tokens: int, tenant: TenantContext) -> None:
        self._send(_Refused(num_prompt_tokens, tenant))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopped = True
        self._send(_Stop())
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

    def _submit_add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        tenant: TenantContext,
    ) -> None:
        self._send(_Add(request_id, prompt_token_ids, sampling_params, tenant))

    def _send(self, command: _Command) -> None:
        try:
            with self._send_lock:
                self._commands.send(command)
        except OSError:  # the process has gone; the reader fails the open streams
            if not self._stopped:
                logger.warning("the engine process is gone: %s not delivered",
                               type(command).__name__.lstrip("_"))

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
        messages.send(_Ready(engine.limits, engine.stats()))
        _EngineLoop(engine, commands, messages).run()
        code = 0
    except BaseException as exc:
        with contextlib.suppress(OSError):
            messages.send(_Failed.of(exc))
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _EngineLoop:
    def __init__(self, engine: LLMEngine, commands: Connection, messages: Connection) -> None:
        self.engine = engine
        self._commands = commands
        self._messages = messages
        self._pending: list[_Command] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        threading.Thread(target=self._receive, name="tiergate-engine-commands", daemon=True).start()

    def run(self) -> None:
        while True:
            with self._lock:
                commands, self._pending = self._pending, []
                taken_in_at_s = time.monotonic()  # what arrives later is not in
            for command in commands:
                if isinstance(command, _Stop):
                    return
                self._apply(command)
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self._messages.send(_Outputs(self.engine.step()))
            stats = self.engine.stats()
            stats.taken_in_at_s = taken_in_at_s
            self._messages.send(_Stats(stats))

    def _apply(self, command: _Add | _Abort | _Refused) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.sampling_params,
                    command.tenant,
                )
            except EngineError as exc:  # e.g. a duplicate id: fail this caller only
                self._messages.send(_AddFailed(command.request_id, exc))
        elif isinstance(command, _Abort):
            self.engine.abort(command.request_id)
        else:
            self.engine.record_refused(command.num_prompt_tokens, command.tenant)

    def _receive(self) -> None:
        """The command thread: moves each command from the pipe to the loop's list. At the
        pipe's end (the caller has gone) the loop is told to stop."""
        command: _Command
        while True:
            try:
                command = self._commands.recv()
            except (EOFError, OSError):
                command = _Stop()
            with self._lock:
                self._pending.append(command)
            self._wake.set()
            if isinstance(command, _Stop):
                return
