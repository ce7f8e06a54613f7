"""`trtbuild serve`: check, load, listen, drain.

Before it accepts traffic the server refuses what it must not serve: a non-loopback address without API keys,
an engine directory that differs from its manifest (each changed file named), an engine that cannot run here.
It then listens at once (liveness answers) and warms the engine up in the background (readiness says no until
one real token came out).

Drain: the first SIGTERM or SIGINT makes /ready answer 503 and new requests 503, lets the requests in flight
finish for up to --drain-timeout seconds, cancels what is left, and exits 0; a second signal exits at once.
Kubernetes sends SIGTERM and waits terminationGracePeriodSeconds, which must exceed the drain timeout.

Rank failure (multi-rank engines): a watchdog polls the engine's health; once a rank is dead or a collective timed
out, /health says why for FAILURE_LINGER_S, the server stops, closes the engine (its workers stopped, killed after
a grace) and `trtbuild serve` exits EXIT_ENGINE_FAILED (3), within the collective timeout + 5 s of the failure, so
that its supervisor (Kubernetes, torchrun, systemd) starts the whole group again. A group cannot heal a lost rank
in place: the survivors' collectives are out of step.

Under torchrun every rank runs this same command; only global rank 0 gets past `open_engine` and listens, the others
serve their part of the engine until rank 0 stops them.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from toolchain import console
from toolchain.engine.api import close_engine, load_tokenizer, open_engine
from toolchain.errors import UserError
from toolchain.parallel.launch import under_torchrun
from toolchain.serve import EXIT_ENGINE_FAILED, tools
from toolchain.serve.app import ServeOptions, ServerState, create_app, start_warm_up
from toolchain.serve.auth import read_keys
from toolchain.speculation_cli import open_draft

WATCH_INTERVAL_S = 0.25  # how often the watchdog asks the engine's health
FAILURE_LINGER_S = 2.0  # after a rank failure: probes read the reason, in-flight streams get their error events
FORCE_EXIT_S = 2.0  # then uvicorn's graceful shutdown gets this long before open connections are dropped
CLOSE_TIMEOUT_S = 120.0  # a multi-rank engine's close() is bounded itself (its lock, a grace, then kill): a backstop


class EngineFailedExit(UserError):
    """A rank of the served engine failed: the server stopped, and the CLI exits 3."""

    exit_code = EXIT_ENGINE_FAILED


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _request_log() -> None:
    logger = logging.getLogger("trtbuild.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _torchrun_rank() -> int | None:
    """This process's global rank when torchrun started it (as parallel/launch.py tells), else None."""
    if not under_torchrun():
        return None
    try:
        return int(os.environ["RANK"])
    except ValueError:
        raise UserError(f"RANK={os.environ['RANK']!r}: expected the integer torchrun sets") from None


def prepare(engine_dir: Path, options: ServeOptions) -> ServerState:
    """Every check that may refuse to start, then the loaded engine (warm-up not started)."""
    rank = _torchrun_rank()
    if rank not in (None, 0):
        # Not the server: this rank runs its part of the engine inside open_engine until rank 0 stops it. It needs
        # no API keys (only rank 0 listens), so it does not read them: worker pods need not mount the Secret.
        # torchrun passes SIGTERM (a pod's deletion) and a terminal's Ctrl-C reaches every rank: this one must live
        # on while rank 0 drains, and exits when rank 0 stops it (or, rank 0 gone, when its collectives fail).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        open_engine(engine_dir)
        raise UserError(
            f"{engine_dir}: torchrun started this process as rank {rank} of {os.environ['WORLD_SIZE']}, but the "
            "engine is single-rank; serve it without torchrun (or with --nproc-per-node=1 --nnodes=1)"
        )
    if options.api_keys is None and not is_loopback(options.host):
        raise UserError(
            f"--host {options.host}: without --api-keys the server only listens on loopback (127.0.0.1, ::1); "
            "anyone who can reach it could use the engine. Pass --api-keys FILE to serve beyond this machine"
        )
    spec = options.speculation
    if spec is not None and (spec.method == "draft") != (options.draft is not None):
        raise UserError(f"speculation {spec.method!r} with draft {options.draft}: --draft DIR goes with method draft")
    keys = read_keys(options.api_keys) if options.api_keys is not None else None
    if options.max_queue < 1 or options.request_timeout <= 0 or options.drain_timeout < 0:
        raise UserError("--max-queue >= 1, --request-timeout > 0 and --drain-timeout >= 0")
    if options.tool_call_parser is not None:
        try:
            tools.choose_parser(options.tool_call_parser, None)
        except ValueError as e:
            raise UserError(str(e)) from None
    engine = open_engine(engine_dir)  # refuses an engine that is not what its manifest says (exit 4)
    draft = None
    try:
        if options.draft is not None:  # opened and checked against the engine (same tokenizer, limits)
            draft = open_draft(engine, options.draft)
        try:
            tokenizer: Any = load_tokenizer(engine_dir)
        except UserError as e:
            console.warn(f"{e}: serving token-id prompts only")
            tokenizer = None
        return ServerState(engine, tokenizer, options, keys, draft)
    except BaseException:
        for opened in (draft, engine):
            if opened is not None:
                close_engine(opened)
        raise


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM meaning "drain, then exit 0" instead of "close now"."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.trtbuild = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.trtbuild.draining:  # a second signal: stop now
            self.force_exit = self.should_exit = True
            return
        self.trtbuild.draining = True
        threading.Thread(target=self._drain, name="trtbuild-drain", daemon=True).start()

    def _drain(self) -> None:
        state = self.trtbuild
        deadline = time.monotonic() + state.options.drain_timeout
        console.info(f"draining: {state.inflight} request(s) in flight, up to {state.options.drain_timeout:g} s")
        while state.inflight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if state.inflight:
            console.warn(f"drain timeout: cancelling {state.inflight} request(s) still in flight")
        state.llm.close()  # what is left ends as cancelled; its streams close
        while state.inflight > 0 and time.monotonic() < deadline + 5:
            time.sleep(0.05)
        self.should_exit = True


