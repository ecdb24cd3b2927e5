"""The handoff in one process: the engine's block tap, and a decode engine receiving records
over the Mooncake engine (TCP loopback), SmolLM2 in float32 on the CPU.

- The tap gives each prompt block once, in order, chunk by chunk, each with a reference
  that keeps it until the receiver gives it back.
- A record damaged in the receive buffer and records of another cache namespace are
  rejected and counted; the blocks that passed are placed and used, the rest computed, and
  the greedy tokens are those of an engine that computed everything.
- A reservation whose commits stop expires: its holds are given back, what landed stays
  cached.
- Numbered commits that reach the decode side out of order are taken in their order.

The two-process tests (every transport, a later turn, a killed prefill instance) are in
tests/cli/test_handoff.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import LoadedModel

from kvtier.handoff.base import OutgoingBlock
from kvtier.handoff.control import ControlError, LocalControl
from kvtier.handoff.mooncake import MooncakeTransport, mooncake_available
from kvtier.handoff.placement import PoolPlacement
from kvtier.handoff.receiver import HandoffReceiver
from kvtier.handoff.stats import HandoffCounters
from kvtier.hashing import BlockHash, hash_blocks, namespace_hash
from kvtier.tiers.record import metas_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 6 full blocks of 16 tokens and 5 more; 32-token chunks: three taps of two blocks.
PROMPT = [(37 * i + 11) % 4000 + 20 for i in range(101)]
GREEDY = SamplingParams(max_tokens=6)


def _engine(model: LoadedModel) -> LLM:
    return LLM(model, gpu_blocks=48, max_num_batched_tokens=32, host_cache=False,
               disk_cache=False)


def _namespace(llm: LLM, salt: str | None = None) -> bytes:
    return namespace_hash(llm.model_fingerprint, llm.layout, llm.config.hash_algorithm, salt)


def _mooncake_pair(prefill: LLM, decode: LLM, ring: int, **receiver_options: Any
                   ) -> tuple[MooncakeTransport, MooncakeTransport, HandoffReceiver]:
    """A Mooncake engine for each side (TCP loopback, `ring` slots lent per handoff) and
    the decode engine's receiver over it, run inline (as if on its engine thread)."""
    receiving = MooncakeTransport(decode.layout, ring=ring)
    sending = MooncakeTransport(prefill.layout, ring=ring)
    receiver = HandoffReceiver(PoolPlacement(decode.manager), lambda fn: fn(),
                               lambda salt: _namespace(decode, salt), 16,
                               decode.config.hash_algorithm, {"mooncake": receiving},
                               **receiver_options)
    return receiving, sending, receiver


def _computed_blocks(prefill: LLM, prompt: list[int], salt: str | None = None
                     ) -> tuple[list[BlockHash], list[torch.Tensor]]:
    """`prefill` computes `prompt` (under cache salt `salt`): its full blocks' hashes and
    their bytes (uint8 rows of its pool)."""
    prefill.add_request(prompt, SamplingParams(max_tokens=1), cache_salt=salt)
    while prefill.has_unfinished():
        prefill.step()
    hashes = hash_blocks(_namespace(prefill, salt), prompt, 16, prefill.config.hash_algorithm)
    rows = prefill.manager.kv_cache.view(prefill.num_gpu_blocks, -1).view(torch.uint8)
    return hashes, [rows[prefill.manager.pool.get_cached_block(h).block_id] for h in hashes]


def test_the_tap_gives_each_prompt_block_once_in_order_with_a_reference(
        smollm2: LoadedModel) -> None:
    with _engine(smollm2) as llm:
        taps = []

        def tap(first, metas, blocks) -> None:
            assert all(block.ref_cnt == 2 for block in blocks)  # the request's and the tap's
            taps.append((first, [m.block_hash for m in metas], blocks))

        llm.add_request(PROMPT, SamplingParams(max_tokens=1), block_tap=tap)
        while llm.has_unfinished():
            llm.step()
        assert [(first, len(hashes)) for first, hashes, _ in taps] == [(0, 2), (2, 2), (4, 2)]
        expected = hash_blocks(_namespace(llm), PROMPT, 16, llm.config.hash_algorithm)
        assert [h for _, hashes, _ in taps for h in hashes] == expected
        blocks = [b for _, _, bs in taps for b in bs]
        assert all(block.ref_cnt == 1 for block in blocks)  # the request finished
        llm.manager.free(blocks)  # what the receiver of the blocks does once they are out
        llm.manager.pool.check_invariants()
        assert llm.manager.pool.num_free_blocks == llm.num_gpu_blocks


@pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))
def test_damaged_and_foreign_records_are_rejected_and_computed(smollm2: LoadedModel) -> None:
    reference = _engine(smollm2).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    now = [0.0]
    with _engine(smollm2) as prefill, _engine(smollm2) as decode:
        # The prefill engine computes the prompt; its blocks' bytes are read from its pool.
        hashes, payloads = _computed_blocks(prefill, PROMPT)
        ours = metas_for(_namespace(prefill), hashes, PROMPT, 16)
        other = _namespace(prefill, "another tenant")
        theirs = metas_for(other, hash_blocks(other, PROMPT, 16), PROMPT, 16)

        counters = HandoffCounters()
        receiving, sending, receiver = _mooncake_pair(prefill, decode, ring=4, timeout_s=5.0,
                                                      hold_s=5.0, counters=counters,
                                                      clock=lambda: now[0])
        control = LocalControl(receiver, {})
        reservation = control.reserve(PROMPT, None, "mooncake")
        assert reservation["held"] == [False] * 6
        channel = sending.open_send(reservation["offer"])
        assert channel.capacity == 4

        # Blocks 0-2 arrive; block 1 is damaged in the receive buffer after it landed.
        entries = channel.send([OutgoingBlock(i, ours[i], payloads[i]) for i in range(3)])
        offset = reservation["offer"]["slots"][entries[1]["slot"]] - receiving.buffer_address
        receiving._buffer[offset + entries[1]["length"] - 7] ^= 0x5A  # a payload byte
        answer = control.commit(reservation["handoff_id"], "mooncake", entries, last=False)
        channel.committed()
        assert _outcome(answer) == {"accepted": [0, 2], "rejected": [1]}
        assert set(answer["timings"]) == {"receive", "place"}  # where the commit's time went

        # Blocks 3-5 come as another namespace's records: not the blocks asked for.
        entries = channel.send([OutgoingBlock(i, theirs[i], payloads[i]) for i in (3, 4, 5)])
        answer = control.commit(reservation["handoff_id"], "mooncake", entries, last=False)
        assert _outcome(answer) == {"accepted": [], "rejected": [3, 4, 5]}
        channel.close()
        stats = counters.snapshot()
        assert stats.blocks[("decode", "mooncake", "rejected")] == 4
        assert stats.bytes[("decode", "mooncake")] == 2 * decode.layout.bytes_per_block

        # No last commit comes: the reservation expires, its holds go, blocks 0 and 2 stay.
        now[0] += 6.0
        receiver.sweep()
        assert receiver.num_reservations == 0
        assert counters.snapshot().handoffs == {("decode", "mooncake", "timeout"): 1}
        pool = decode.manager.pool
        assert [pool.get_cached_block(h) is not None for h in hashes] == \
            [True, False, True, False, False, False]
        assert pool.num_free_blocks == decode.num_gpu_blocks  # held by nobody

        out = decode.generate([PROMPT], GREEDY)[0]
        assert out.outputs[0].token_ids == reference
        assert out.metrics.cached_tokens_gpu == 32  # blocks 0 and 2; 1 and 3-5 computed
        pool.check_invariants()
        sending.close()
        receiving.close()


@pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))
def test_a_prompt_of_whole_blocks_gives_its_holds_back_once_its_request_came(
        smollm2: LoadedModel) -> None:
    prompt = PROMPT[:96]  # 6 whole blocks: the request computes its last token, in block 5
    now = [0.0]
    with _engine(smollm2) as prefill, _engine(smollm2) as decode:
        hashes, payloads = _computed_blocks(prefill, prompt)
        metas = metas_for(_namespace(prefill), hashes, prompt, 16)
        receiving, sending, receiver = _mooncake_pair(prefill, decode, ring=8, timeout_s=5.0,
                                                      hold_s=60.0, clock=lambda: now[0])
        control = LocalControl(receiver, {})
        reservation = control.reserve(prompt, None, "mooncake")
        channel = sending.open_send(reservation["offer"])
        entries = channel.send([OutgoingBlock(i, metas[i], payloads[i]) for i in range(6)])
        answer = control.commit(reservation["handoff_id"], "mooncake", entries, last=True)
        assert _outcome(answer) == {"accepted": list(range(6)), "rejected": []}
        channel.close()

        # Before the request: the six blocks are held for it.
        receiver.sweep()
        assert receiver.num_reservations == 1
        pool = decode.manager.pool
        assert pool.num_free_blocks == decode.num_gpu_blocks - 6

        # The request takes blocks 0-4 (block 5 holds its last token, which it computes):
        # that is the whole prefix it can take, so the holds go back well before hold_s.
        decode.add_request(prompt, SamplingParams(max_tokens=2), request_id="r")
        decode.step()
        receiver.sweep()
        assert receiver.num_reservations == 0
        while decode.has_unfinished():
            decode.step()
        assert pool.num_free_blocks == decode.num_gpu_blocks

        # A request that comes and ends between two sweeps is not seen holding the blocks;
        # a block tap on it (what the server gives every request while a handoff waits)
        # tells the receiver which blocks it took.
        reservation = control.reserve(prompt, "another turn", "mooncake")
        assert receiver.num_awaited == 1
        hashes, payloads = _computed_blocks(prefill, prompt, "another turn")
        metas = metas_for(_namespace(prefill, "another turn"), hashes, prompt, 16)
        channel = sending.open_send(reservation["offer"])
        entries = channel.send([OutgoingBlock(i, metas[i], payloads[i]) for i in range(6)])
        control.commit(reservation["handoff_id"], "mooncake", entries, last=True)
        channel.close()

        def tap(first, tapped_metas, blocks) -> None:
            receiver.taken([meta.block_hash for meta in tapped_metas])
            decode.manager.free(blocks)

        decode.add_request(prompt, SamplingParams(max_tokens=2), cache_salt="another turn",
                           block_tap=tap)
        assert pool.num_free_blocks == decode.num_gpu_blocks - 6  # the handoff's holds
        while decode.has_unfinished():
            decode.step()  # blocks 0-4 come from the handoff, the last token is computed
        receiver.sweep()
        assert receiver.num_reservations == 0 and receiver.num_awaited == 0
        assert pool.num_free_blocks == decode.num_gpu_blocks
        pool.check_invariants()
        sending.close()
        receiving.close()


def _outcome(answer: dict) -> dict:
    """A commit's answer without its timings."""
    return {key: answer[key] for key in ("accepted", "rejected")}


@pytest.mark.skipif(mooncake_available() is not None, reason=str(mooncake_available()))
def test_numbered_commits_that_come_out_of_order_are_taken_in_order(
        smollm2: LoadedModel) -> None:
    reference = _engine(smollm2).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    with _engine(smollm2) as prefill, _engine(smollm2) as decode:
        hashes, payloads = _computed_blocks(prefill, PROMPT)
        metas = metas_for(_namespace(prefill), hashes, PROMPT, 16)
        receiving, sending, receiver = _mooncake_pair(prefill, decode, ring=4, timeout_s=30.0,
                                                      hold_s=30.0)
        control = LocalControl(receiver, {})
        reservation = control.reserve(PROMPT, None, "mooncake")
        handoff_id = reservation["handoff_id"]
        channel = sending.open_send(reservation["offer"])
        # One write of blocks 0-3 (Mooncake reuses its slots after each commit), announced
        # by two commits.
        entries = channel.send([OutgoingBlock(i, metas[i], payloads[i]) for i in range(4)])
        first, second = entries[:2], entries[2:]

        # Part 1 reaches the decode side first: it waits for part 0.
        answered: dict[int, tuple[dict, float]] = {}

        def commit_second() -> None:
            answer = control.commit(handoff_id, "mooncake", second, last=False, part=1)
            answered[1] = (answer, time.monotonic())

        late = threading.Thread(target=commit_second)
        late.start()
        late.join(0.3)
        assert late.is_alive() and not answered, "part 1 was taken before part 0"
        part_0_called = time.monotonic()
        answer = control.commit(handoff_id, "mooncake", first, last=False, part=0)
        answered[0] = (answer, time.monotonic())
        late.join(30)
        assert _outcome(answered[0][0]) == {"accepted": [0, 1], "rejected": []}
        assert _outcome(answered[1][0]) == {"accepted": [2, 3], "rejected": []}
        # Part 1 was answered only once part 0 had come (not compared with part 0's answer:
        # part 1 may be answered before this thread notes when part 0's returned).
        assert answered[1][1] >= part_0_called
        channel.committed()

        # A part taken already is not taken again; the handoff goes on with the next one.
        with pytest.raises(ControlError) as repeated:
            control.commit(handoff_id, "mooncake", [], last=False, part=1)
        assert repeated.value.status == 404
        assert receiver.num_reservations == 1
        last = channel.send([OutgoingBlock(i, metas[i], payloads[i]) for i in (4, 5)])
        answer = control.commit(handoff_id, "mooncake", last, last=True, part=2)
        assert _outcome(answer) == {"accepted": [4, 5], "rejected": []}
        channel.close()

        out = decode.generate([PROMPT], GREEDY)[0]
        assert out.outputs[0].token_ids == reference
        assert out.metrics.cached_tokens_gpu == 6 * 16
        sending.close()
        receiving.close()
