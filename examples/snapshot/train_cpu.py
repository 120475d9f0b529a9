#!/usr/bin/python3
"""One training rank of the snapshot example (issue 6): a small MLP trained on CPU with
torch.distributed (gloo), snapshotted every step through the node's r2ccl_snapshotd, and
recovered after a node loss. Started by run_example.py, one process per node; see README.md.

Determinism: the data of step s comes from a generator seeded with (seed, s), each rank takes
its slice of the global batch; gradients are averaged with one all_reduce; dropout draws from
torch's global CPU RNG, which is part of every snapshot (capture_torch_rng/restore_torch_rng).
For a given world size the run is therefore a pure function of the seed, and after restoring
step S every rank recomputes S+1.. exactly as a run without a fault did.

Roles:
  original rank      opens its node's daemon, waits for the full membership, builds the
                     process group, trains; on a failed collective it recovers (below)
  --pause-at K       (the rank the launcher kills) writes RUN_DIR/paused-r<rank> at the start
                     of step K and waits to be SIGKILLed with its daemon
  --replacement      a new process for a lost rank: joins the new membership, builds the
                     process group with the survivors, restores the newest complete step
Recovery of a survivor: the collective raises -> wait until the daemons agree on a membership
without the lost node (writes RUN_DIR/lost-seen-r<rank>, the launcher's cue to start the
replacement node) -> wait for the membership with the replacement -> reinit_process_group()
for that epoch -> restore() the newest complete step S and the RNG -> log the recovery line ->
continue at S+1, with the learning rate scaled by the recovery hint for its steps.
Rank 0 writes RUN_DIR/result.json at the end (final evaluation loss, per-step losses, the
restored step, the recovery line and phase times).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

try:
    import r2ccl_snapshot as r2s
except ImportError:  # a source checkout: ../../snapshot/python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "snapshot", "python"))
    import r2ccl_snapshot as r2s

IN_DIM, HIDDEN, OUT_DIM = 16, 64, 1
PER_RANK_BATCH = 32
NOISE_STD = 0.05
EVAL_SAMPLES = 2048


def log(rank, msg):
    print("[rank %d] %s" % (rank, msg), flush=True)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN_DIM, HIDDEN)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT_DIM)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def teacher(x, seed):
    """The regression target: a fixed random function of x (the same for every rank)."""
    g = torch.Generator().manual_seed(seed * 7919 + 1)
    w = torch.randn(IN_DIM, 8, generator=g) / IN_DIM ** 0.5
    v = torch.randn(8, 1, generator=g) / 8 ** 0.5
    return torch.sin(x @ w) @ v


def batch(step, rank, world, seed):
    """This rank's slice of step `step`'s global batch: generated from (seed, step) only."""
    g = torch.Generator().manual_seed(seed * 1000003 + step)
    x = torch.randn(PER_RANK_BATCH * world, IN_DIM, generator=g)
    y = teacher(x, seed) + NOISE_STD * torch.randn(PER_RANK_BATCH * world, 1, generator=g)
    lo = rank * PER_RANK_BATCH
    return x[lo:lo + PER_RANK_BATCH], y[lo:lo + PER_RANK_BATCH]


def eval_loss(model, seed):
    g = torch.Generator().manual_seed(seed * 1000003 + 999999937)
    x = torch.randn(EVAL_SAMPLES, IN_DIM, generator=g)
    y = teacher(x, seed)
    model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y).item()
    model.train()
    return loss


def init_adam_state(opt):
    """Adam's state as its first step would create it (torch 1.13: step is a 0-dim float
    tensor), so every process, a replacement included, registers the same buffers before its
    first take() or restore()."""
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {"step": torch.tensor(0.0),
                            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(p,
                                                           memory_format=torch.preserve_format)}


def wait_state(snap, pred, timeout_s, what):
    """The daemon's state once pred(state) holds; wait_event() wakes on every epoch or
    complete-step change. Raises TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = snap.state()
        if pred(st):
            return st
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no %s within %.0f s (last state: epoch %d, members %s, complete "
                               "step %s)" % (what, timeout_s, st["epoch"], st["members"],
                                             st["complete_step"]))
        snap.wait_event(min(left, 0.5))


def touch(run_dir, name):
    path = os.path.join(run_dir, name)
    with open(path + ".tmp", "w") as f:
        f.write("%f\n" % time.time())
    os.replace(path + ".tmp", path)


