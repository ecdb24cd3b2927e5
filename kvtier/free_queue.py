"""The LRU queue of free GPU blocks, threaded through the blocks themselves.

A doubly linked list with two sentinels: O(1) `remove` of a block from the middle (a cached
block that gets a prefix hit leaves the queue), batch `popleft_n` from the front (least
recently freed first) and `append_n` at the back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NewType

from kvtier.hashing import BlockHash

BlockId = NewType("BlockId", int)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One GPU block: its id, how many requests hold it, and its hash once full and cached.

    `prev_free` / `next_free` are the links of the free queue; both are None while the block
    is held (`ref_cnt > 0`).
    """

    block_id: BlockId
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        tag = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={tag})"


class FreeBlockQueue:
    """Free blocks in eviction order: the front is evicted (reused) first."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(BlockId(-1))
        self._tail = KVCacheBlock(BlockId(-1))
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the `n` front blocks. Asserts that `n <= len(self)`."""
        assert 0 <= n <= self.num_free_blocks, f"popleft_n({n}) with {self.num_free_blocks} free"
        out: list[KVCacheBlock] = []
        node = self._head.next_free
        for _ in range(n):
            assert node is not None and node is not self._tail
            nxt = node.next_free
            node.prev_free = node.next_free = None
            out.append(node)
            node = nxt
        self._head.next_free = node
        assert node is not None
        node.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Take `block` out of the queue from wherever it is. Asserts it is queued."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append blocks at the back (evicted last), in the given order."""
        last = self._tail.prev_free
        assert last is not None
        for block in blocks:
            assert block.prev_free is None, f"{block} is already in the free queue"
            block.prev_free = last
            last.next_free = block
            last = block
            self.num_free_blocks += 1
        last.next_free = self._tail
        self._tail.prev_free = last

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put one block at the front: it is reused first (used for blocks holding no hash)."""
        assert block.prev_free is None, f"{block} is already in the free queue"
        first = self._head.next_free
        assert first is not None
        block.prev_free = self._head
        block.next_free = first
        self._head.next_free = block
        first.prev_free = block
        self.num_free_blocks += 1

    def blocks(self) -> list[KVCacheBlock]:
        """The queued blocks front to back (O(n); for tests and inspection)."""
        out = []
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            out.append(node)
            node = node.next_free
        return out
