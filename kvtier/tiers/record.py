"""The on-disk record of one KV block: a small self-checking header, then the block bytes.

    fixed part (44 bytes, little-endian)
        magic            4s   b"KVTB"
        version          u16  RECORD_VERSION
        layout           16s  KVLayout.fingerprint()
        hash_len         u8   bytes in the parent hash
        reserved         u8   0
        num_tokens       u32
        payload_len      u64  bytes of the block that follow the header
        payload_checksum u64  xxh3_64 of the payload
    variable part
        parent_hash      hash_len bytes
        token_ids        num_tokens x u32
        header_checksum  u64  xxh3_64 of every header byte before it
    payload              payload_len bytes

Magic and version come first so a value written by another format is reported as such and
not as garbage. The header checksum covers the token ids and parent hash that a load compares
with the block it asked for; the payload checksum covers the bytes. A record that fails any
check raises `CorruptRecord` naming the reason; callers treat it as a miss.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvtier.hashing import BlockHash, encode_token_ids
from kvtier.layout import KVLayout

MAGIC = b"KVTB"
#: Bump when the header layout changes; records of another version are never decoded.
RECORD_VERSION = 1

_PREFIX = struct.Struct("<4sH")
_FIXED = struct.Struct("<4sH16sBBIQQ")
_CHECKSUM = struct.Struct("<Q")
_MAX_HASH_LEN = 64
# Far above any block size; bounds what a corrupt header can make us read.
_MAX_TOKENS = 1 << 20


class CorruptRecord(ValueError):
    """A stored value is not a valid record for the block asked for.

    `reason` is one of: "truncated", "bad magic", "unknown version", "bad header",
    "bad header checksum", "layout mismatch", "payload length", "bad checksum",
    "wrong block".
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What identifies one block's bytes: its hash, its parent's hash and its token ids.

    Stored in the record header and compared on every load, so a hash collision or a wrong
    entry is a miss instead of a wrong block. `token_ids` is coerced to a tuple of ints.
    Raises ValueError for empty or over-long hashes.
    """

    block_hash: BlockHash
    parent_hash: BlockHash
    token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for field in ("block_hash", "parent_hash"):
            value = getattr(self, field)
            if not isinstance(value, bytes) or not 0 < len(value) <= _MAX_HASH_LEN:
                raise ValueError(f"BlockMeta.{field} must be 1..{_MAX_HASH_LEN} bytes, "
                                 f"got {value!r:.80}")
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A decoded, checksum-verified header. `token_bytes` are the token ids as LE uint32."""

    version: int
    layout_fingerprint: bytes
    parent_hash: BlockHash
    token_bytes: bytes
    payload_len: int
    payload_checksum: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_bytes) // 4

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(np.frombuffer(self.token_bytes, dtype="<u4").tolist())

    def matches(self, meta: BlockMeta) -> bool:
        """True when the stored parent hash and token ids are exactly `meta`'s."""
        return (self.parent_hash == meta.parent_hash
                and self.token_bytes == encode_token_ids(meta.token_ids))


def payload_checksum(payload) -> int:
    """xxh3_64 of a bytes-like payload (bytes, memoryview, C-contiguous numpy array)."""
    return xxhash.xxh3_64_intdigest(payload)


def copy_checksummed(src, dest) -> int:
    """Copy bytes-like `src` into the writable bytes-like `dest` of the same length and
    return `payload_checksum` of the bytes now in `dest` (what the caller will use, not
    `src`). Raises ValueError when the lengths differ.

    One copy, then one hash: two calls that release the GIL. Each time an I/O thread gives
    the GIL up it must win it back from the engine thread, which runs Python flat out and
    yields only at its switch interval; copying and hashing in cache-sized chunks made each
    block wait many such turns next to a busy thread (`docs/BENCHMARKS.md`, "I/O threads
    and the GIL").
    """
    source = np.frombuffer(memoryview(src).cast("B"), dtype=np.uint8)
    target = np.frombuffer(memoryview(dest).cast("B"), dtype=np.uint8)
    if source.nbytes != target.nbytes:
        raise ValueError(f"cannot copy {source.nbytes} bytes into {target.nbytes}")
    np.copyto(target, source)
    return payload_checksum(target)


def encode_header(meta: BlockMeta, layout: KVLayout, payload_len: int, checksum: int) -> bytes:
    """The header bytes for a block of `payload_len` bytes whose xxh3_64 is `checksum`.

    Raises ValueError for token ids outside [0, 2**32) or too many tokens.
    """
    return _header(meta, _token_bytes(meta), layout, payload_len, checksum)


def _header(meta: BlockMeta, token_bytes: bytes, layout: KVLayout, payload_len: int,
            checksum: int) -> bytes:
    num_tokens = len(token_bytes) // 4
    head = b"".join((
        _FIXED.pack(MAGIC, RECORD_VERSION, layout.fingerprint(), len(meta.parent_hash), 0,
                    num_tokens, payload_len, checksum),
        meta.parent_hash,
        token_bytes,
    ))
    return head + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(head))


