"""word_checksum against its torch reference: rows of one word, rows that end inside a
program's slice, rows of several programs, and sums that wrap past 2**63."""

from __future__ import annotations

import kernel_cases as cases
import pytest
import torch
from kvtier.kernels import reference, word_checksum
from kvtier.kernels.word_checksum import WORDS_PER_PROGRAM

# (rows, bytes per row): one word; a partial tile; a partial last program; two programs.
SHAPES = [(3, 4), (2, 1028), (3, 4 * WORDS_PER_PROGRAM + 12), (1, 8 * WORDS_PER_PROGRAM)]


def random_rows(num_rows: int, num_bytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_rows, num_bytes), dtype=torch.uint8, generator=generator)


def test_the_reference_wraps_modulo_2_to_the_64() -> None:
    num_words = 2**17
    rows = torch.full((1, 4 * num_words), 0xFF, dtype=torch.uint8)
    rows[0, 3::4] = 0x7F  # every word 2**31 - 1
    exact = (2**31 - 1) * num_words ** 2  # sum of (2i+1) over i < n is n**2
    assert exact >= 2**63
    wrapped = int(reference.word_checksum(rows)[0]) & (2**64 - 1)
    assert wrapped == exact % 2**64


@cases.needs_interpreter
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_word_checksum_matches_reference(shape: tuple[int, int]) -> None:
    rows = random_rows(*shape, seed=shape[1])
    assert torch.equal(word_checksum(rows), reference.word_checksum(rows))


@cases.needs_interpreter
def test_word_checksum_reads_the_rows_named_where_they_are() -> None:
    rows = random_rows(9, 1 << 10, seed=7)
    ids = [8, 0, 3, 3]
    assert torch.equal(word_checksum(rows, ids), reference.word_checksum(rows[ids]))
    assert word_checksum(rows, []).shape == (0,)


@cases.needs_interpreter
def test_word_checksum_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="whole 32-bit words"):
        word_checksum(torch.zeros((2, 6), dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous uint8"):
        word_checksum(torch.zeros((2, 8), dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous uint8"):
        word_checksum(torch.zeros((8, 2), dtype=torch.uint8).t())
    assert word_checksum(torch.zeros((0, 8), dtype=torch.uint8)).shape == (0,)
    with pytest.raises(ValueError, match=r"row_ids must lie in \[0, 2\)"):
        word_checksum(torch.zeros((2, 8), dtype=torch.uint8), [0, 2])


@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize("shape", SHAPES + [(64, 2 << 20)], ids=str)
def test_gpu_word_checksum_matches_reference(shape: tuple[int, int]) -> None:
    rows = random_rows(*shape, seed=shape[1])
    assert torch.equal(word_checksum(rows.cuda()).cpu(), reference.word_checksum(rows))
    ids = list(range(shape[0] - 1, -1, -2))
    assert torch.equal(word_checksum(rows.cuda(), ids).cpu(), reference.word_checksum(rows[ids]))
