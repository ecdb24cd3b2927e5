"""Plots for `kvtier bench longctx --plot`: the swap timeline and the TTFT comparison.

matplotlib is an optional dependency (`pip install kvtier[plot]`); it is imported only when a
plot is drawn, and its absence is reported as one clear error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib, which is not installed; "
                         "install it with `pip install 'kvtier[plot]'` or drop --plot") from exc
    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt
    return plt


def _phase_starts(timeline: list[dict[str, Any]]) -> list[tuple[int, str]]:
    starts, previous = [], None
    for sample in timeline:
        if sample["phase"] != previous:
            starts.append((sample["step"], sample["phase"]))
            previous = sample["phase"]
    return starts


def check_plotting() -> None:
    """Raise ValueError now when matplotlib is missing (before a long run that would plot)."""
    _pyplot()


def plot_longctx(result: dict[str, Any], path: str | Path) -> Path:
    """Draw the long-context benchmark `result` (as `run_longctx_bench` returns it) to `path`.

    One row per strategy with tiers: blocks held by the GPU pool, the host tier and the disk
    tier after every engine step, and the compute and load fronts of a restore in progress
    (block indexes; they meet where loading and computing stop) (left), and MiB moved in
    that step per direction (right), with the rounds marked. A last row compares round-two
    TTFT p50 per strategy, with p90 and p99 marks. Returns the path written. Raises
    ValueError when matplotlib is missing, OSError when the file cannot be written.
    """
    plt = _pyplot()
    strategies: dict[str, Any] = result["strategies"]
    tiered = [name for name in strategies if name != "recompute"]
    num_rows = len(tiered) + 1
    fig = plt.figure(figsize=(12, 3.2 * num_rows))
    grid = fig.add_gridspec(num_rows, 2)

    for row, name in enumerate(tiered):
        timeline = strategies[name]["timeline"]
        steps = [sample["step"] for sample in timeline]
        occupancy_ax = fig.add_subplot(grid[row, 0])
        for key, label in (("gpu_blocks", "GPU (cached)"), ("host_blocks", "host"),
                           ("disk_blocks", "disk")):
            occupancy_ax.step(steps, [sample[key] for sample in timeline], where="post",
                              label=label)
        fronts = [sample.get("fronts") or [None] for sample in timeline]
        if any(f[0] for f in fronts):  # the first restore of each step: its two fronts
            for key, label, style in (("compute_block", "compute front", "--"),
                                      ("load_block", "load front", ":")):
                occupancy_ax.step(steps, [f[0][key] if f[0] else float("nan") for f in fronts],
                                  where="post", linestyle=style, color="black", label=label)
        occupancy_ax.set_title(f"{name}: blocks per tier; restore fronts (block index)")
        occupancy_ax.set_ylabel("blocks")
        bytes_ax = fig.add_subplot(grid[row, 1], sharex=occupancy_ax)
        bottom = [0.0] * len(timeline)
        for direction in timeline[0]["bytes_moved"] if timeline else ():
            mib = [sample["bytes_moved"][direction] / 2**20 for sample in timeline]
            if any(mib):  # stacked: a step's bar is all the bytes it moved
                bytes_ax.bar(steps, mib, bottom=bottom, width=0.8, label=direction)
                bottom = [b + m for b, m in zip(bottom, mib)]
        bytes_ax.set_title(f"{name}: MiB moved per step")
        bytes_ax.set_ylabel("MiB")
        for ax in (occupancy_ax, bytes_ax):
            for step, phase in _phase_starts(timeline):
                ax.axvline(step - 0.5, color="grey", linestyle=":", linewidth=0.8)
                ax.annotate(phase, (step - 0.5, 1.0), xycoords=("data", "axes fraction"),
                            fontsize="x-small", color="grey", va="top")
            ax.set_xlabel("engine step")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="x-small", loc="center right")

    ttft_ax = fig.add_subplot(grid[num_rows - 1, :])
    names = list(strategies)
    positions = list(range(len(names)))
    p50 = [strategies[name]["ttft_s"]["p50"] * 1e3 for name in names]
    p90 = [strategies[name]["ttft_s"]["p90"] * 1e3 for name in names]
    p99 = [strategies[name]["ttft_s"]["p99"] * 1e3 for name in names]
    ttft_ax.bar(positions, p50, width=0.5, color="tab:blue", label="p50")
    ttft_ax.scatter(positions, p90, color="tab:orange", marker="_", s=600, label="p90", zorder=3)
    ttft_ax.scatter(positions, p99, color="tab:red", marker="_", s=600, label="p99", zorder=3)
    for x, name in zip(positions, names):
        ratio = strategies[name]["speedup_vs_recompute"]
        ttft_ax.annotate(f"{ratio:.1f}x", (x + 0.27, p50[x]), ha="left", va="center")
    ttft_ax.set_xticks(positions, names)
    ttft_ax.set_title(f"Round-two time to first token, {result['prompt_tokens']}-token prompts "
                      "(ms; label = speedup over recompute)")
    ttft_ax.set_ylabel("ms")
    ttft_ax.legend(fontsize="small")

    fig.tight_layout()
    out = Path(path)
    try:
        fig.savefig(out, dpi=110)
    except OSError as exc:
        raise OSError(f"cannot write the plot to {out}: {exc.strerror or exc}; "
                      "choose a writable path") from exc
    finally:
        plt.close(fig)
    return out