def record_size(meta: BlockMeta, payload_len: int) -> int:
    """Bytes of the record of `meta` with a payload of `payload_len` bytes (header included).

    Raises ValueError like `encode_header`.
    """
    return _record_size(meta, _token_bytes(meta), payload_len)


def _record_size(meta: BlockMeta, token_bytes: bytes, payload_len: int) -> int:
    return _FIXED.size + len(meta.parent_hash) + len(token_bytes) + _CHECKSUM.size + payload_len


def _token_bytes(meta: BlockMeta) -> bytes:
    """`meta`'s token ids as LE uint32; ValueError for ids outside [0, 2**32) or too many."""
    token_bytes = encode_token_ids(meta.token_ids)
    if len(token_bytes) // 4 > _MAX_TOKENS:
        raise ValueError(f"a block holds at most {_MAX_TOKENS} tokens, "
                         f"got {len(token_bytes) // 4}")
    return token_bytes


def assemble_record(meta: BlockMeta, layout: KVLayout, payload, out) -> memoryview:
    """Write the record of `meta` and `payload` (bytes-like) into the front of `out`, a
    writable buffer of at least `record_size` bytes; return the view of `out` it fills.

    The payload is copied and checksummed (`copy_checksummed`); the header,
    which holds that checksum, is written in front of it afterwards. Raises ValueError
    like `encode_header`, or when `out` is too small.
    """
    src = memoryview(payload).cast("B")
    token_bytes = _token_bytes(meta)  # encoded once for the size and the header
    size = _record_size(meta, token_bytes, src.nbytes)
    record = memoryview(out).cast("B")
    if record.nbytes < size:
        raise ValueError(f"a record of {size} bytes does not fit in {record.nbytes}")
    record = record[:size]
    payload_at = size - src.nbytes
    checksum = copy_checksummed(src, record[payload_at:])
    record[:payload_at] = _header(meta, token_bytes, layout, src.nbytes, checksum)
    return record


def encode_record(meta: BlockMeta, layout: KVLayout, payload) -> bytes:
    """Header + payload as one bytes object (convenient for tests and small tools)."""
    view = memoryview(payload).cast("B")
    return encode_header(meta, layout, view.nbytes, payload_checksum(view)) + view.tobytes()


def decode_header(buffer, expected_fingerprint: bytes | None = None
                  ) -> tuple[RecordHeader, int]:
    """Decode and verify the header at the start of `buffer` (bytes-like).

    Returns `(header, payload_offset)`. Does not look at the payload. Raises `CorruptRecord`
    when the buffer is too short, the magic or version is not ours, a length is out of
    range, the header checksum fails, or the layout fingerprint differs from
    `expected_fingerprint` (when given).
    """
    view = memoryview(buffer).cast("B")
    if view.nbytes < _PREFIX.size:
        raise CorruptRecord("truncated", f"{view.nbytes} bytes, no header")
    magic, version = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptRecord("bad magic", f"{bytes(magic)!r}")
    if version != RECORD_VERSION:
        raise CorruptRecord("unknown version", f"record version {version}, "
                            f"this build reads {RECORD_VERSION}")
    if view.nbytes < _FIXED.size:
        raise CorruptRecord("truncated", f"{view.nbytes} bytes, fixed header is {_FIXED.size}")
    (_, _, fingerprint, hash_len, _, num_tokens, payload_len,
     checksum) = _FIXED.unpack_from(view)
    if not 0 < hash_len <= _MAX_HASH_LEN or num_tokens > _MAX_TOKENS:
        raise CorruptRecord("bad header", f"hash_len={hash_len} num_tokens={num_tokens}")
    tokens_at = _FIXED.size + hash_len
    checksum_at = tokens_at + 4 * num_tokens
    payload_offset = checksum_at + _CHECKSUM.size
    if view.nbytes < payload_offset:
        raise CorruptRecord("truncated", f"{view.nbytes} bytes, header is {payload_offset}")
    (stored,) = _CHECKSUM.unpack_from(view, checksum_at)
    if stored != xxhash.xxh3_64_intdigest(view[:checksum_at]):
        raise CorruptRecord("bad header checksum")
    if expected_fingerprint is not None and fingerprint != expected_fingerprint:
        raise CorruptRecord("layout mismatch", f"record layout {fingerprint.hex()}, "
                            f"expected {expected_fingerprint.hex()}")
    header = RecordHeader(
        version=version,
        layout_fingerprint=fingerprint,
        parent_hash=BlockHash(view[_FIXED.size:tokens_at].tobytes()),
        token_bytes=view[tokens_at:checksum_at].tobytes(),
        payload_len=payload_len,
        payload_checksum=checksum,
    )
    return header, payload_offset


def decode_record(buffer, expected_fingerprint: bytes | None = None,
                  expected_payload_len: int | None = None) -> tuple[RecordHeader, memoryview]:
    """Decode a whole record and verify its payload checksum.

    Returns `(header, payload)` where `payload` is a memoryview into `buffer` (valid as
    long as `buffer` is). Raises `CorruptRecord` like `decode_header`, and for a payload
    length that differs from the header's or from `expected_payload_len`, or a checksum that
    does not match.
    """
    view = memoryview(buffer).cast("B")
    header, offset = decode_header(view, expected_fingerprint)
    check_payload_len(header, view.nbytes - offset, expected_payload_len)
    payload = view[offset:]
    if payload_checksum(payload) != header.payload_checksum:
        raise CorruptRecord("bad checksum")
    return header, payload


