"""The instances behind `kvtier router`: what each one is (its role and model, asked once at
start), how many requests it holds now, and which one takes the next request.

A request goes to the instance of the wanted role with the fewest requests in flight; ties
go round in turn, so that an idle pool shares sequential requests evenly. An instance that
failed a request (unreachable, timed out, a 5xx) is passed over for `down_for_s` seconds
while another instance of its role is up, so that a dead prefill instance does not cost
every request a failed connection; a pool whose instances are all down still tries them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

#: The roles of `kvtier serve --role`.
ROLES = ("both", "prefill", "decode")
#: Which instance roles may take each router part: a prefill instance computes prompts, a
#: decode instance generates; `both` does either, and whole requests in colocated mode.
ACCEPTED_ROLES = {"prefill": ("prefill", "both"), "decode": ("decode", "both"),
                  "both": ("both",)}


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """`GET /v1/handoff/info` of one instance (HTTP contract of the roles)."""

    role: str
    model: str
    transports: tuple[str, ...]
    block_size: int | None
    layout: str | None
    has_handoff: bool = True  # False: no /v1/handoff routes (whole requests only)

    @classmethod
    def from_json(cls, data: Any, url: str) -> InstanceInfo:
        if not isinstance(data, dict) or data.get("role") not in ROLES \
                or not isinstance(data.get("model"), str):
            raise ValueError(f"{url}/v1/handoff/info answered {str(data)[:200]!r}, not a "
                             "kvtier instance's role and model; is it `kvtier serve`?")
        return cls(data["role"], data["model"], tuple(data.get("transports") or ()),
                   data.get("block_size"), data.get("layout"))


@dataclass(slots=True)
class Instance:
    """One instance: its base URL, what it said it is, and its live load."""

    url: str
    part: str  # the router part it serves: "prefill", "decode" or "both"
    info: InstanceInfo
    num_in_flight: int = 0
    last_picked: int = -1
    down_until: float = 0.0
    num_failures: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "part": self.part, "role": self.info.role,
                "in_flight": self.num_in_flight, "failures": self.num_failures,
                "down": self.down_until > time.monotonic()}


@dataclass(slots=True)
class InstancePool:
    """The instances serving one router part, and the picking policy over them."""

    instances: list[Instance]
    down_for_s: float
    _turns: Iterator[int] = field(default_factory=itertools.count)

    def pick(self, exclude: Sequence[Instance] = ()) -> Instance | None:
        """The instance to send the next request to (None when every one is excluded):
        instances up before those down, then the fewest in flight, then the longest unpicked."""
        now = time.monotonic()
        candidates = [i for i in self.instances if all(i is not e for e in exclude)]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda i: (i.down_until > now, i.num_in_flight,
                                                i.last_picked))
        chosen.last_picked = next(self._turns)
        return chosen

    def least_loaded(self) -> Instance:
        """The instance with the fewest requests in flight among those up (all of them when
        every one is down), without picking it."""
        now = time.monotonic()
        return min(self.instances, key=lambda i: (i.down_until > now, i.num_in_flight))

    @contextmanager
    def holding(self, instance: Instance) -> Iterator[Instance]:
        """Count a request in flight on `instance` for the duration of the block."""
        instance.num_in_flight += 1
        try:
            yield instance
        finally:
            instance.num_in_flight -= 1

    def failed(self, instance: Instance) -> None:
        """`instance` failed a request: pass it over for a while."""
        instance.num_failures += 1
        instance.down_until = time.monotonic() + self.down_for_s

    def succeeded(self, instance: Instance) -> None:
        instance.down_until = 0.0


async def fetch_info(client: httpx.AsyncClient, url: str, part: str) -> InstanceInfo:
    """What the instance at `url` is. An instance without /v1/handoff/info (a `kvtier
    serve` of before the roles, or another OpenAI-compatible server) counts as role "both"
    serving the model its /v1/models names. Raises ValueError saying what to do when it
    cannot be reached or does not answer as an instance."""
    option = f"--{part}"
    try:
        response = await client.get(f"{url}/v1/handoff/info")
        if response.status_code == 404:
            models = await client.get(f"{url}/v1/models")
            models.raise_for_status()
            name = models.json()["data"][0]["id"]
            return InstanceInfo("both", name, (), None, None, has_handoff=False)
        response.raise_for_status()
        return InstanceInfo.from_json(response.json(), url)
    except httpx.HTTPStatusError as exc:
        raise ValueError(f"the {option} instance at {url} answered HTTP "
                         f"{exc.response.status_code} to {exc.request.url.path}: "
                         f"{exc.response.text[:200]}; check the URL (and --instance-api-key)"
                         ) from None
    except httpx.TransportError as exc:
        raise ValueError(f"cannot reach the {option} instance at {url} "
                         f"({type(exc).__name__}: {exc or 'no answer'}); start it or fix "
                         "the URL") from None
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"the {option} instance at {url} did not answer as a kvtier "
                         f"instance ({exc}); is it `kvtier serve`?") from None


def check_urls(urls: Sequence[str], option: str) -> list[str]:
    """The base URLs without a trailing slash; ValueError for one that is not http(s)."""
    cleaned = []
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{option} takes a base URL such as http://127.0.0.1:8000, got "
                             f"{url!r}")
        cleaned.append(url.rstrip("/"))
    if len(set(cleaned)) != len(cleaned):
        raise ValueError(f"{option} names the same instance twice ({', '.join(cleaned)})")
    return cleaned


async def discover(client: httpx.AsyncClient, parts: dict[str, list[str]],
                   transport: str | None) -> dict[str, list[Instance]]:
    """Ask every instance what it is (concurrently) and check that they fit together: each
    one's role serves its part, all serve one model, and prefill and decode instances share
    a block layout and a transport. ValueError naming the instance and the fix otherwise."""
    pairs = [(part, url) for part, urls in parts.items() for url in urls]
    infos = await asyncio.gather(*(fetch_info(client, url, part) for part, url in pairs))
    found: dict[str, list[Instance]] = {part: [] for part in parts}
    for (part, url), info in zip(pairs, infos):
        if part != "both" and not info.has_handoff:
            raise ValueError(f"the --{part} instance at {url} has no /v1/handoff/info: it "
                             "cannot hand KV over; start it with `kvtier serve --role "
                             f"{part}` of this kvtier version")
        if info.role not in ACCEPTED_ROLES[part]:
            raise ValueError(f"the --{part} instance at {url} has role {info.role!r}; "
                             f"--{part} takes instances started with `kvtier serve --role "
                             f"{' or --role '.join(ACCEPTED_ROLES[part])}`")
        found[part].append(Instance(url, part, info))
    instances = [i for group in found.values() for i in group]
    models = {i.info.model for i in instances}
    if len(models) > 1:
        listing = ", ".join(f"{i.url} serves {i.info.model!r}" for i in instances)
        raise ValueError(f"the instances serve different models ({listing}); start them "
                         "with one model (and one --served-model-name)")
    if found.get("prefill") and found.get("decode"):
        _check_handoff_pairs(found["prefill"], found["decode"], transport)
    return found


def _check_handoff_pairs(prefills: list[Instance], decodes: list[Instance],
                         transport: str | None) -> None:
    for prefill in prefills:
        for decode in decodes:
            for name in ("block_size", "layout"):
                mine, theirs = getattr(prefill.info, name), getattr(decode.info, name)
                if mine != theirs:
                    raise ValueError(f"the prefill instance {prefill.url} has {name} {mine!r} "
                                     f"and the decode instance {decode.url} {theirs!r}; a "
                                     "handoff needs both started with the same model, dtype "
                                     "and block size")
            shared = set(prefill.info.transports) & set(decode.info.transports)
            if transport is not None and transport not in shared:
                raise ValueError(f"--transport {transport} is not offered by both "
                                 f"{prefill.url} ({', '.join(prefill.info.transports) or 'none'})"
                                 f" and {decode.url} "
                                 f"({', '.join(decode.info.transports) or 'none'})")
            if not shared:
                raise ValueError(f"the prefill instance {prefill.url} and the decode instance "
                                 f"{decode.url} share no transport ({prefill.info.transports} "
                                 f"against {decode.info.transports}); start them with one "
                                 "in common")
