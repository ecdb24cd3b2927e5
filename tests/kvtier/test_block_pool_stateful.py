"""BlockPool against a plain-Python model of the truth, driven by hypothesis.

The model keeps, per block id, its ref_cnt and hash, the free queue as a list (front is
reused first), the hash -> block id map, and the eviction events still to be taken. Each rule
applies one pool operation and the same operation on the model; after every step the pool's
invariants hold and every observable piece of state equals the model's.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtier.block_pool import BlockPool, EvictionEvent
from kvtier.hashing import BlockHash

# Few distinct hashes, so lookups hit, hashes collide across blocks and chains break.
HASHES = [BlockHash(bytes([i]) * 16) for i in range(6)]
hash_lists = st.lists(st.sampled_from(HASHES), max_size=5)


class BlockPoolMachine(RuleBasedStateMachine):
    """Each `holding` is one reference on each of its blocks, like a request's block table."""

    holdings = Bundle("holdings")

    @initialize(num_blocks=st.integers(1, 6))
    def start(self, num_blocks):
        self.pool = BlockPool(num_blocks)
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.queue = list(range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.events: list[EvictionEvent] = []

    # ---- model helpers -------------------------------------------------------------------

    def model_lookup(self, hashes) -> list[int]:
        hits = []
        for block_hash in hashes:
            if block_hash not in self.cached:
                break
            hits.append(self.cached[block_hash])
        return hits

    def model_touch(self, block_ids) -> None:
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                self.queue.remove(block_id)
            self.ref_cnt[block_id] += 1

    # ---- rules ---------------------------------------------------------------------------

    @rule(target=holdings, num=st.integers(0, 7))
    def allocate(self, num):
        blocks = self.pool.allocate(num)
        if num > len(self.queue):
            assert blocks is None
            return []
        taken, self.queue = self.queue[:num], self.queue[num:]
        for block_id in taken:
            old = self.block_hash[block_id]
            if old is not None:
                del self.cached[old]
                self.events.append(EvictionEvent(old, block_id))
                self.block_hash[block_id] = None
            self.ref_cnt[block_id] = 1
        assert blocks is not None and [b.block_id for b in blocks] == taken
        return taken

    @rule(target=holdings, hashes=hash_lists)
    def lookup_and_touch(self, hashes):
        hits = self.pool.lookup_prefix(hashes)
        expected = self.model_lookup(hashes)
        assert [b.block_id for b in hits] == expected
        self.pool.touch(hits)
        self.model_touch(expected)
        return expected

    @rule(target=holdings, data=st.data())
    def touch_any(self, data):
        block_ids = data.draw(st.lists(st.integers(0, len(self.ref_cnt) - 1), max_size=3))
        self.pool.touch([self.pool.blocks[i] for i in block_ids])
        self.model_touch(block_ids)
        return block_ids

    @rule(holding=consumes(holdings))
    def free(self, holding):
        self.pool.free([self.pool.blocks[i] for i in holding])
        tail_first = []
        for block_id in reversed(holding):
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                if self.block_hash[block_id] is None:
                    self.queue.insert(0, block_id)
                else:
                    tail_first.append(block_id)
        self.queue += tail_first

    @precondition(lambda self: any(self.ref_cnt))
    @rule(data=st.data())
    def free_more_than_held(self, data):
        # Freeing a block more times than it is held must fail and change nothing.
        held = [i for i, n in enumerate(self.ref_cnt) if n > 0]
        block_id = data.draw(st.sampled_from(held))
        before = self.observed()
        try:
            self.pool.free([self.pool.blocks[block_id]] * (self.ref_cnt[block_id] + 1))
        except ValueError:
            pass
        else:
            raise AssertionError("freeing more references than held did not raise")
        assert self.observed() == before

    @rule(holding=holdings, hashes=hash_lists)
    def cache(self, holding, hashes):
        n = min(len(holding), len(hashes))
        block_ids, hashes = holding[:n], hashes[:n]
        blocks = [self.pool.blocks[i] for i in block_ids]
        valid = all(self.ref_cnt[i] > 0 for i in block_ids)
        claimed: dict[int, BlockHash] = {}
        for block_id, block_hash in zip(block_ids, hashes):
            if claimed.setdefault(block_id, self.block_hash[block_id] or block_hash) != block_hash:
                valid = False
        if not valid:
            before = self.observed()
            try:
                self.pool.cache_full_blocks(blocks, hashes)
            except ValueError:
                pass
            else:
                raise AssertionError("cache_full_blocks accepted a free or re-hashed block")
            assert self.observed() == before
            return
        newly = self.pool.cache_full_blocks(blocks, hashes)
        expected = []
        for block_id, block_hash in zip(block_ids, hashes):
            if self.block_hash[block_id] is not None or block_hash in self.cached:
                continue
            self.block_hash[block_id] = block_hash
            self.cached[block_hash] = block_id
            expected.append(block_id)
        assert [b.block_id for b in newly] == expected

    @rule(holding=holdings)
    def uncache(self, holding):
        self.pool.uncache([self.pool.blocks[i] for i in holding])
        for block_id in holding:
            old = self.block_hash[block_id]
            if old is None:
                continue
            del self.cached[old]
            self.block_hash[block_id] = None
            if self.ref_cnt[block_id] == 0:
                self.queue.remove(block_id)
                self.queue.insert(0, block_id)

    @rule()
    def take_events(self):
        assert self.pool.take_events() == self.events
        self.events = []

    # ---- checks after every step ---------------------------------------------------------

    def observed(self) -> tuple:
        return ([b.block_id for b in self.pool.free_queue.blocks()],
                [b.ref_cnt for b in self.pool.blocks], [b.block_hash for b in self.pool.blocks],
                {k: v.block_id for k, v in self.pool.cached.items()})

    @invariant()
    def matches_model(self):
        self.pool.check_invariants()
        assert self.observed() == (self.queue, self.ref_cnt, self.block_hash, self.cached)
        assert self.pool.num_free_blocks == len(self.queue)
        stats = self.pool.stats()
        assert stats.num_free == len(self.queue) and stats.num_cached == len(self.cached)
        # Every cached hash is found by a lookup of itself.
        for block_hash, block_id in self.cached.items():
            assert self.pool.get_cached_block(block_hash).block_id == block_id


BlockPoolMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                              deadline=None)
TestBlockPool = BlockPoolMachine.TestCase