def read_record_into(record, meta: BlockMeta, expected_fingerprint: bytes,
                     dest: np.ndarray) -> None:
    """Check a whole record (bytes-like) against the block `meta` names and copy its payload
    into `dest` (uint8, exactly the payload's length): header, layout, length, parent hash,
    token ids, and the checksum of the bytes now in `dest`. Raises `CorruptRecord` on any
    mismatch; `dest` may then hold part of the bytes and must not be used."""
    header, offset = decode_header(record, expected_fingerprint)
    check_payload_len(header, len(record) - offset, dest.nbytes)
    if not header.matches(meta):
        raise CorruptRecord("wrong block", "stored parent hash or token ids differ")
    # The checksum is taken over the copy, the bytes the caller will use.
    if copy_checksummed(memoryview(record)[offset:], dest) != header.payload_checksum:
        raise CorruptRecord("bad checksum")


def check_payload_len(header: RecordHeader, available: int,
                      expected_payload_len: int | None) -> None:
    """Raise `CorruptRecord` unless exactly `header.payload_len` bytes follow the header."""
    if available < header.payload_len:
        raise CorruptRecord("truncated", f"payload has {available} of "
                            f"{header.payload_len} bytes")
    if available != header.payload_len:
        raise CorruptRecord("payload length", f"{available - header.payload_len} bytes "
                            "after the payload")
    if expected_payload_len is not None and header.payload_len != expected_payload_len:
        raise CorruptRecord("payload length", f"{header.payload_len} bytes, expected "
                            f"{expected_payload_len}")


def metas_for(parent: BlockHash, block_hashes: Sequence[BlockHash],
              token_ids: Sequence[int], block_size: int) -> list[BlockMeta]:
    """BlockMeta of each full block of one sequence, given its chained hashes.

    `block_hashes[i]` must be the hash of tokens `[i * block_size, (i + 1) * block_size)`
    chained from `parent`. Raises ValueError when there are more hashes than full blocks.
    """
    if len(block_hashes) * block_size > len(token_ids):
        raise ValueError(f"{len(block_hashes)} hashes but only {len(token_ids)} tokens "
                         f"(block_size {block_size})")
    metas = []
    for i, block_hash in enumerate(block_hashes):
        chunk = tuple(int(t) for t in token_ids[i * block_size:(i + 1) * block_size])
        metas.append(BlockMeta(block_hash, parent, chunk))
        parent = block_hash
    return metas


#: One block's bytes in host memory: a flat uint8 numpy array (`HostTier.slot_array`) or a
#: contiguous CPU tensor of any dtype.
BlockBuffer = torch.Tensor | np.ndarray


def payload_view(payload: object, nbytes: int) -> memoryview:
    """A flat byte view of one block's bytes, without copying.

    `payload` is bytes, a memoryview, a C-contiguous numpy array or a contiguous CPU tensor
    (any dtype) of exactly `nbytes` bytes; anything else raises ValueError.
    """
    if isinstance(payload, torch.Tensor):
        if payload.device.type != "cpu" or not payload.is_contiguous():
            raise ValueError("a tensor payload must be contiguous and on the CPU; got "
                             f"device={payload.device} contiguous={payload.is_contiguous()}")
        payload = payload.reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(payload)
    except TypeError as exc:
        raise ValueError("a payload must be bytes-like or a tensor, got "
                         f"{type(payload).__name__}") from exc
    if not view.c_contiguous:
        raise ValueError("a payload must be C-contiguous")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if view.nbytes != nbytes:
        raise ValueError(f"a payload must be {nbytes} bytes (one block), got {view.nbytes}")
    return view


def dest_array(dest: BlockBuffer, nbytes: int) -> np.ndarray:
    """A flat uint8 numpy view of `dest`, a flat C-contiguous uint8 numpy array or a
    contiguous CPU tensor (any dtype) of exactly `nbytes` bytes; raises ValueError
    otherwise."""
    if isinstance(dest, np.ndarray) and dest.dtype == np.uint8 and dest.ndim == 1 \
            and dest.flags.c_contiguous and dest.flags.writeable:
        if dest.nbytes != nbytes:
            raise ValueError(f"dest must hold {nbytes} bytes (one block), got {dest.nbytes}")
        return dest
    if not isinstance(dest, torch.Tensor) or dest.device.type != "cpu" \
            or not dest.is_contiguous():
        raise ValueError("dest must be a contiguous CPU tensor or a flat writable uint8 "
                         "numpy array")
    if dest.nbytes != nbytes:
        raise ValueError(f"dest must hold {nbytes} bytes (one block), got {dest.nbytes}")
    # [nbytes] uint8, sharing memory with dest
    return dest.reshape(-1).view(torch.uint8).numpy()