class Trainer:
    def __init__(self, args):
        self.a = args
        self.rank, self.world = args.rank, args.world
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        self.model = Mlp()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        init_adam_state(self.opt)
        torch.manual_seed(args.seed * 31 + self.rank)  # per-rank dropout stream
        self.snap = r2s.Snapshot(self.rank, self.world, socket=args.socket)
        self.names = self.snap.register_torch_module(self.model, self.opt)
        if self.rank == 0:
            log(self.rank, "registered %d buffers: %s" % (len(self.names), " ".join(self.names)))
        self.params = list(self.model.parameters())
        self.flat = torch.zeros(sum(p.numel() for p in self.params) + 1)
        self.lr_scale_until = -1  # steps <= this run with lr * hint factor
        self.hint_factor = 1.0
        self.losses = {}
        self.recovery = None
        self.group_epoch = 0  # the membership epoch the process group was built for

    def all_members(self, st):
        return st["epoch"] > 0 and st["members"] == list(range(self.world))

    def build_group(self, st):
        r2s.reinit_process_group(self.snap, st["epoch"], self.rank, self.world,
                                 timeout_s=self.a.pg_timeout)
        self.group_epoch = st["epoch"]

    def set_lr(self, step):
        f = self.hint_factor if step <= self.lr_scale_until else 1.0
        for g in self.opt.param_groups:
            g["lr"] = self.a.lr * f
        return f

    def train_step(self, step):
        lr_factor = self.set_lr(step)
        x, y = batch(step, self.rank, self.world, self.a.seed)
        self.opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        # One all_reduce for every gradient and the loss: the average over the ranks.
        off = 0
        for p in self.params:
            n = p.numel()
            self.flat[off:off + n].copy_(p.grad.reshape(-1))
            off += n
        self.flat[off] = loss.detach()
        dist.all_reduce(self.flat)
        self.flat.div_(self.world)
        off = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(self.flat[off:off + n].view_as(p.grad))
            off += n
        self.opt.step()
        self.losses[step] = self.flat[off].item()
        self.snap.capture_torch_rng()
        st = self.snap.take(step)
        if self.rank == 0 and (step % 10 == 0 or step == 1 or lr_factor != 1.0):
            snap = ""
            if st["prev_valid"]:
                snap = "; snapshot of step %d: %d -> %d bytes, %d bases, encode %.1f ms" % (
                    st["prev_step"], st["prev_raw_bytes"], st["prev_encoded_bytes"],
                    st["prev_base_buffers"], 1e3 * st["prev_encode_seconds"])
            log(self.rank, "step %d loss %.6f%s%s" % (
                step, self.losses[step],
                "" if lr_factor == 1.0 else " (lr x %g: recovery hint)" % lr_factor, snap))

    def restore(self):
        """Restores the newest complete step on every rank of the (new) group; returns it."""
        st = wait_state(self.snap, lambda s: s["complete_step"] is not None,
                        self.a.restore_timeout, "complete step to restore")
        step = self.snap.restore(self.a.restore_timeout)
        self.snap.restore_torch_rng()
        # Every rank must have restored the same step (a consistent cut).
        t = torch.tensor([float(step), -float(step)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t[0].item() != step or -t[1].item() != step:
            raise RuntimeError("ranks restored different steps: %d..%d (this rank %d; the "
                               "daemon's complete step was %s)"
                               % (-t[1].item(), t[0].item(), step, st["complete_step"]))
        factor, steps = self.snap.recovery_hint()
        self.hint_factor = factor
        self.lr_scale_until = step + steps
        return step, factor, steps

    def recover(self, failed_step, t_collective, t_err, err):
        """A survivor's recovery after the collective of `failed_step` raised at t_err."""
        log(self.rank, "step %d: collective failed after %.3f s: %s"
            % (failed_step, t_err - t_collective, err.splitlines()[0][:160]))
        # Any membership change since the group was built. A survivor slow to get here may
        # only see the later membership that already has the replacement: then the loss
        # itself is not in its view ("unknown" in the recovery line).
        st = wait_state(self.snap, lambda s: s["epoch"] > self.group_epoch,
                        self.a.membership_timeout, "membership change")
        lost = sorted(set(range(self.world)) - set(st["members"]))
        t_members = time.monotonic()
        log(self.rank, "epoch %d: members %s (lost node %s)"
            % (st["epoch"], st["members"], ",".join(map(str, lost)) or "not seen"))
        touch(self.a.run_dir, "lost-seen-r%d" % self.rank)
        st = wait_state(self.snap, lambda s: s["epoch"] > self.group_epoch and
                        self.all_members(s), self.a.replacement_timeout,
                        "membership with the replacement node")
        t_joined = time.monotonic()
        self.build_group(st)
        t_pg = time.monotonic()
        step, factor, steps = self.restore()
        t_restored = time.monotonic()
        phases = [("detect", t_err - t_collective), ("membership", t_members - t_err),
                  ("replacement", t_joined - t_members), ("comm rebuild", t_pg - t_joined),
                  ("restore", t_restored - t_pg)]
        line = self.snap.log_recovered(lost or ["unknown"], phases)
        log(self.rank, "epoch %d: restored step %d; replaying from step %d; lr x %g for %d "
            "steps (recovery hint)" % (st["epoch"], step, step + 1, factor, steps))
        self.recovery = {"failed_step": failed_step, "restored_step": step, "lost": lost,
                         "epoch": st["epoch"], "line": line, "hint": [factor, steps],
                         "phases": dict(phases), "total_s": t_restored - t_collective}
        return step + 1

    def join_as_replacement(self):
        st = wait_state(self.snap, self.all_members, self.a.replacement_timeout,
                        "membership with this node")
        t0 = time.monotonic()
        self.build_group(st)
        t1 = time.monotonic()
        step, factor, steps = self.restore()
        log(self.rank, "replacement: epoch %d, process group in %.3f s, restored step %d in "
            "%.3f s; lr x %g for %d steps" % (st["epoch"], t1 - t0, step,
                                              time.monotonic() - t1, factor, steps))
        return step + 1

    def run(self):
        a = self.a
        if a.replacement:
            step = self.join_as_replacement()
        else:
            st = wait_state(self.snap, self.all_members, a.membership_timeout,
                            "membership of all %d nodes" % self.world)
            self.build_group(st)
            step = 1
        while step <= a.steps:
            if a.pause_at == step:
                log(self.rank, "step %d: pausing for the launcher's SIGKILL" % step)
                touch(a.run_dir, "paused-r%d" % self.rank)
                time.sleep(a.pause_timeout)
                raise SystemExit("rank %d: paused at step %d for %.0f s and not killed"
                                 % (self.rank, step, a.pause_timeout))
            t0 = time.monotonic()
            failed = None
            try:
                self.train_step(step)
            except RuntimeError as e:  # gloo: "Connection closed by peer", timeouts
                if self.recovery is not None:
                    raise  # one recovery per run in this example
                failed = (time.monotonic(), str(e))
            if failed is None:
                step += 1
                continue
            # Close this rank's gloo connections at once: a survivor blocked on a receive
            # from this rank (not from the lost one) then fails too instead of waiting for
            # the collective timeout.
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 (the group is being replaced anyway)
                log(self.rank, "destroy_process_group: %s" % e)
            step = self.recover(step, t0, *failed)
        self.snap.flush(30.0)
        final = eval_loss(self.model, a.seed)
        log(self.rank, "final eval loss %.9f" % final)
        if self.rank == 0:
            try:  # informational: snapshots kept completing after a recovery
                complete = wait_state(self.snap, lambda s: (s["complete_step"] or 0) >= a.steps,
                                      10.0, "complete step %d" % a.steps)["complete_step"]
            except TimeoutError:
                complete = self.snap.state()["complete_step"]
            log(self.rank, "newest complete snapshot: step %s" % complete)
            res = {"final_eval_loss": final, "steps": a.steps, "world": self.world,
                   "train_loss": [self.losses[s] for s in sorted(self.losses)],
                   "recovery": self.recovery, "complete_step": complete}
            path = os.path.join(a.run_dir, "result.json")
            with open(path + ".tmp", "w") as f:
                json.dump(res, f, indent=1)
            os.replace(path + ".tmp", path)
        dist.barrier()
        dist.destroy_process_group()
        self.snap.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--socket", required=True, help="this node's r2ccl_snapshotd socket")
    p.add_argument("--run-dir", required=True, help="markers and result.json")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--pause-at", type=int, default=0, help="pause at this step (to be killed)")
    p.add_argument("--replacement", action="store_true", help="a replacement for a lost rank")
    p.add_argument("--pg-timeout", type=float, default=30.0,
                   help="process group rendezvous and collective timeout, s")
    p.add_argument("--membership-timeout", type=float, default=20.0)
    p.add_argument("--replacement-timeout", type=float, default=60.0)
    p.add_argument("--restore-timeout", type=float, default=30.0)
    p.add_argument("--pause-timeout", type=float, default=60.0)
    a = p.parse_args()
    torch.set_num_threads(1)  # deterministic and light on a shared machine
    Trainer(a).run()


if __name__ == "__main__":
    main()
