#!/usr/bin/env python3
"""One rank of scripts/gpu_e2e.sh: a checked torch.distributed all_reduce sweep over NCCL.

Started twice by gpu_e2e.sh (no torchrun): MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come
from the environment, every rank uses CUDA device --device (0). The NCCL_* and R2CCL_*
variables that select the net and tuner plugins are the script's business; this file only
runs collectives and reports.

Each element of rank r's buffer is (r + 1) * h(i), h(i) = (i * 7919) % 1021 + 1, so a chunk
landing at a wrong offset or a lost chunk shows up; the sum over ranks is exact in float32.
Every all_reduce is checked against the expected sum (the buffer is refilled before each one).

Output, one line per size and pass (parsed by check_log.py):
  RESULT tag=T rank=R pass=P bytes=B iters=N time_us=X algbw_GBs=A busbw_GBs=B wrong_iters=K
         wrong_elems=E check=OK|BAD t=MONO
  (t: CLOCK_MONOTONIC seconds when the size finished, the clock of r2ccl's "[R2CCL]" lines)
and at the end "DONE tag=T rank=R passes=P results=N wrong=W". Exit 0 only if W == 0.
busbw = algbw * 2 (n - 1) / n, as in nccl-tests.
"""
import argparse
import datetime
import os
import sys
import time


def size_list(lo, hi, factor):
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", default="run")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--min-bytes", type=int, default=8 << 10)
    ap.add_argument("--max-bytes", type=int, default=128 << 20)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--passes", type=int, default=2, help="sweeps over the same communicator")
    ap.add_argument("--min-seconds", type=float, default=0.0,
                    help="keep sweeping until this long after the first collective")
    ap.add_argument("--max-passes", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=1, help="unreported all_reduces per size, pass 0")
    ap.add_argument("--budget-bytes", type=int, default=256 << 20,
                    help="iterations per size = budget / size, clamped to [min-iters, max-iters]")
    ap.add_argument("--min-iters", type=int, default=3)
    ap.add_argument("--max-iters", type=int, default=20)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="torch.distributed timeout")
    ap.add_argument("--cpu", action="store_true",
                    help="gloo on the CPU instead of NCCL on a GPU: only to test this script")
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.cpu:
        dev, backend, nccl, name = torch.device("cpu"), "gloo", "none", "cpu"
    else:
        torch.cuda.set_device(a.device)
        dev, backend = torch.device("cuda", a.device), "nccl"
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        name = torch.cuda.get_device_name(dev).replace(" ", "_")
    print(f"WORKER tag={a.tag} rank={rank} world={world} torch={torch.__version__} nccl={nccl} "
          f"device={name} hostid={os.environ.get('NCCL_HOSTID', '')}", flush=True)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.timeout_s))

    n_max = a.max_bytes // 4
    i = torch.arange(n_max, device=dev, dtype=torch.int64)
    h = ((i * 7919) % 1021 + 1).to(torch.float32)
    del i
    src = h * float(rank + 1)
    expected = h * float(world * (world + 1) // 2)
    del h
    buf = torch.empty_like(src)

    def timed_all_reduce(b):  # milliseconds of one all_reduce
        if a.cpu:
            t0 = time.perf_counter()
            dist.all_reduce(b)
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    bus = 2.0 * (world - 1) / world

    wrong_total, results, p = 0, 0, 0
    t_first = None
    while p < a.max_passes:
        if p >= a.passes:
            # Every rank must run the same number of passes: go on if any rank wants to.
            more = t_first is None or time.monotonic() - t_first < a.min_seconds
            flag = torch.tensor([1.0 if more else 0.0], device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() == 0.0:
                break
        for nbytes in size_list(a.min_bytes, a.max_bytes, a.factor):
            n = nbytes // 4
            b, s, e = buf[:n], src[:n], expected[:n]
            iters = max(a.min_iters, min(a.max_iters, a.budget_bytes // nbytes))
            for _ in range(a.warmup if p == 0 else 0):
                b.copy_(s)
                dist.all_reduce(b)
                if t_first is None:
                    t_first = time.monotonic()
            total_ms, wrong_iters, wrong_elems = 0.0, 0, 0
            for _ in range(iters):
                b.copy_(s)
                total_ms += timed_all_reduce(b)
                if t_first is None:
                    t_first = time.monotonic()
                if not torch.equal(b, e):
                    wrong_iters += 1
                    wrong_elems += int((b != e).sum().item())
            t_us = total_ms * 1e3 / iters
            algbw = nbytes / (t_us * 1e-6) / 1e9
            wrong_total += wrong_elems + wrong_iters
            results += 1
            print(f"RESULT tag={a.tag} rank={rank} pass={p} bytes={nbytes} iters={iters} "
                  f"time_us={t_us:.1f} algbw_GBs={algbw:.3f} busbw_GBs={algbw * bus:.3f} "
                  f"wrong_iters={wrong_iters} wrong_elems={wrong_elems} "
                  f"check={'OK' if wrong_iters == 0 else 'BAD'} t={time.monotonic():.6f}",
                  flush=True)
        p += 1
    dist.barrier()
    dist.destroy_process_group()
    print(f"DONE tag={a.tag} rank={rank} passes={p} results={results} wrong={wrong_total}",
          flush=True)
    return 0 if wrong_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