class _Watchdog(threading.Thread):
    """Stops the server once the engine has failed (see the module docstring); `reason` says why."""

    def __init__(self, server: DrainingServer) -> None:
        super().__init__(name="trtbuild-watchdog", daemon=True)
        self.server = server
        self.reason: str | None = None
        self.done = threading.Event()  # the server has returned: nothing left to stop
        self.closer: threading.Thread | None = None  # closes the failed engine while the server lingers

    def run(self) -> None:
        state = self.server.trtbuild
        while not self.done.wait(WATCH_INTERVAL_S):
            self.reason = state.engine_failure()
            if self.reason is None:
                continue
            console.warn(f"engine failed: {self.reason}; stopping the server (exit {EXIT_ENGINE_FAILED})")
            # no step can run any more: stopping the ranks now (a hung one is killed after a grace) overlaps the
            # linger below instead of adding to the time to exit
            self.closer = threading.Thread(target=state.close_engine, name="trtbuild-close-engine", daemon=True)
            self.closer.start()
            if self.done.wait(FAILURE_LINGER_S):
                return
            self.server.should_exit = True
            if not self.done.wait(FORCE_EXIT_S):
                self.server.force_exit = True
            return


def run(server: DrainingServer, sockets: list[socket.socket] | None = None) -> None:
    """Serve until drained (returns) or until the engine fails (EngineFailedExit, exit 3); the engine is closed
    either way. `sockets`: already bound listening sockets (tests), else uvicorn binds config's host and port."""
    state = server.trtbuild
    watchdog = _Watchdog(server)
    watchdog.start()
    try:
        server.run(sockets=sockets)
        failed = watchdog.reason or state.engine_failure()
    except SystemExit as e:  # uvicorn exits (code 3) when it cannot bind
        options = state.options
        raise UserError(f"could not listen on {options.host}:{options.port} (in use?); choose another --port") from e
    finally:
        watchdog.done.set()
        watchdog.join(WATCH_INTERVAL_S + 1)
        if watchdog.closer is not None:  # its workers must be gone before this process exits
            watchdog.closer.join(CLOSE_TIMEOUT_S)
        state.close()
    if failed:
        raise EngineFailedExit(
            f"the engine failed: {failed}; exiting {EXIT_ENGINE_FAILED} so that the supervisor starts the group again"
        )


def serve(engine_dir: Path, options: ServeOptions) -> None:
    state = prepare(engine_dir, options)
    _request_log()
    app = create_app(state)
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=int(options.drain_timeout) + 10,  # never wait forever on an open connection
    )
    start_warm_up(state)
    spec, m = state.spec, state.spec.mapping
    ranks = f", {m.world_size} ranks: tp={m.tp_size} pp={m.pp_size}" if m.world_size > 1 else ""
    sc, speculating = options.speculation, ""
    if sc is not None:
        how = (
            f"n-gram [{sc.prompt_lookup_min}, {sc.prompt_lookup_max}]"
            if sc.method == "ngram"
            else f"draft {options.draft}"
        )
        speculating = f", speculating: {how}, k {sc.num_speculative_tokens}"
    console.info(
        f"serving {state.model_name!r} ({spec.architecture}, {spec.quant_algo}, {spec.backend}{ranks}{speculating}, "
        f"engine {(spec.manifest_sha256 or '?')[:12]}) on http://{options.host}:{options.port} "
        f"({'API keys required' if state.keyring else 'no API keys: loopback only'})"
    )
    console.info(state.tool_parser_note)
    run(DrainingServer(config, state))
