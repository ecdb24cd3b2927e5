"""Which tiers a `TierConfig` turns on, and opening them: the host slab (caching, or only
staging bytes for the tiers below; shared with a disk worker process when one runs), then
the tiers below the host, fastest first: the disk tier (one LMDB environment or shards,
recovered from damaged files; in this process or in a worker process of its own), a
directory of one file per block, the shared remote store."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.config import TierConfig
from kvtier.layout import KVLayout
from kvtier.shared_host_memory import SharedHostMemory
from kvtier.tiers.base import LowerTier
from kvtier.tiers.directory.tier import DirectoryTier
from kvtier.tiers.disk.recovery import DiskRecovery, open_disk_tier
from kvtier.tiers.disk.shard_layout import default_shards
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.disk.worker_tier import DiskWorkerTier, WorkerGone
from kvtier.tiers.host import HostRole, HostTier
from kvtier.tiers.record import BlockMeta

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OpenedTiers:
    """What `open_tiers` opened: the host slab (None when nothing sits below the GPU), the
    tiers below it, fastest first, and what was done about damaged disk files."""

    host: HostTier | None
    lower: list[LowerTier]
    disk_recovery: DiskRecovery | None


def open_tiers(config: TierConfig, layout: KVLayout, device: torch.device,
               disk_read_hook: Callable[[BlockMeta], None] | None = None) -> OpenedTiers:
    """The host slab and the tiers below it that `config` turns on for an engine on
    `device`. With a disk worker (`TierConfig.disk_worker`; None: on CUDA) the slab is made
    first, in shared memory the worker maps; where shared memory cannot be made, the disk
    tier runs in this process (with a warning). Nothing is left open when a tier fails to
    open; raises as `open_lower_tiers` and `HostTier` do."""
    num_host_slots = config.num_host_slots(layout)
    host = None
    if config.disk_path is not None and (config.disk_worker if config.disk_worker is not None
                                         else device.type == "cuda"):
        host = _shared_host_slab(config, layout, device, num_host_slots)
    try:
        lower, recovery = open_lower_tiers(config, layout, disk_read_hook,
                                           host.shared_memory if host is not None else None)
    except BaseException:
        if host is not None:
            host.close()
        raise
    if host is not None and not (num_host_slots or lower):
        host.close()  # the disk tier was turned off: nothing to stage for
        host = None
    elif host is None and (num_host_slots or lower):
        try:
            host = _host_slab(config, layout, device, num_host_slots, shared=False)
        except BaseException:
            for tier in lower:  # no half-built manager keeps files open
                tier.close()
            raise
    return OpenedTiers(host, lower, recovery)


def _shared_host_slab(config: TierConfig, layout: KVLayout, device: torch.device,
                      num_host_slots: int) -> HostTier | None:
    """A host slab the disk worker can map, or None (with a warning) where shared memory
    cannot be made: the disk tier then runs in this process, on a private slab."""
    try:
        return _host_slab(config, layout, device, num_host_slots, shared=True)
    except OSError as exc:
        logger.warning("the host tier cannot be shared with a disk worker process (%s); "
                       "the disk tier runs in the engine's process instead", exc)
        return None


def _host_slab(config: TierConfig, layout: KVLayout, device: torch.device,
               num_host_slots: int, shared: bool) -> HostTier:
    """The host tier of `num_host_slots`, or (0) the staging slab the lower tiers' bytes
    pass through when it is off."""
    return HostTier(layout, num_host_slots or config.staging_slots,
                    pin_memory=device.type == "cuda",
                    role=HostRole.CACHE if num_host_slots else HostRole.STAGING,
                    shared=shared)


def open_lower_tiers(config: TierConfig, layout: KVLayout,
                     disk_read_hook: Callable[[BlockMeta], None] | None = None,
                     disk_worker_memory: SharedHostMemory | None = None
                     ) -> tuple[list[LowerTier], DiskRecovery | None]:
    """The tiers below the host that `config` turns on, fastest first, and what was done
    about damaged disk files (moved aside, or the disk tier turned off, with a warning).
    With `disk_worker_memory` (the host slab's), the disk tier runs in a worker process
    (`DiskWorkerTier`), whose reads and writes use that slab. Raises as each tier's
    constructor does, and ValueError for a read hook with a worker (it could not run)."""
    tiers: list[LowerTier | None] = []
    recovery = None
    if config.disk_path is not None:
        disk, recovery = _open_disk(config, layout, disk_read_hook, disk_worker_memory)
        tiers.append(disk)
    tiers.append(DirectoryTier(config.directory_path, layout) if config.directory_path else None)
    if config.remote is not None:
        from kvtier.tiers.remote.tier import RemoteTier  # imports redis: only when asked for
        tiers.append(RemoteTier(config.remote, layout))
    return [tier for tier in tiers if tier is not None], recovery


def _open_disk(config: TierConfig, layout: KVLayout,
               read_hook: Callable[[BlockMeta], None] | None,
               worker_memory: SharedHostMemory | None
               ) -> tuple[LowerTier | None, DiskRecovery | None]:
    """The disk tier, in a worker process when `worker_memory` is given and the worker
    starts; a worker that cannot (it exits, cannot map the slab, does not answer) leaves
    the tier in this process, with a warning."""
    assert config.disk_path is not None and config.disk_budget_bytes is not None, \
        "TierConfig checks the budget"
    shards = config.disk_shards or default_shards(config.disk_budget_bytes)
    if worker_memory is not None:
        if read_hook is not None:
            raise ValueError("a disk read hook runs in the engine's process: turn the disk "
                             "worker off (TierConfig.disk_worker=False) to use one")
        try:
            return DiskWorkerTier.start(config.disk_path, layout, config.disk_budget_bytes,
                                        shared=worker_memory, shards=shards,
                                        durable=config.disk_durable,
                                        lookup_deadline_s=config.disk_lookup_deadline_s,
                                        threads=config.io_threads + 2)
        except WorkerGone as exc:  # the machine's doing, not the tier's: serve it here
            logger.warning("%s; the disk tier runs in the engine's process instead", exc)
    return open_disk_tier(config.disk_path, layout, config.disk_budget_bytes, shards=shards,
                          tier_class=DiskTier, read_hook=read_hook,
                          durable=config.disk_durable,
                          lookup_deadline_s=config.disk_lookup_deadline_s)
