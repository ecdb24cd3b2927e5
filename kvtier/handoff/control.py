"""The decode side's control verbs as the prefill side calls them: in process
(`LocalControl`, for library use and tests) or over the decode instance's HTTP
(`HttpControl`). Only control goes this way; block bytes go over a transport.

Internal HTTP endpoints of a decode instance (JSON bodies and answers):

    GET  /v1/handoff/info                -> {"role", "model", "transports", "block_size",
                                             "layout"}
    POST /internal/handoff/reserve       {"token_ids", "cache_salt", "transport"}
                                         -> {"handoff_id", "held", "offer", "timeout_s"}
    POST /internal/handoff/commit        {"handoff_id", "transport", "blocks", "last",
                                          "part"} -> {"accepted", "rejected", "timings"}
    POST /internal/handoff/abort         {"handoff_id"} -> {}

An unknown or expired handoff answers 404, a bad body 400, a transport the instance cannot
receive over 503.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import httpx

from kvtier.handoff.base import Json, TransportError
from kvtier.handoff.receiver import HandoffReceiver


class ControlError(OSError):
    """The decode instance refused a control call or could not be reached.

    status: the HTTP status it answered (None: unreachable or no answer in time).
    timed_out: the call ran out of time.
    """

    def __init__(self, message: str, status: int | None = None,
                 timed_out: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.timed_out = timed_out


class DecodeControl(ABC):
    """The verbs of `HandoffReceiver`, as a prefill instance reaches them."""

    @abstractmethod
    def info(self) -> Json:
        """The decode instance's /v1/handoff/info answer."""

    @abstractmethod
    def reserve(self, token_ids: Sequence[int], cache_salt: str | None,
                transport: str) -> Json:
        """See `HandoffReceiver.reserve`."""

    @abstractmethod
    def commit(self, handoff_id: str, transport: str, blocks: Sequence[Json],
               last: bool, part: int | None = None) -> Json:
        """See `HandoffReceiver.commit`. Thread-safe: a sender may have several commits
        under way (`part` numbers them)."""

    @abstractmethod
    def abort(self, handoff_id: str) -> None:
        """See `HandoffReceiver.abort`; never raises."""

    def close(self) -> None:
        """Release connections."""
        return None  # nothing by default


class LocalControl(DecodeControl):
    """A receiver in this process; errors become `ControlError` as over HTTP."""

    def __init__(self, receiver: HandoffReceiver, info: Json) -> None:
        self.receiver = receiver
        self._info = info

    def info(self) -> Json:
        return dict(self._info)

    def reserve(self, token_ids: Sequence[int], cache_salt: str | None,
                transport: str) -> Json:
        try:
            return self.receiver.reserve(token_ids, cache_salt, transport)
        except (ValueError, TransportError) as exc:
            raise ControlError(str(exc), 503 if isinstance(exc, TransportError) else 400) \
                from exc

    def commit(self, handoff_id: str, transport: str, blocks: Sequence[Json],
               last: bool, part: int | None = None) -> Json:
        try:
            return self.receiver.commit(handoff_id, blocks, last, transport, part)
        except KeyError as exc:
            raise ControlError(f"unknown handoff {handoff_id}", 404) from exc
        except (ValueError, TransportError) as exc:
            raise ControlError(str(exc), 400 if isinstance(exc, ValueError) else 502) from exc

    def abort(self, handoff_id: str) -> None:
        try:
            self.receiver.abort(handoff_id)
        except KeyError:
            pass


class HttpControl(DecodeControl):
    """A decode instance at `base_url` (e.g. "http://10.0.0.2:8000"). `timeout_s` bounds
    each call; `api_key` is sent as a bearer token. `client`: a shared `httpx.Client` whose
    connections are kept from one handoff to the next (a new client costs ~20 ms of
    certificate loading, and a new connection a round trip); None makes one for this
    control, closed by `close`. A call that fails on its connection (reset, or closed with
    no answer: a kept-alive connection the server dropped) is made once more; a timeout is
    not."""

    def __init__(self, base_url: str, timeout_s: float, api_key: str | None = None,
                 client: httpx.Client | None = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"the decode instance's URL must start with http:// or "
                             f"https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owned = client is None
        self._client = httpx.Client() if client is None else client

    def _call(self, method: str, path: str, body: Json | None = None) -> Json:
        for attempt in range(2):
            try:
                response = self._client.request(method, f"{self.base_url}{path}", json=body,
                                                headers=self._headers, timeout=self.timeout_s)
                break
            except httpx.TimeoutException as exc:
                raise ControlError(f"{self.base_url}{path} did not answer in time", None,
                                   timed_out=True) from exc
            except httpx.HTTPError as exc:
                # A connection failure goes once more on a fresh connection: a kept-alive one
                # the decode instance closed meanwhile fails at once (reset, or no answer). A
                # commit lost so would leave its posted send unreceived and an NCCL pair out
                # of step; a commit made twice is answered 404 the second time, which counts
                # its send.
                if attempt == 0 and isinstance(exc, httpx.TransportError):
                    continue
                raise ControlError(f"cannot reach the decode instance at {self.base_url}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            raise ControlError(f"{self.base_url}{path} answered {response.status_code}: "
                               f"{message}", response.status_code)
        try:
            return response.json()
        except ValueError as exc:
            raise ControlError(f"{self.base_url}{path} answered no JSON", 200) from exc

    def info(self) -> Json:
        return self._call("GET", "/v1/handoff/info")

    def reserve(self, token_ids: Sequence[int], cache_salt: str | None,
                transport: str) -> Json:
        return self._call("POST", "/internal/handoff/reserve",
                          {"token_ids": list(token_ids), "cache_salt": cache_salt,
                           "transport": transport})

    def commit(self, handoff_id: str, transport: str, blocks: Sequence[Json],
               last: bool, part: int | None = None) -> Json:
        return self._call("POST", "/internal/handoff/commit",
                          {"handoff_id": handoff_id, "transport": transport,
                           "blocks": list(blocks), "last": last, "part": part})

    def abort(self, handoff_id: str) -> None:
        try:
            self._call("POST", "/internal/handoff/abort", {"handoff_id": handoff_id})
        except ControlError:
            pass

    def close(self) -> None:
        if self._owned:
            self._client.close()
