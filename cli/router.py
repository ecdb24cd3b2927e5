"""`kvtier router`: one OpenAI-compatible front over prefill and decode instances.

    kvtier serve MODEL --role prefill --port 8100 --handoff-nccl tcp://127.0.0.1:29500 &
    kvtier serve MODEL --role decode --port 8200 --handoff-nccl tcp://127.0.0.1:29500 &
    kvtier router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Every request's prompt is computed on a prefill instance, which hands its KV blocks to the
decode instance that then generates the answer (cli/server/router_app.py). `--both URL`
instead sends whole requests to `kvtier serve` instances of role both (colocated serving,
for comparison). At start the router asks every instance what it is
(`GET /v1/handoff/info`) and stops with a clear error when one cannot be reached, has the
wrong role, or serves another model.
"""

from __future__ import annotations

import asyncio
from typing import Any

import typer
from kvtier.cli.server.protocol import SERVER_KEEPALIVE_S, ServerLimits
from kvtier.cli.server.router_app import RouterSettings

_SETTINGS = RouterSettings()
_LIMITS = ServerLimits()


def router(
    prefill: list[str] = typer.Option(
        [], "--prefill", metavar="URL",
        help="Base URL of a `kvtier serve --role prefill` instance (repeat for several)."),
    decode: list[str] = typer.Option(
        [], "--decode", metavar="URL",
        help="Base URL of a `kvtier serve --role decode` instance (repeat for several)."),
    both: list[str] = typer.Option(
        [], "--both", metavar="URL",
        help="Base URL of a `kvtier serve` instance of role both: colocated serving, whole "
        "requests to one instance (repeat for several; not with --prefill/--decode)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="TCP port to listen on."),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="KVTIER_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1/* (also $KVTIER_API_KEY)."),
    instance_api_key: str | None = typer.Option(
        None, "--instance-api-key", envvar="KVTIER_INSTANCE_API_KEY",
        help="API key the instances were started with (also $KVTIER_INSTANCE_API_KEY)."),
    transport: str | None = typer.Option(
        None, "--transport", help="Handoff transport asked of the prefill instances "
        "(cuda_ipc, nccl, mooncake, redis; default: the best both instances have)."),
    connect_timeout: float = typer.Option(
        _SETTINGS.connect_timeout_s, "--connect-timeout",
        help="Seconds to open a connection to an instance."),
    prefill_timeout: float = typer.Option(
        _SETTINGS.prefill_timeout_s, "--prefill-timeout",
        help="Seconds a handoff (prefill and transfer) may take before the request goes to "
        "another prefill instance, or to the decode instance to compute itself."),
    decode_timeout: float = typer.Option(
        _SETTINGS.decode_timeout_s, "--decode-timeout",
        help="Seconds to wait for a decode instance's first byte, and between two bytes."),
    down_for: float = typer.Option(
        _SETTINGS.down_for_s, "--down-for",
        help="Seconds an instance that failed a request is passed over."),
    prefill_queue_limit: int | None = typer.Option(
        None, "--prefill-queue-limit", metavar="N",
        help="Requests a prefill instance may hold (computing or queued) before the router "
        "has the decode instance compute the next prompt itself, so that a burst spills "
        "onto the decode GPUs instead of queueing (default: no limit)."),
    max_body_bytes: int = typer.Option(
        _LIMITS.max_body_bytes, "--max-body-bytes", help="Largest request body (413 beyond)."),
    shutdown_timeout: float = typer.Option(
        30.0, "--shutdown-timeout", help="Seconds requests in flight get to finish on "
        "SIGINT / SIGTERM."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level."),
) -> None:
    """Route OpenAI-compatible requests over prefill and decode instances (or colocated)."""
    import uvicorn
    from kvtier.cli.serve import _stop_signals_return, bind, settle_heap
    from kvtier.cli.server.router_app import build_router_app

    if both and (prefill or decode):
        raise ValueError("give either --both (colocated) or --prefill and --decode "
                         "(disaggregated), not both kinds")
    if not both and not (prefill and decode):
        raise ValueError("give at least one --prefill and one --decode instance (or --both "
                         "instances for colocated serving)")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must lie in [0, 65535], got {port}")
    if prefill_queue_limit is not None and both:
        raise ValueError("--prefill-queue-limit applies to --prefill/--decode instances; "
                         "colocated (--both) instances compute every prompt themselves")
    if shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}")
    settings = RouterSettings(connect_timeout_s=connect_timeout,
                              prefill_timeout_s=prefill_timeout,
                              decode_timeout_s=decode_timeout, down_for_s=down_for,
                              transport=transport, instance_api_key=instance_api_key,
                              prefill_queue_limit=prefill_queue_limit,
                              limits=ServerLimits(max_body_bytes=max_body_bytes))
    parts = {"both": both} if both else {"prefill": prefill, "decode": decode}
    pools, cards = asyncio.run(connect(parts, settings))
    sock = bind(host, port)
    app = build_router_app(pools, cards, settings, api_key=api_key)
    summary = ", ".join(f"{len(pool.instances)} {part}" for part, pool in pools.items())
    typer.echo(f"kvtier router: serving {cards[0]['id']!r} on "
               f"http://{host}:{sock.getsockname()[1]} over {summary}", err=True)
    config = uvicorn.Config(app, log_level=log_level,
                            timeout_keep_alive=int(SERVER_KEEPALIVE_S),
                            timeout_graceful_shutdown=shutdown_timeout)
    settle_heap()
    with sock, _stop_signals_return():
        uvicorn.Server(config).run(sockets=[sock])


async def connect(parts: dict[str, list[str]], settings: RouterSettings
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The instance pools of `parts` (part -> URLs) once every instance answered what it is
    and they fit together, and the model cards the first decoding instance serves.
    ValueError saying what to do otherwise."""
    import httpx
    from kvtier.cli.server.instances import InstancePool, check_urls, discover

    headers = {}
    if settings.instance_api_key:
        headers["authorization"] = f"Bearer {settings.instance_api_key}"
    urls = {part: check_urls(given, f"--{part}") for part, given in parts.items()}
    timeout = httpx.Timeout(30.0, connect=settings.connect_timeout_s)
    async with httpx.AsyncClient(headers=headers, timeout=timeout) as client:
        found = await discover(client, urls, settings.transport)
        first = found["both" if "both" in found else "decode"][0]
        answer = await client.get(f"{first.url}/v1/models")
        if answer.status_code != 200:
            raise ValueError(f"GET {first.url}/v1/models answered {answer.status_code}: "
                             f"{answer.text[:200]}")
        cards = answer.json()["data"]
    pools = {part: InstancePool(instances, settings.down_for_s)
             for part, instances in found.items()}
    return pools, cards
