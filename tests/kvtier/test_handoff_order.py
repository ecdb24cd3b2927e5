"""The torch.distributed handoff transport keeps its pair in step: the decode side
receives every send as it is announced, ahead of its commit, and a commit takes its send by
number whatever order the commits come in; a commit whose send never comes breaks the pair
after the turn timeout instead of holding the threads behind it, and a broken pair forms
again. Two real processes on gloo over loopback (`handoff_pair_worker.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.cli.bench.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]


def _pair(receiver_role: str) -> dict:
    """Run a sender and a receiver of `receiver_role`; the receiver's JSON answer."""
    init = f"tcp://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "tests.kvtier.handoff_pair_worker"]
    sender = subprocess.Popen([*command, "sender", init], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        receiver = subprocess.run([*command, receiver_role, init], cwd=ROOT,
                                  capture_output=True, text=True, timeout=180)
    finally:
        sender.kill()
        sender.communicate()
    assert receiver.returncode == 0, receiver.stderr[-2000:]
    return json.loads(receiver.stdout.strip().splitlines()[-1])


def test_sends_land_ahead_of_their_commits_and_are_taken_by_number() -> None:
    seen = _pair("landing")
    # Both sends were received while nothing had asked for them yet (no commit came).
    assert seen["landed_ahead"] == 2 and seen["left"] == 0
    assert seen["values"] == [[0], [1]]  # each send's bytes where its number says


def test_a_commit_whose_send_never_came_breaks_the_pair_after_the_turn_timeout() -> None:
    seen = _pair("lost")
    assert seen["error"] is not None and "send 2 never came" in seen["error"]
    assert 0.9 <= seen["seconds"] < 30  # the turn timeout (1 s), not the op timeout (60 s)
    assert seen["ready"] is False  # handoffs use another transport from now on


def test_a_broken_pair_forms_again_and_the_old_generations_sends_are_gone() -> None:
    seen = _pair("reform")
    assert "send 2 never came" in seen["error"] and seen["ready"] is False
    # Both sides' keepers formed the next generation: the sender's first send in it lands.
    assert seen["formed_again"] and seen["generation"] == 1
    assert seen["values"] == [7]
    # A commit of the old generation that arrives late takes no bytes of the new one.
    assert "generation 0 is gone" in seen["old_send"]


@pytest.mark.parametrize("turn_timeout_s", [0.0, -1.0])
def test_a_turn_timeout_must_be_positive(turn_timeout_s: float) -> None:
    from kvtier.handoff.torch_dist import TorchDistTransport
    from tests.kvtier.handoff_pair_worker import LAYOUT

    with pytest.raises(ValueError, match="turn_timeout_s must be > 0"):
        TorchDistTransport(LAYOUT, "tcp://127.0.0.1:1", 0, "gloo",
                           turn_timeout_s=turn_timeout_s)
