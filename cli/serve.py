"""`kvtier serve`: the engine behind an OpenAI-compatible HTTP API.

    kvtier serve smollm2-135m --port 8000 --api-key secret

The model comes as vLLM's `serve` takes it (a positional MODEL) or as `--model`; the model
and cache options are those of `kvtier generate` (same names, defaults and checks: the
command takes them from `generate`'s signature). The port is bound before the model loads,
so a busy port fails at once. SIGINT / SIGTERM stop the server gracefully: no new
connection is taken, requests in flight finish; those still running after
--shutdown-timeout seconds are aborted, their streams ending with an error event and
`[DONE]`; the host tier is flushed to disk before the process exits. If the engine thread
ever fails, /health says so and the process exits with status 1, for a supervisor to
restart it.
"""

from __future__ import annotations

import errno
import gc
import inspect
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from kvtier.cli import generate as generate_command
from kvtier.cli.server.protocol import SERVER_KEEPALIVE_S, ServerLimits
from kvtier.engine.async_llm import AsyncLLM
from kvtier.engine.llm import LLM

from kvtier.handoff.config import HandoffConfig

log = logging.getLogger("kvtier.serve")

#: Seconds the streams aborted at the end of --shutdown-timeout get to write their last
#: event before uvicorn closes what is left.
_ABORT_GRACE_S = 5.0
_LIMITS = ServerLimits()

#: The options of `kvtier generate` that `kvtier serve` shares: `engine_options`' parameters.
ENGINE_OPTION_NAMES = tuple(inspect.signature(generate_command.engine_options).parameters)


