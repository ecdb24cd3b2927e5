"""`kvtier serve`: the engine behind an OpenAI-compatible HTTP API.

    kvtier serve --model smollm2-135m --port 8000 --api-key secret

The model and cache options are those of `kvtier generate` (same names, defaults and
checks: the command takes them from `generate`'s signature). SIGINT / SIGTERM stop the
server gracefully: no new connection is taken, requests in flight finish (those still
running after --shutdown-timeout seconds are aborted), and the host tier is flushed to disk
before the process exits.
"""

from __future__ import annotations

import inspect
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from kvtier.cli import generate as generate_command
from kvtier.engine.async_llm import AsyncLLM
from kvtier.engine.llm import LLM

#: The options of `kvtier generate` that `kvtier serve` shares: `engine_options`' parameters.
ENGINE_OPTION_NAMES = tuple(inspect.signature(generate_command.engine_options).parameters)


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="TCP port to listen on."),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="KVTIER_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1/* (also $KVTIER_API_KEY)."),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Model name clients send (default: the --model)."),
    max_num_requests: int = typer.Option(
        256, "--max-num-requests", help="Requests held at once; more get HTTP 503."),
    shutdown_timeout: float = typer.Option(
        30.0, "--shutdown-timeout", help="Seconds in-flight requests get to finish on "
        "SIGINT / SIGTERM before they are aborted."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level."),
    **engine: Any,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, metrics)."""
    import uvicorn
    from kvtier.cli.server.app import build_app

    if not 0 <= port <= 65535:
        raise ValueError(f"--port must lie in [0, 65535], got {port}")
    if max_num_requests < 1:
        raise ValueError(f"--max-num-requests must be at least 1, got {max_num_requests}")
    if shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}")
    options = generate_command.engine_options(**engine)
    with LLM(**options) as llm:
        name = served_model_name or llm.config.model
        engine_front = AsyncLLM(llm, max_num_requests=max_num_requests)
        try:
            app = build_app(engine_front, name, api_key=api_key)
            config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                    timeout_graceful_shutdown=shutdown_timeout)
            with _stop_signals_return():
                uvicorn.Server(config).run()
        finally:
            # The HTTP server has stopped: abort whatever is left, then stop the engine
            # thread; leaving the `with` closes the LLM, which flushes the host tier to disk.
            engine_front.shutdown()
            typer.echo("kvtier serve: flushing the KV cache tiers and exiting", err=True)


class _StopSignal(Exception):
    """SIGINT or SIGTERM arrived (uvicorn raises it again once it has shut down)."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _StopSignal(signum)


@contextmanager
def _stop_signals_return() -> Iterator[None]:
    """Run uvicorn so that SIGINT / SIGTERM end it and then return normally.

    uvicorn catches the signal, shuts down gracefully, and raises the signal again; by
    default SIGTERM would then kill the process before the host tier is flushed. Here that
    second delivery raises `_StopSignal`, which ends this block quietly.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except _StopSignal:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _with_generate_options(command: Any) -> Any:
    """Give `command` (which takes **engine) `generate`'s engine options as parameters, so
    typer shows and parses them exactly as for `kvtier generate`."""
    source = inspect.signature(generate_command.generate, eval_str=True).parameters
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    shared = [source[name].replace(kind=inspect.Parameter.KEYWORD_ONLY)
              for name in ENGINE_OPTION_NAMES]
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
    command.__signature__ = inspect.Signature(own + shared)
    command.__annotations__ = {p.name: p.annotation for p in own + shared}
    return command


serve = _with_generate_options(serve)
