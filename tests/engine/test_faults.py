"""The engine under faults: a killed process, damaged disk values, failing transfers, a
stalled disk, a full disk, and budgets the machine cannot hold.

Every run that must survive a fault is compared token for token with a tiers-off run of
the same model (host and disk tiers off, a GPU pool large enough to never evict), and
asserts that the path it is about was taken (blocks restored from disk, values rejected,
failures counted), not only that the answers are right. A tiny random Llama keeps it fast;
GPU and host budgets of a few blocks force blocks down to disk and back.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lmdb
import pytest
import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import LoadedModel, load_model

from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.stats import Tier
from kvtier.tiers.disk.tier import DiskTier

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "random:tiny-llama"
MAX_TOKENS = 6
NUM_GPU_BLOCKS = 12  # one 120-token prompt and its answer need 8
NUM_HOST_SLOTS = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(MODEL, "cpu", "float32")


def make_prompts(seed: int, num_prompts: int = 8) -> list[list[int]]:
    """Token-id prompts of 40 to 120 tokens; pairs share a 32-token prefix. No eos (2)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 256) for _ in range(32)] for _ in range(num_prompts // 2)]
    return [prefixes[i // 2] + [rng.randrange(3, 256) for _ in range(rng.randrange(8, 88))]
            for i in range(num_prompts)]


PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def tiers_off(model: LoadedModel, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    with LLM(model, gpu_blocks=256, host_cache=False, disk_cache=False) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


def slots_gb(model: LoadedModel, num_slots: int) -> float:
    return num_slots * model.config.kv_layout(16, torch.float32).bytes_per_block / 2**30


def tiny_llm(model: LoadedModel, disk_dir: Path, **kwargs) -> LLM:
    """Tiny GPU and host budgets: blocks leave the GPU and the host at once."""
    # restore_min_saving_s 0: these short prompts compute sooner than a read must save by
    # default, and what is tested is what the reads find.
    options = dict(gpu_blocks=NUM_GPU_BLOCKS, host_cache_gb=slots_gb(model, NUM_HOST_SLOTS),
                   disk_cache_dir=disk_dir, disk_cache_gb=0.01, max_num_batched_tokens=64,
                   restore_min_saving_s=0.0)
    options.update(kwargs)
    return LLM(model, **options)


def run(llm: LLM, prompts: list[list[int]]) -> list:
    """One prompt at a time (so later prompts must restore what earlier ones evicted)."""
    return [llm.generate([prompt], PARAMS)[0] for prompt in prompts]


def run_to_disk(llm: LLM, prompts: list[list[int]]) -> list:
    """`run`, with each prompt's blocks on disk before the next prompt, whatever the pace of
    the I/O threads (a flush writes every dirty host block)."""
    outputs = []
    for prompt in prompts:
        outputs += run(llm, [prompt])
        llm.manager.flush()
    return outputs


def check_idle(llm: LLM) -> None:
    """Nothing in flight, every GPU block free with ref_cnt 0, no host slot pinned."""
    manager = llm.manager
    manager.flush()
    manager.pool.check_invariants()
    stats = manager.stats()
    assert stats.pool.num_free == stats.pool.num_blocks
    assert all(block.ref_cnt == 0 for block in manager.pool.blocks)
    assert stats.num_jobs_in_flight == 0 and stats.num_loads_in_flight == 0
    if manager.host is not None:
        manager.host.check_invariants(idle=True)


def warm(model: LoadedModel, disk_dir: Path, prompts: list[list[int]]) -> None:
    """Fill the disk tier with every full block of `prompts` (a roomy host tier: no
    write-through is skipped for want of a slot)."""
    with tiny_llm(model, disk_dir, host_cache_gb=slots_gb(model, 64)) as llm:
        run(llm, prompts)
    # close() flushed every host block to disk.


def block_hashes(model: LoadedModel, prompt: list[int]) -> list[bytes]:
    """The disk keys of a prompt's full blocks (default salt and hash algorithm)."""
    layout = model.config.kv_layout(16, torch.float32)
    return hash_blocks(namespace_hash(model.cache_identity, layout), prompt, 16)


# ---- a killed process ----------------------------------------------------------------------

# The child generates the prompts one at a time forever, printing after each answer.
CHILD = ("import runpy, sys; "
         "runpy.run_path(sys.argv[1])['child_main'](sys.argv[2], int(sys.argv[3]))")


def child_main(disk_dir: str, seed: int) -> None:
    torch.set_num_threads(1)
    model = load_model(MODEL, "cpu", "float32")
    prompts = make_prompts(seed)
    with tiny_llm(model, Path(disk_dir)) as llm:
        print("ready", flush=True)
        while True:
            for prompt in prompts:
                output = llm.generate([prompt], PARAMS)[0]
                print(*output.outputs[0].token_ids, flush=True)


@pytest.mark.timeout(300)
def test_a_warm_directory_left_by_a_killed_engine_gives_the_same_answers(tiny, tmp_path):
    """SIGKILL an engine in the middle of its run (write-backs to disk in flight); the next
    engine on the directory restores what was committed and answers exactly as a tiers-off
    engine does."""
    seed = 3
    prompts = make_prompts(seed)
    expected = tiers_off(tiny, prompts)
    disk_dir = tmp_path / "kv"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, __file__, str(disk_dir), str(seed)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    answers: list[tuple[int, ...]] = []
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
        while len(answers) < len(prompts) + 3:  # into the second round: restores running
            line = proc.stdout.readline()
            assert line, f"the engine died on its own:\n{proc.stderr.read()[-3000:]}"
            answers.append(tuple(int(t) for t in line.split()))
        time.sleep(random.Random(seed).uniform(0.0, 0.1))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert answers == [expected[i % len(prompts)] for i in range(len(answers))]

    with tiny_llm(tiny, disk_dir) as llm:
        outputs = run(llm, prompts)
        stats = llm.stats()
        check_idle(llm)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(o.metrics.cached_tokens_disk for o in outputs) > 0, "nothing came from disk"
    assert stats.disk.rejected == 0 and stats.tiers[Tier.DISK].failures == 0


# ---- damaged disk values -------------------------------------------------------------------

def damage_values(disk_dir: Path, keys: list[bytes]) -> None:
    """Damage the values under `keys`, in turn: a payload byte flipped, a header byte
    flipped, the value cut to a third, another block's well-formed record put in its place."""
    env = lmdb.open(str(disk_dir), max_dbs=8, map_size=1 << 30)
    try:
        with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
            values = [bytes(txn.get(key)) for key in keys]
            for index, (key, value) in enumerate(zip(keys, values)):
                kind = index % 4
                if kind == 0:
                    value = value[:-3] + bytes([value[-3] ^ 0x40]) + value[-2:]
                elif kind == 1:
                    value = value[:20] + bytes([value[20] ^ 0x01]) + value[21:]
                elif kind == 2:
                    value = value[:len(value) // 3]
                else:
                    value = values[index - 1]
                txn.put(key, value)
    finally:
        env.close()


@pytest.mark.timeout(300)
def test_damaged_disk_values_are_recomputed_and_counted(tiny, tmp_path):
    prompts = make_prompts(11)
    expected = tiers_off(tiny, prompts)
    disk_dir = tmp_path / "kv"
    warm(tiny, disk_dir, prompts)
    # Each prompt's second block is damaged; its first stays intact and is served.
    damaged = list(dict.fromkeys(block_hashes(tiny, p)[1] for p in prompts))
    damage_values(disk_dir, damaged)
    num_damaged = len(damaged)
    with tiny_llm(tiny, disk_dir) as llm:
        outputs = run(llm, prompts)
        stats = llm.stats()
        check_idle(llm)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # A damaged value is rejected when it is read; one whose read the compute front
    # cancelled (it computed the block first) was never read. Each is rejected at most once:
    # a rejected value is deleted.
    assert num_damaged == len(prompts) // 2
    assert stats.disk.rejected <= num_damaged
    # (A read of a cancelled load still rejects what it finds, and counts it failed.)
    assert stats.tiers[Tier.DISK].failures <= stats.disk.rejected
    with tiny_llm(tiny, disk_dir) as llm:
        assert [o.outputs[0].token_ids for o in run(llm, prompts)] == expected
        assert llm.stats().disk.rejected <= num_damaged - stats.disk.rejected


@pytest.mark.timeout(300)
def test_a_disk_cache_of_an_older_format_is_cleared(tiny, tmp_path):
    prompts = make_prompts(12, num_prompts=4)
    expected = tiers_off(tiny, prompts)
    disk_dir = tmp_path / "kv"
    warm(tiny, disk_dir, prompts)
    env = lmdb.open(str(disk_dir), max_dbs=8, map_size=1 << 30)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"format_version", (0).to_bytes(2, "little"))
    env.close()
    with tiny_llm(tiny, disk_dir) as llm:
        assert llm.manager.disk.format_reset
        outputs = run(llm, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert outputs[0].metrics.cached_tokens_disk == 0  # nothing of the old format served


# ---- failing and stalled transfers ---------------------------------------------------------

class FlakyDisk(DiskTier):
    """A real disk tier whose batched reads and writes raise on a seeded third of the
    calls, some after doing half of their work."""

    rng = random.Random(0)
    num_failed = 0

    def _fail(self, call, metas, items) -> None:
        if self.rng.random() < 1 / 3:
            type(self).num_failed += 1
            if len(metas) > 1 and self.rng.random() < 0.5:
                half = len(metas) // 2
                call(metas[:half], items[:half])
            raise OSError("injected disk error")

    def get_many_into(self, metas, dests):
        self._fail(super().get_many_into, metas, dests)
        return super().get_many_into(metas, dests)

    def put_counted(self, metas, payloads):
        self._fail(super().put_counted, metas, payloads)
        return super().put_counted(metas, payloads)


def flaky_swap(real, rng: random.Random, counter: list[int]):
    """The transfer engine's copy function, raising on a fifth of the calls (half of them
    after copying the first block)."""

    def swap(src, dst, block_mapping, **kwargs):
        if rng.random() < 0.2:
            counter[0] += 1
            if rng.random() < 0.5:
                real(src, dst, block_mapping[:1], **kwargs)
            raise RuntimeError("injected copy error")
        real(src, dst, block_mapping, **kwargs)

    return swap


@pytest.mark.timeout(300)
def test_failing_transfers_are_recomputed_and_the_engine_keeps_serving(
        tiny, tmp_path, monkeypatch):
    prompts = make_prompts(21)
    expected = tiers_off(tiny, prompts)
    disk_dir = tmp_path / "kv"
    warm(tiny, disk_dir, prompts)
    disk_class = type("Disk", (FlakyDisk,), {"rng": random.Random(5), "num_failed": 0})
    monkeypatch.setattr("kvtier.open_tiers.DiskTier", disk_class)
    with tiny_llm(tiny, disk_dir) as llm:
        assert isinstance(llm.manager.disk, FlakyDisk)
        copies_failed = [0]
        monkeypatch.setattr(llm.manager.transfers, "_swap",
                            flaky_swap(llm.manager.transfers._swap, random.Random(6),
                                       copies_failed))
        outputs = run(llm, prompts) + run(llm, prompts[::-1])
        stats = llm.stats()
        monkeypatch.undo()  # let close() flush through sound seams
        check_idle(llm)
    assert [o.outputs[0].token_ids for o in outputs] == expected + expected[::-1]
    assert disk_class.num_failed > 0 and copies_failed[0] > 0, "no fault was injected"
    assert stats.tiers[Tier.DISK].failures + stats.tiers[Tier.HOST].failures > 0
    assert sum(t.failures for t in stats.transfers.values()) > 0
    assert sum(o.metrics.cached_tokens_disk + o.metrics.cached_tokens_host
               for o in outputs) > 0, "no restore succeeded: the test proves nothing"


class StalledDisk(DiskTier):
    """A real disk tier whose reads wait until `release` is set."""

    release = threading.Event()
    entered = threading.Event()

    def get_many_into(self, metas, dests):
        self.entered.set()
        assert self.release.wait(timeout=120), "the test never released the read"
        return super().get_many_into(metas, dests)


@pytest.mark.timeout(300)
def test_a_stalled_disk_read_does_not_stop_other_requests(tiny, tmp_path, monkeypatch):
    """Request A's prefix is on disk and its read hangs; request B, with nothing cached,
    is admitted, runs and finishes meanwhile, and so does A: its compute front computes the
    blocks whose read hangs (their bytes never reach the GPU). Released, the engine
    completes the abandoned read and is idle."""
    prompts = make_prompts(31, num_prompts=4)
    expected = tiers_off(tiny, prompts)
    disk_dir = tmp_path / "kv"
    warm(tiny, disk_dir, prompts[:1])
    disk_class = type("Disk", (StalledDisk,), {"release": threading.Event(),
                                               "entered": threading.Event()})
    monkeypatch.setattr("kvtier.open_tiers.DiskTier", disk_class)
    with tiny_llm(tiny, disk_dir) as llm:
        try:
            a = llm.add_request(prompts[0], PARAMS)
            b = llm.add_request(prompts[2], PARAMS)  # another prefix: nothing on disk
            done = {o.request_id: o for o in llm.step()}  # A's restore issues its read
            assert disk_class.entered.wait(timeout=60)  # which starts, and hangs
            while a not in done or b not in done:
                done.update((o.request_id, o) for o in llm.step())
            assert llm.has_unfinished()  # the hanging read is still waited for
        finally:
            disk_class.release.set()
        while llm.has_unfinished():
            done.update((o.request_id, o) for o in llm.step())
        check_idle(llm)
    assert done[a].outputs[0].token_ids == expected[0]
    assert done[b].outputs[0].token_ids == expected[2]
    assert done[a].metrics.cached_tokens_disk == 0  # its only read hung: all computed


# ---- a full disk ---------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_a_disk_budget_of_three_blocks_prunes_and_keeps_serving(tiny, tmp_path):
    prompts = make_prompts(41)
    expected = tiers_off(tiny, prompts)
    bytes_per_block = tiny.config.kv_layout(16, torch.float32).bytes_per_block
    budget_gb = 3.5 * bytes_per_block / 2**30  # three records (header included)
    with tiny_llm(tiny, tmp_path / "kv", disk_cache_gb=budget_gb) as llm:
        outputs = run_to_disk(llm, prompts + prompts)
        disk = llm.stats().disk
        check_idle(llm)
    assert [o.outputs[0].token_ids for o in outputs] == expected + expected
    assert disk.pruned > 0 and disk.num_blocks <= 3
    assert disk.bytes_used <= disk.budget_bytes


class TinyMapDisk(DiskTier):
    """A disk tier whose LMDB map may not grow past 160 KiB, whatever its budget."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.update(max_map_bytes=160 << 10, initial_map_bytes=160 << 10)
        super().__init__(*args, **kwargs)


@pytest.mark.timeout(300)
def test_a_full_lmdb_map_prunes_or_refuses_and_keeps_serving(tiny, tmp_path, monkeypatch):
    prompts = make_prompts(42)
    expected = tiers_off(tiny, prompts)
    monkeypatch.setattr("kvtier.open_tiers.DiskTier", TinyMapDisk)
    with tiny_llm(tiny, tmp_path / "kv", disk_cache_gb=1.0) as llm:
        outputs = run_to_disk(llm, prompts + prompts)  # more blocks than the map holds
        disk = llm.stats().disk
        check_idle(llm)
    assert [o.outputs[0].token_ids for o in outputs] == expected + expected
    assert disk.pruned + disk.refused > 0
    assert disk.bytes_used < 160 << 10


# ---- budgets the machine cannot hold -------------------------------------------------------

def test_budgets_the_machine_cannot_hold_fail_at_start_up(tiny, tmp_path):
    with pytest.raises(ValueError, match="host tier needs .* available"):
        LLM(tiny, gpu_blocks=8, host_cache_gb=1 << 20, disk_cache=False)
    with pytest.raises(ValueError, match="KV cache of .* available"):
        LLM(tiny, gpu_blocks=1 << 40, host_cache=False, disk_cache=False)
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        LLM(tiny, gpu_blocks=8, disk_cache_dir=a_file)


@pytest.mark.gpu
def test_pinned_memory_unavailable_fails_at_start_up(tmp_path, monkeypatch):
    """The host slab cannot be pinned (a locked-memory limit, a driver refusing): LLM(...)
    raises OSError before serving anything."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (injected: pinning refused)")
        return real_empty(*args, **kwargs)

    model = load_model(MODEL, "cuda", "bfloat16")
    monkeypatch.setattr("kvtier.tiers.host.torch.empty", empty)
    with pytest.raises(OSError, match="could not pin"):
        LLM(model, gpu_blocks=8, host_cache_gb=0.01, disk_cache=False)