def serve(
    model_tag: str | None = typer.Argument(
        None, metavar="MODEL", show_default=False,
        help="The model, as for --model (vLLM's positional form)."),
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
    max_body_bytes: int = typer.Option(
        _LIMITS.max_body_bytes, "--max-body-bytes", help="Largest request body (413 beyond)."),
    max_prompt_chars: int = typer.Option(
        _LIMITS.max_prompt_chars, "--max-prompt-chars",
        help="Characters of a prompt, or of a chat's messages together."),
    max_messages: int = typer.Option(_LIMITS.max_messages, "--max-messages",
                                     help="Messages of one chat request."),
    max_stop: int = typer.Option(_LIMITS.max_stop, "--max-stop",
                                 help="Stop strings (and stop token ids) of one request."),
    max_stop_chars: int = typer.Option(_LIMITS.max_stop_chars, "--max-stop-chars",
                                       help="Characters of one stop string."),
    max_n: int = typer.Option(_LIMITS.max_n, "--max-n", help="Completions per request (n)."),
    max_logprobs: int = typer.Option(_LIMITS.max_logprobs, "--max-logprobs",
                                     help="Most likely tokens returned per position."),
    role: str = typer.Option(
        "both", "--role", help="both: prefill and decode here (the default); prefill: "
        "compute prompts and hand their KV to a decode instance (POST /v1/handoff/prefill); "
        "decode: receive KV and generate."),
    handoff_mooncake: str = typer.Option(
        "auto", "--handoff-mooncake", help="Address this instance's Mooncake Transfer "
        "Engine is reached at; 'auto': 127.0.0.1 with --role prefill/decode when Mooncake "
        "is installed; 'off'."),
    handoff_mooncake_protocol: str = typer.Option(
        "tcp", "--handoff-mooncake-protocol", help="Mooncake transport: tcp or rdma."),
    handoff_mooncake_device: str = typer.Option(
        "", "--handoff-mooncake-device", help="RDMA NICs for Mooncake (rdma only)."),
    handoff_mooncake_slots: int = typer.Option(
        64, "--handoff-mooncake-slots", help="Blocks the Mooncake receive buffer holds."),
    handoff_redis: str | None = typer.Option(
        None, "--handoff-redis", help="redis://host:port this (decode) instance receives "
        "handoffs through (a prefill instance uses the one the decode instance names)."),
    handoff_nccl: str | None = typer.Option(
        None, "--handoff-nccl", help="tcp://host:port rendezvous of the torch.distributed "
        "pair (one prefill and one decode instance; NCCL on GPUs)."),
    handoff_nccl_backend: str | None = typer.Option(
        None, "--handoff-nccl-backend", help="nccl, or gloo for CPU tensors (default: nccl "
        "with CUDA, else gloo)."),
    handoff_cuda_ipc: str = typer.Option(
        "auto", "--handoff-cuda-ipc", help="Hand over through CUDA IPC between GPUs of this "
        "host (copy engines write the blocks; each process must see both GPUs): on, off, or "
        "auto (the default: on with --role prefill/decode on a CUDA device; used only where "
        "the prefill instance sees the decode instance's GPU)."),
    handoff_cuda_ipc_mib: int = typer.Option(
        2048, "--handoff-cuda-ipc-mib", help="MiB of the decode instance's receive buffer "
        "for CUDA IPC handoffs (GPU memory; a handoff borrows at most a quarter of it)."),
    handoff_timeout: float = typer.Option(
        30.0, "--handoff-timeout", help="Seconds a decode instance's handoff waits for its "
        "next block before it expires (what landed stays cached)."),
    handoff_hold: float = typer.Option(
        60.0, "--handoff-hold", help="Seconds handed-over blocks are kept from eviction "
        "waiting for their request."),
    handoff_batch: int = typer.Option(
        32, "--handoff-batch", help="Blocks per send and commit over Redis (more: fewer "
        "round trips, more memory in flight)."),
    handoff_nccl_group_mib: int = typer.Option(
        256, "--handoff-nccl-group-mib", help="MiB of KV per send and commit over NCCL "
        "(more: fewer round trips and checksum passes, more GPU memory in flight on both "
        "instances)."),
    handoff_nccl_in_flight: int = typer.Option(
        2, "--handoff-nccl-in-flight", help="Sends over NCCL that may await their commits "
        "(more than one: the next group moves while the last one's commit is answered; each "
        "holds a group of GPU memory on both instances)."),
    **engine: Any,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, metrics)."""
    import uvicorn
    from kvtier.cli.server.app import build_app
    from kvtier.cli.server.handoff import HandoffService

    if not 0 <= port <= 65535:
        raise ValueError(f"--port must lie in [0, 65535], got {port}")
    if max_num_requests < 1:
        raise ValueError(f"--max-num-requests must be at least 1, got {max_num_requests}")
    if shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}")
    handoff_config = handoff_settings(
        role, handoff_mooncake, handoff_mooncake_protocol, handoff_mooncake_device,
        handoff_mooncake_slots, handoff_redis, handoff_nccl, handoff_nccl_backend,
        handoff_timeout, handoff_hold, handoff_batch, handoff_nccl_group_mib,
        handoff_nccl_in_flight, handoff_cuda_ipc, handoff_cuda_ipc_mib)
    limits = ServerLimits(max_body_bytes=max_body_bytes, max_prompt_chars=max_prompt_chars,
                          max_messages=max_messages, max_stop=max_stop,
                          max_stop_chars=max_stop_chars, max_n=max_n,
                          max_logprobs=max_logprobs)
    if model_tag is not None:
        if engine.get("model") not in (None, model_tag):
            raise ValueError(f"the model is given twice ({model_tag!r} and --model "
                             f"{engine['model']!r}); give it once")
        engine["model"] = model_tag
    options = generate_command.engine_options(**engine)
    sock = bind(host, port)  # before the model loads: a busy port fails at once
    typer.echo(f"kvtier serve: loading the model on http://{host}:{sock.getsockname()[1]} "
               "...", err=True)
    with sock, LLM(**options) as llm:
        name = served_model_name or llm.config.model
        engine_front = AsyncLLM(llm, max_num_requests=max_num_requests)
        handoff = None
        try:
            handoff = HandoffService(engine_front, handoff_config, api_key)
            app = build_app(engine_front, name, api_key=api_key, limits=limits,
                            handoff=handoff)
            config = uvicorn.Config(app, log_level=log_level,
                                    timeout_keep_alive=int(SERVER_KEEPALIVE_S),
                                    timeout_graceful_shutdown=shutdown_timeout
                                    + _ABORT_GRACE_S)
            server = _server_class()(config, engine_front, shutdown_timeout)
            threading.Thread(target=_exit_if_engine_fails, args=(engine_front, server),
                             name="kvtier-engine-watch", daemon=True).start()
            typer.echo(f"kvtier serve: serving {name!r} (role {role}"
                       + (f", handoff over {', '.join(handoff.transport_names())}"
                          if role != "both" else "") + ")", err=True)
            settle_heap()
            with _stop_signals_return():
                server.run(sockets=[sock])
        finally:
            # The HTTP server has stopped: abort whatever is left, then stop the engine
            # thread; leaving the `with` closes the LLM, which flushes the host tier to disk.
            if handoff is not None:
                handoff.close()
            engine_front.shutdown()
            typer.echo("kvtier serve: flushing the KV cache tiers and exiting", err=True)
        failure = engine_front.failure
    if failure is not None:
        typer.echo(f"error: the engine failed ({type(failure).__name__}: {failure}); "
                   "exiting with status 1 so that a supervisor restarts the server", err=True)
        raise typer.Exit(1)


def settle_heap() -> None:
    """Collect, then freeze everything alive (`gc.freeze`): the objects made at start
    (torch, transformers, the model and the engine) are never scanned again. Python's first
    full collection while serving otherwise scans them all, holding the GIL, so every
    request under way stalls that long (docs/BENCHMARKS.md, "Figures behind the engine's
    constants")."""
    gc.collect()
    gc.freeze()


def handoff_settings(role: str, mooncake: str, mooncake_protocol: str, mooncake_device: str,
                     mooncake_slots: int, redis_url: str | None, nccl: str | None,
                     nccl_backend: str | None, timeout_s: float, hold_s: float,
                     batch: int = 32, nccl_group_mib: int = 256,
                     nccl_in_flight: int = 2, cuda_ipc: str = "auto",
                     cuda_ipc_mib: int = 2048) -> HandoffConfig:
    """The `HandoffConfig` of serve's --role and --handoff-* options; ValueError saying
    which option is wrong."""
    from kvtier.handoff.mooncake import mooncake_available

    if mooncake == "auto":
        mooncake_host = "127.0.0.1" if role in ("prefill", "decode") \
            and mooncake_available() is None else None
    elif mooncake == "off":
        mooncake_host = None
    else:
        missing = mooncake_available()
        if missing is not None:
            raise ValueError(f"--handoff-mooncake {mooncake}: {missing}")
        mooncake_host = mooncake
    choices = {"auto": None, "on": True, "off": False}
    if cuda_ipc not in choices:
        raise ValueError(f"--handoff-cuda-ipc must be auto, on or off, got {cuda_ipc!r}")
    if redis_url is not None and not redis_url.startswith(("redis://", "rediss://")):
        raise ValueError(f"--handoff-redis must be a redis:// or rediss:// URL, got "
                         f"{redis_url!r}")
    return HandoffConfig(role=role, mooncake_host=mooncake_host,
                         mooncake_protocol=mooncake_protocol,
                         mooncake_device=mooncake_device, mooncake_slots=mooncake_slots,
                         redis_url=redis_url, nccl_init=nccl, nccl_backend=nccl_backend,
                         timeout_s=timeout_s, hold_s=hold_s, batch=batch,
                         nccl_group_mib=nccl_group_mib, nccl_in_flight=nccl_in_flight,
                         cuda_ipc=choices[cuda_ipc], cuda_ipc_mib=cuda_ipc_mib)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; OSError saying what to do when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, so that the accepted connections carry it and asyncio turns
    # Nagle's algorithm off on them: otherwise a response written in two pieces (headers,
    # body) waits for the client's delayed ACK, on every request and SSE chunk
    # (docs/BENCHMARKS.md, "Figures behind the engine's constants").
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(exc.errno, f"port {port} on {host} is already in use; stop what "
                          "listens there or pick another --port") from None
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _server_class() -> type:
    """uvicorn's Server class with the shutdown below (uvicorn is imported only to serve)."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that, `abort_after_s` into a graceful shutdown, aborts the
        requests still running: their streams end with an error event and `[DONE]` while
        uvicorn still waits for them, instead of being cut."""

        def __init__(self, config: Any, engine: AsyncLLM, abort_after_s: float) -> None:
            super().__init__(config)
            self.engine = engine
            self.abort_after_s = abort_after_s

        async def shutdown(self, sockets: Any = None) -> None:
            timer = threading.Timer(self.abort_after_s, self.engine.shutdown)
            timer.daemon = True
            timer.start()
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server


def _exit_if_engine_fails(engine: AsyncLLM, server: Any) -> None:
    """Stop the HTTP server once the engine thread has failed (serve then exits 1)."""
    engine.wait_ended()
    if engine.failure is not None:
        log.error("the engine thread failed; stopping the server", exc_info=engine.failure)
        server.should_exit = True


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
