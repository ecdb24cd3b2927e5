"""The host tier gives up a prefix chain from its tail: a block is worth nothing without the
blocks before it, so under pressure the host must keep heads, not tails. Real managers, CPU
tensors, no disk (nothing below the host: an evicted block is gone)."""

from __future__ import annotations

from manager_cases import (
    chain,
    check_idle,
    config,
    evict_gpu,
    load,
    random_blocks,
    same_bytes,
    small_layout,
    write,
)

from kvtier.manager import TierManager
from kvtier.stats import Tier


def test_a_chain_written_in_two_steps_loses_its_tail_first(managers) -> None:
    layout = small_layout()
    m = TierManager(layout, config(layout, None, gpu=16, host=6))
    managers.append(m)
    convo = chain(layout, "conversation", 5)
    data = random_blocks(layout, 5, seed=1)
    write(m, convo[:3], data[:3])  # the first round's blocks...
    m.flush()
    write(m, convo[3:], data[3:])  # ...then the second round's, stored later
    m.flush()
    # Three other blocks need room: plain LRU would drop the first round's blocks, the
    # head, and leave a tail no lookup can reach.
    write(m, chain(layout, "other", 3), random_blocks(layout, 3, seed=2))
    m.flush()
    hashes = [meta.block_hash for meta in convo]
    assert [m.host.contains(h) for h in hashes] == [True, True, True, False, False]
    evict_gpu(m)
    assert m.lookup(hashes).locations == [Tier.HOST] * 3
    num_ok, blocks = load(m, convo[:3])
    assert num_ok == 3
    assert all(same_bytes(m.kv_cache[b.block_id], d) for b, d in zip(blocks, data[:3]))
    m.free(blocks)
    check_idle(m)


def test_a_restore_from_the_host_leaves_the_head_most_recent(managers) -> None:
    layout = small_layout()
    m = TierManager(layout, config(layout, None, gpu=16, host=6))
    managers.append(m)
    convo, other = chain(layout, "conversation", 3), chain(layout, "other", 3)
    write(m, convo, random_blocks(layout, 3, seed=1))
    write(m, other, random_blocks(layout, 3, seed=2))
    evict_gpu(m)
    num_ok, blocks = load(m, convo)  # the conversation comes back from the host
    assert num_ok == 3
    m.free(blocks)
    # Host order now, coldest first: the other chain (tail first), then this one's tail.
    expected = [meta.block_hash for meta in reversed(other)] + \
        [meta.block_hash for meta in reversed(convo)]
    assert m.host.policy.keys() == expected
    check_idle(m)
