"""A CUDA memory snapshot (`lmsys.profiling.memory_snapshot`: the pickle https://pytorch.org/memory_viz reads) as a
timeline of allocated bytes (a PNG) and the largest allocations with the Python stacks that made them.

The snapshot holds the allocator's segments at the moment of the dump and the trace of its events while history was
recorded (alloc, free_requested, free_completed, segment_alloc, ...). Memory allocated before recording started
has no event, so the timeline is anchored at the end: the bytes still allocated at the dump minus the net change of
the recorded events gives the level at the first event.
"""

import os
from pathlib import Path

import pandas as pd
import torch

# Blocks that still count as allocated at the dump (a freed block waits for other streams in active_awaiting_free).
_ALLOCATED_STATES = ("active_allocated", "active_awaiting_free")
_TORCH_DIR = os.path.dirname(torch.__file__)


def timeline(snapshot: dict, device: int = 0) -> pd.DataFrame:
    """Allocated bytes after each alloc / free_completed event of the recorded history, with the event's time in ms
    since the first event (NaN when the trace has no times)."""
    trace = [e for e in snapshot["device_traces"][device] if e["action"] in ("alloc", "free_completed")]
    at_dump = sum(
        block["size"]
        for segment in snapshot["segments"]
        if segment.get("device", device) == device
        for block in segment["blocks"]
        if block["state"] in _ALLOCATED_STATES
    )
    change = pd.Series([e["size"] if e["action"] == "alloc" else -e["size"] for e in trace], dtype="int64")
    start = at_dump - int(change.sum())
    times = pd.Series([e.get("time_us") for e in trace], dtype="float64")
    return pd.DataFrame({
        "event": range(len(trace)),
        "time_ms": (times - times.iloc[0]) / 1e3 if len(trace) else times,
        "action": [e["action"] for e in trace],
        "allocated_bytes": start + change.cumsum(),
    })


def _user_frames(frames: list[dict], limit: int) -> list[dict]:
    """The frames outside torch itself (the model, the step, this tool); the innermost ones when there are none."""
    own = [f for f in frames if not f["filename"].startswith((_TORCH_DIR, "<", "??")) and f["filename"]]
    return (own or frames)[:limit]


def largest_allocations(snapshot: dict, count: int = 10, device: int = 0, frames: int = 6) -> list[dict]:
    """The `count` largest allocations of the recorded history: size in bytes, event number, and up to `frames`
    Python frames (innermost first) outside torch."""
    allocs = [(i, e) for i, e in enumerate(snapshot["device_traces"][device]) if e["action"] == "alloc"]
    allocs.sort(key=lambda item: item[1]["size"], reverse=True)
    return [
        {"size": e["size"], "event": i, "frames": _user_frames(e.get("frames", []), frames)} for i, e in allocs[:count]
    ]


def format_allocations(allocations: list[dict]) -> str:
    """The largest allocations as text: size and event, then one 'file:line function' line per frame."""
    lines = []
    for alloc in allocations:
        lines.append(f"{alloc['size'] / 2**20:10.1f} MiB  (event {alloc['event']})")
        lines += [f"      {f['filename']}:{f['line']} {f['name']}" for f in alloc["frames"]]
    return "\n".join(lines) if lines else "no allocations were recorded"


def plot_timeline(data: pd.DataFrame, path: Path, title: str) -> None:
    """Allocated GiB over the recorded events (over time when the trace has times) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    timed = data["time_ms"].notna().all() and len(data)
    x = data["time_ms"] if timed else data["event"]
    ax.step(x, data["allocated_bytes"] / 2**30, where="post")
    ax.set_xlabel("ms since recording started" if timed else "allocator event")
    ax.set_ylabel("allocated GiB")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
