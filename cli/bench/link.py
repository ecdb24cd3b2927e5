"""The link's ceiling for `kvtier bench disagg`: one large transfer between two processes.

torch.distributed (the NCCL transport's ceiling): two processes (one per device) join a
group of two (NCCL between CUDA devices, gloo otherwise) and rank 0 sends one buffer of
`num_bytes` to rank 1 `repeats` times after a warm-up; rank 1 times each receive (a barrier
before, the device synchronized after). Mooncake (its transport's ceiling): a receiving
process registers a host buffer with its Transfer Engine (TCP, P2PHANDSHAKE) and a sending
process writes `num_bytes` into it with one-sided synchronous writes, timed there. The
median gives the bandwidth: the bar a KV handoff over the same path is held against.
Copy engines (what the CUDA IPC transport uses): one process copies `num_bytes` from one
GPU to the other with a peer copy, timed with CUDA events; reported beside NCCL's.

    python -m kvtier.cli.bench.link --rank R --port P --device D --bytes N --repeats K
    python -m kvtier.cli.bench.link --mooncake receive|SESSION@ADDRESS --bytes N ...
    python -m kvtier.cli.bench.link --device D --peer-copy D2 --bytes N --repeats K
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


def measure_mooncake(num_bytes: int, repeats: int = 5, timeout_s: float = 300.0
                     ) -> dict[str, Any]:
    """Write `num_bytes` from one process's registered host buffer into another's over the
    Mooncake Transfer Engine (TCP on loopback), `repeats` times after a warm-up; returns
    the backend, bytes, median seconds and GB/s. Raises ValueError when Mooncake is not
    installed and RuntimeError when a process fails."""
    from kvtier.handoff.mooncake import mooncake_available

    missing = mooncake_available()
    if missing is not None:
        raise ValueError(missing)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "kvtier.cli.bench.link", "--bytes", str(num_bytes),
               "--repeats", str(repeats), "--mooncake"]
    receiver = subprocess.Popen([*command, "receive"], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        where = receiver.stdout.readline().strip() if receiver.stdout else ""
        if not where:
            raise RuntimeError("the Mooncake receiver did not start: "
                               f"{receiver.communicate(timeout=10)[1].strip()[-800:]}")
        sender = subprocess.run([*command, where], env=env, capture_output=True, text=True,
                                timeout=timeout_s)
        if sender.returncode != 0:
            raise RuntimeError(f"the Mooncake sender failed: {sender.stderr.strip()[-800:]}")
    finally:
        if receiver.poll() is None:
            receiver.kill()
        receiver.wait()
    times = json.loads(sender.stdout)["seconds"]
    median = sorted(times)[len(times) // 2]
    return {"backend": "mooncake", "src_device": "cpu", "dst_device": "cpu",
            "bytes": num_bytes, "repeats": repeats, "seconds": median,
            "gb_s": num_bytes / median / 1e9}


def measure_peer_copy(src_device: str, dst_device: str, num_bytes: int, repeats: int = 5,
                      timeout_s: float = 300.0) -> dict[str, Any]:
    """Copy `num_bytes` from `src_device` to `dst_device` (two GPUs) with a peer copy in
    one process of its own, `repeats` times after a warm-up; returns the backend ("copy
    engine"), the bytes, the median seconds and GB/s. Raises ValueError for bad arguments
    and RuntimeError when the process fails."""
    if num_bytes < 1 or repeats < 1 or not (src_device.startswith("cuda")
                                            and dst_device.startswith("cuda")):
        raise ValueError(f"the peer copy measure needs two CUDA devices, bytes >= 1 and "
                         f"repeats >= 1, got {src_device}, {dst_device}, {num_bytes}, "
                         f"{repeats}")
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.bench.link", "--device", src_device,
         "--peer-copy", dst_device, "--bytes", str(num_bytes), "--repeats", str(repeats)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the peer copy measure failed: {done.stderr.strip()[-800:]}")
    times = json.loads(done.stdout)["seconds"]
    median = sorted(times)[len(times) // 2]
    return {"backend": "copy engine", "src_device": src_device, "dst_device": dst_device,
            "bytes": num_bytes, "repeats": repeats, "seconds": median,
            "gb_s": num_bytes / median / 1e9}


def _run_peer_copy(src_device: str, dst_device: str, num_bytes: int, repeats: int) -> None:
    import torch

    source = torch.full((num_bytes,), 7, dtype=torch.uint8, device=src_device)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=dst_device)
    times = []
    for index in range(repeats + 1):  # the first one enables peer access
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        target.copy_(source, non_blocking=True)
        ended.record()
        ended.synchronize()
        if index:
            times.append(began.elapsed_time(ended) / 1e3)
    assert int(target[-1]) == 7, "the copied buffer does not hold what was sent"
    print(json.dumps({"seconds": times}))


def _run_mooncake(role: str, num_bytes: int, repeats: int) -> None:
    import numpy as np
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("the Mooncake engine did not start on 127.0.0.1 (tcp)")
    buffer = np.full(num_bytes, 7 if role != "receive" else 0, dtype=np.uint8)
    if engine.register_memory(buffer.ctypes.data, buffer.nbytes) != 0:
        raise RuntimeError(f"Mooncake could not register {num_bytes} bytes")
    if role == "receive":  # say where to write, then wait until the parent ends this
        print(f"127.0.0.1:{engine.get_rpc_port()}@{buffer.ctypes.data}", flush=True)
        sys.stdin.read()
        return
    session, address = role.split("@")
    times = []
    for index in range(repeats + 1):  # the first one opens the connection
        start = time.perf_counter()
        if engine.transfer_sync_write(session, buffer.ctypes.data, int(address),
                                      num_bytes) != 0:
            raise RuntimeError(f"the Mooncake write to {session} failed")
        if index:
            times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": times}))


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
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--device")
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mooncake", help="receive, or SESSION@ADDRESS to write to")
    parser.add_argument("--peer-copy", help="the device to copy to from --device")
    args = parser.parse_args()
    if args.peer_copy is not None:
        _run_peer_copy(args.device, args.peer_copy, args.bytes, args.repeats)
    elif args.mooncake is not None:
        _run_mooncake(args.mooncake, args.bytes, args.repeats)
    else:
        _run(args.rank, args.port, args.device, args.bytes, args.repeats)
