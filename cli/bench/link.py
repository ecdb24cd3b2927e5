"""The link's ceiling for `kvtier bench disagg`: one large send/recv between two processes.

Two processes (one per device) join a torch.distributed group of two (NCCL between CUDA
devices, gloo otherwise) and rank 0 sends one buffer of `num_bytes` to rank 1 `repeats`
times after a warm-up; rank 1 times each receive (a barrier before, the device synchronized
after) and the median gives the bandwidth. This is the bar a KV handoff between the same
two devices is held against.

    python -m kvtier.cli.bench.link --rank R --port P --device D --bytes N --repeats K
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any


def measure_link(src_device: str, dst_device: str, num_bytes: int, repeats: int = 5,
                 timeout_s: float = 300.0) -> dict[str, Any]:
    """Send `num_bytes` from a process on `src_device` to one on `dst_device`, `repeats`
    times; returns the backend, the bytes, the median seconds and GB/s (1e9 bytes/s).
    Raises ValueError for bad arguments and RuntimeError when a process fails."""
    if num_bytes < 1 or repeats < 1:
        raise ValueError(f"the link measure needs bytes >= 1 and repeats >= 1, got "
                         f"{num_bytes} and {repeats}")
    cuda = src_device.startswith("cuda") and dst_device.startswith("cuda")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.bench.link", "--rank", str(rank), "--port",
         str(port), "--device", device if cuda else "cpu", "--bytes", str(num_bytes),
         "--repeats", str(repeats)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank, device in enumerate((src_device, dst_device))]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (_, err) in zip(procs, outputs):
        if proc.returncode != 0:
            raise RuntimeError(f"the link measure's process failed: {err.strip()[-800:]}")
    times = json.loads(outputs[1][0])["seconds"]
    median = sorted(times)[len(times) // 2]
    return {"backend": "nccl" if cuda else "gloo", "src_device": src_device,
            "dst_device": dst_device, "bytes": num_bytes, "repeats": repeats,
            "seconds": median, "gb_s": num_bytes / median / 1e9}


def _run(rank: int, port: int, device_name: str, num_bytes: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)  # [num_bytes]
        if rank == 0:
            buffer.fill_(7)
        times = []
        for index in range(repeats + 1):  # the first one warms the connection up
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, dst=1)
            else:
                dist.recv(buffer, src=0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if index:
                times.append(time.perf_counter() - start)
        if rank == 1:
            assert int(buffer[-1]) == 7, "the received buffer does not hold what was sent"
            print(json.dumps({"seconds": times}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    _run(args.rank, args.port, args.device, args.bytes, args.repeats)
