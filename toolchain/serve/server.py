"""`trtbuild serve`: check, load, listen, drain.

Before it accepts traffic the server refuses what it must not serve: a non-loopback address without API keys,
an engine directory that differs from its manifest (each changed file named), an engine that cannot run here.
It then listens at once (liveness answers) and warms the engine up in the background (readiness says no until
one real token came out).

Drain: the first SIGTERM or SIGINT makes /ready answer 503 and new requests 503, lets the requests in flight
finish for up to --drain-timeout seconds, cancels what is left, and exits 0; a second signal exits at once.
Kubernetes sends SIGTERM and waits terminationGracePeriodSeconds, which must exceed the drain timeout.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from toolchain import console
from toolchain.engine.api import load_tokenizer, open_engine
from toolchain.errors import UserError
from toolchain.serve.app import ServeOptions, ServerState, create_app, start_warm_up
from toolchain.serve.auth import read_keys


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


def prepare(engine_dir: Path, options: ServeOptions) -> ServerState:
    """Every check that may refuse to start, then the loaded engine (warm-up not started)."""
    if options.api_keys is None and not is_loopback(options.host):
        raise UserError(
            f"--host {options.host}: without --api-keys the server only listens on loopback (127.0.0.1, ::1); "
            "anyone who can reach it could use the engine. Pass --api-keys FILE to serve beyond this machine"
        )
    keys = read_keys(options.api_keys) if options.api_keys is not None else None
    if options.max_queue < 1 or options.request_timeout <= 0 or options.drain_timeout < 0:
        raise UserError("--max-queue >= 1, --request-timeout > 0 and --drain-timeout >= 0")
    engine = open_engine(engine_dir)  # refuses an engine that is not what its manifest says (exit 4)
    try:
        tokenizer: Any = load_tokenizer(engine_dir)
    except UserError as e:
        console.warn(f"{e}: serving token-id prompts only")
        tokenizer = None
    return ServerState(engine, tokenizer, options, keys)


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
    server = DrainingServer(config, state)
    start_warm_up(state)
    spec = state.spec
    console.info(
        f"serving {state.model_name!r} ({spec.architecture}, {spec.quant_algo}, {spec.backend}, engine "
        f"{(spec.manifest_sha256 or '?')[:12]}) on http://{options.host}:{options.port} "
        f"({'API keys required' if state.keyring else 'no API keys: loopback only'})"
    )
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits (code 3) when it cannot bind
        raise UserError(f"could not listen on {options.host}:{options.port} (in use?); choose another --port") from e
    finally:
        state.llm.close()
