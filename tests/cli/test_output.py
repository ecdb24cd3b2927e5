"""Tables stay readable at 80 columns and when piped: nothing is cut."""

from __future__ import annotations

import io
import re

import pytest
from kvtier.cli import common
from rich.console import Console

SOAK_COLUMNS = ("phase", "requests", "steps", "preempted", "gpu", "host", "disk", "computed",
                "disk pruned", "disk rejected")
SOAK_ROWS = [(1, 100, 2345, 12, 12345, 23456, 3456, 123456, 12, 0),
             (2, 1000, 23450, 120, 123450, 234560, 34560, 1234560, 120, 3)]
STATS_ROWS = [("path", "/home/someone/.cache/kvtier/kv/a/long/path/that/goes/on/and/on/and/on"),
              ("blocks", "1,234"), ("record bytes", "12.5 MiB"), ("disk format", 2)]


def render(monkeypatch, width: int, columns, rows, title: str = "a title") -> str:
    out = io.StringIO()
    monkeypatch.setattr(common, "Console",
                        lambda stderr=False: Console(file=out, width=width, color_system=None))
    common.print_table(title, columns, rows)
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 60, 200])
@pytest.mark.parametrize("columns, rows", [(SOAK_COLUMNS, SOAK_ROWS),
                                           (("item", "value"), STATS_ROWS)])
def test_no_header_or_cell_is_cut(monkeypatch, width, columns, rows) -> None:
    text = render(monkeypatch, width, columns, rows,
                  title="bench soak: 300 requests, random:tiny-llama@1234, GPU 12 blocks, "
                        "host 8 slots, disk 64 blocks, 3 phases")
    assert "…" not in text
    assert all(len(line) <= width for line in text.splitlines())
    words = re.findall(r"\S+", text)
    joined = "".join(text.split())  # long cells may fold over lines
    for header in columns:
        for word in header.split():
            assert word in words, (word, text)
    for row in rows:
        for cell in row:
            assert "".join(str(cell).split()) in joined, (cell, text)
    assert "disk 64 blocks, 3 phases" in " ".join(text.split())  # the title wraps, whole


def test_tables_go_to_stderr_when_asked(capsys) -> None:
    common.print_table("stats", ("a", "b"), [(1, 2)], err=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "stats" in captured.err
