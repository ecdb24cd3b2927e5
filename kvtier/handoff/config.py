"""The handoff's settings (`kvtier serve --role ... --handoff-*`) and the transports they
open."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.util import find_spec

import torch

from kvtier.handoff.base import HandoffTransport
from kvtier.layout import KVLayout

log = logging.getLogger("kvtier.handoff")

ROLES = ("both", "prefill", "decode")
#: The order a handoff picks a transport in when the request names none: the fastest first.
PREFERENCE = ("cuda_ipc", "nccl", "mooncake", "redis")


@dataclass(frozen=True, slots=True)
class HandoffConfig:
    """role: "both" (today's serve), "prefill" or "decode".
    mooncake_host: the address this instance's Mooncake engine is reached at (None: no
        Mooncake). mooncake_protocol / mooncake_device: "tcp" and "", or "rdma" and NICs.
    mooncake_slots: record slots of the receive buffer; mooncake_ring: slots lent to one
        handoff (and blocks per write and commit).
    redis_url: the Redis this instance receives handoffs through (a prefill instance sends
        to whichever Redis the decode instance offers, with or without it).
    nccl_init: the rendezvous of the torch.distributed pair, e.g. "tcp://10.0.0.1:29500"
        (None: no NCCL); nccl_backend: "nccl", or "gloo" for CPU tensors (None: nccl with
        CUDA, else gloo).
    cuda_ipc: CUDA IPC between GPUs of one host (`kvtier.handoff.cuda_ipc`): True, False,
        or None (the default): on for role prefill or decode on a CUDA device
        (`uses_cuda_ipc`). A prefill instance uses it only with a decode instance whose GPU
        it can see. cuda_ipc_mib: the decode side's receive buffer for it, in MiB.
    timeout_s: seconds a decode instance's reservation waits for its next commit before it
        expires. hold_s: seconds handed-over blocks are kept from eviction waiting for their
        request. batch: blocks per send and commit over Redis. nccl_group_mib: MiB of
        payloads per send and commit over NCCL (at least one block). nccl_in_flight: sends
        over NCCL that may await their commits.
    Raises ValueError for a bad value.
    """

    role: str = "both"
    mooncake_host: str | None = None
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    mooncake_slots: int = 64
    mooncake_ring: int = 16
    redis_url: str | None = None
    nccl_init: str | None = None
    nccl_backend: str | None = None
    cuda_ipc: bool | None = None
    cuda_ipc_mib: int = 2048
    timeout_s: float = 30.0
    hold_s: float = 60.0
    batch: int = 32
    nccl_group_mib: int = 256
    nccl_in_flight: int = 2

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"--handoff-timeout must be > 0 seconds, got {self.timeout_s}")
        if not self.hold_s >= 0:
            raise ValueError(f"--handoff-hold must be >= 0 seconds, got {self.hold_s}")
        for name in ("mooncake_slots", "mooncake_ring", "batch", "nccl_group_mib",
                     "nccl_in_flight", "cuda_ipc_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"handoff setting {name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ValueError(f"--handoff-mooncake-protocol must be tcp or rdma, got "
                             f"{self.mooncake_protocol!r}")
        if self.nccl_backend not in (None, "nccl", "gloo"):
            raise ValueError(f"--handoff-nccl-backend must be nccl or gloo, got "
                             f"{self.nccl_backend!r}")
        if self.nccl_init is not None and self.role == "both":
            raise ValueError("--handoff-nccl pairs one prefill and one decode instance; give "
                             "it with --role prefill or --role decode")

    def uses_cuda_ipc(self, device: torch.device | None) -> bool:
        """Whether an instance on `device` hands over through CUDA IPC."""
        if self.cuda_ipc is None:
            return self.role != "both" and device is not None and device.type == "cuda"
        return self.cuda_ipc

    @property
    def receives(self) -> bool:
        return self.role in ("both", "decode")

    @property
    def sends(self) -> bool:
        return self.role in ("both", "prefill")


def open_transports(config: HandoffConfig, layout: KVLayout,
                    device: torch.device | None = None) -> dict[str, HandoffTransport]:
    """The transports `config` turns on, by name, for an engine on `device` (None: the
    current CUDA device where there is one). Redis is there to send with on every sending
    instance where redis-py is installed. Raises ValueError for a setting that cannot work
    here (Mooncake not installed, NCCL or CUDA IPC without CUDA), TransportError when an
    engine does not start."""
    transports: dict[str, HandoffTransport] = {}
    try:
        if config.mooncake_host is not None:
            from kvtier.handoff.mooncake import MooncakeTransport

            transports["mooncake"] = MooncakeTransport(
                layout, config.mooncake_host, config.mooncake_protocol, config.mooncake_device,
                config.mooncake_slots, config.mooncake_ring)
        # A sending instance can use whatever Redis a decode instance offers, given redis-py.
        if config.redis_url is not None or (config.sends and find_spec("redis") is not None):
            from kvtier.handoff.redis import RedisTransport

            transports["redis"] = RedisTransport(
                layout, config.redis_url if config.receives else None, batch=config.batch,
                timeout_s=config.timeout_s)
        if config.uses_cuda_ipc(device):
            from kvtier.handoff.cuda_ipc import CudaIpcTransport

            if device is None or device.type != "cuda":
                raise ValueError("--handoff-cuda-ipc on needs an engine on a CUDA device")
            transports["cuda_ipc"] = CudaIpcTransport(
                layout, device, receive_bytes=config.cuda_ipc_mib << 20,
                turn_timeout_s=config.timeout_s)
        if config.nccl_init is not None:
            from kvtier.handoff.torch_dist import DECODE_RANK, PREFILL_RANK, TorchDistTransport

            backend = config.nccl_backend or ("nccl" if torch.cuda.is_available() else "gloo")
            transports["nccl"] = TorchDistTransport(
                layout, config.nccl_init,
                PREFILL_RANK if config.role == "prefill" else DECODE_RANK, backend,
                group_bytes=config.nccl_group_mib << 20, in_flight=config.nccl_in_flight,
                turn_timeout_s=config.timeout_s)
    except BaseException:
        for transport in transports.values():
            transport.close()
        raise
    return transports
