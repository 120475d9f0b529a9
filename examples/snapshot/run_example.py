#!/usr/bin/python3
"""The snapshot example's launcher (issue 6): a loopback cluster of 4 "nodes", each one
r2ccl_snapshotd (own health board, client socket, 100 ms heartbeats) and one training rank
(train_cpu.py, torch.distributed over gloo). Three runs of the same training:

  a  fault-free
  b  node 3 (daemon and rank) SIGKILLed at step --fail-at; the survivors recover with a
     replacement node 3; R2CCL_RECOVERY_LR_FACTOR=1.0 (no learning-rate hint)
  c  the same fault with the default recovery hint (R2CCL_RECOVERY_LR_* unset)

and checks |b - a| <= --exact-tol (absolute, on the final evaluation loss), |c - a| / a <=
--hint-tol, and that both fault runs printed the "[R2CCL] Successfully recovered in" line.
Exit status 0 only if all hold; 77 when torch is missing (ctest: skipped); 1 otherwise.

    /usr/bin/python3 examples/snapshot/run_example.py --build-dir build

Every process it starts is killed (SIGKILL to its process group) when its run ends, also on
failure or SIGTERM, and dies with the launcher (PR_SET_PDEATHSIG); every wait has a deadline.
"""

import argparse
import ctypes
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
RECOVERED = "[R2CCL] Successfully recovered in"
SKIP = 77


def _die_with_parent():
    # Runs in the child between fork and exec: SIGKILL it when the launcher dies.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def free_ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tail(path, lines=25):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return "(%s)\n" % e


class Cluster:
    """The daemons and ranks of one run; stop() kills whatever is still running."""

    def __init__(self, a, name, env):
        self.a, self.name, self.env = a, name, env
        self.dir = os.path.join(a.work_dir, name)
        os.makedirs(self.dir)
        self.peers = os.path.join(self.dir, "peers")
        self.token = os.path.join(self.dir, "token")
        ports = free_ports(a.world)
        with open(self.peers, "w") as f:
            for i, p in enumerate(ports):
                f.write("%d 127.0.0.1:%d\n" % (i, p))
        fd = os.open(self.token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("example-%d-%s\n" % (os.getpid(), name))
        tag = "r2ex-%d-%s" % (os.getpid(), name)
        self.boards = ["%s-n%d" % (tag, i) for i in range(a.world)]
        self.sockets = [os.path.join(self.dir, "n%d.sock" % i) for i in range(a.world)]
        self.daemons = [None] * a.world
        self.ranks = [None] * a.world
        self.procs = []  # (label, Popen, log path), everything started
        self.gen = [0] * a.world  # restarts per node (log file names)

    def _spawn(self, label, argv, log, env=None):
        with open(log, "ab") as out:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 env=env, start_new_session=True, preexec_fn=_die_with_parent)
        self.procs.append((label, p, log))
        return p

    def start_daemon(self, i):
        if os.path.exists(self.sockets[i]):
            os.unlink(self.sockets[i])  # a killed daemon's: wait_socket waits for the new one
        log = os.path.join(self.dir, "daemon%d.%d.log" % (i, self.gen[i]))
        self.daemons[i] = self._spawn(
            "daemon %d" % i,
            [self.a.daemon, "--id", str(i), "--peers", self.peers, "--token-file", self.token,
             "--board", self.boards[i], "--period-ms", "100", "--socket", self.sockets[i],
             "--etcd", self.a.etcd.url, "--job", "example-%d-%s" % (os.getpid(), self.name),
             "--lease-ttl", "1"], log)

    def wait_socket(self, i, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.path.exists(self.sockets[i]):
                return
            if self.daemons[i].poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError("%s: daemon %d did not open %s within %.0f s (exit %s)\n%s"
                           % (self.name, i, self.sockets[i], timeout_s, self.daemons[i].poll(),
                              tail(self.procs[-1][2])))

    def start_rank(self, i, extra=()):
        log = os.path.join(self.dir, "rank%d.%d.log" % (i, self.gen[i]))
        argv = [sys.executable, os.path.join(HERE, "train_cpu.py"), "--rank", str(i),
                "--world", str(self.a.world), "--socket", self.sockets[i], "--run-dir", self.dir,
                "--steps", str(self.a.steps)] + list(extra)
        self.ranks[i] = self._spawn("rank %d" % i, argv, log, self.env)
        self.ranks[i].log = log

    def kill_node(self, i):
        for p in (self.daemons[i], self.ranks[i]):
            _kill(p)
        self.daemons[i] = self.ranks[i] = None
        self.gen[i] += 1

    def stop(self):
        for _, p, _ in self.procs:
            _kill(p)
        for b in self.boards:
            try:
                os.unlink("/dev/shm/r2ccl-%d-%s" % (os.getuid(), b))
            except OSError:
                pass

    def logs(self):
        return "".join("--- %s (%s, exit %s)\n%s" % (label, log, p.poll(), tail(log))
                       for label, p, log in self.procs)


def _kill(p):
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_once(a, name, fault, lr_factor):
    env = dict(os.environ)
    env.pop("R2CCL_RECOVERY_LR_FACTOR", None)
    env.pop("R2CCL_RECOVERY_LR_STEPS", None)
    if lr_factor is not None:
        env["R2CCL_RECOVERY_LR_FACTOR"] = lr_factor
    env.update({"R2CCL_SNAPSHOT_LIB": a.lib, "R2CCL_PG_HOST": "127.0.0.1",
                "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(
                    [os.path.join(REPO, "snapshot", "python")] +
                    ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))})
    c = Cluster(a, name, env)
    t0 = time.monotonic()
    deadline = t0 + a.run_timeout
    times = {}
    try:
        for i in range(a.world):
            c.start_daemon(i)
        for i in range(a.world):
            c.wait_socket(i)
        for i in range(a.world):
            c.start_rank(i, ["--pause-at", str(a.fail_at)] if fault and i == a.world - 1 else [])
        victim = a.world - 1
        killed = replaced = False
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError("%s: not finished within %.0f s" % (name, a.run_timeout))
            if fault and not killed and os.path.exists(os.path.join(c.dir, "paused-r%d" % victim)):
                c.kill_node(victim)  # the node is lost: its daemon and its rank, SIGKILL
                killed = True
                times["kill"] = time.monotonic() - t0
                print("  %s: step %d: SIGKILLed node %d (daemon and rank)"
                      % (name, a.fail_at, victim), flush=True)
            if killed and not replaced and any(
                    os.path.exists(os.path.join(c.dir, "lost-seen-r%d" % r))
                    for r in range(a.world - 1)):
                # The survivors' daemons agreed on the loss: a replacement node joins.
                c.start_daemon(victim)
                c.wait_socket(victim)
                c.start_rank(victim, ["--replacement"])
                replaced = True
                times["replacement started"] = time.monotonic() - t0
                print("  %s: replacement node %d started (daemon and rank %d)"
                      % (name, victim, victim), flush=True)
            live = [p for p in c.ranks if p is not None]
            for i, p in enumerate(c.ranks):
                rc = None if p is None else p.poll()
                if rc is not None and rc != 0:
                    raise RuntimeError("%s: rank %d exited with %d" % (name, i, rc))
            if all(p.poll() == 0 for p in live) and (not fault or replaced):
                break
            time.sleep(0.05)
        times["total"] = time.monotonic() - t0
        with open(os.path.join(c.dir, "result.json")) as f:
            res = json.load(f)
        with open(c.ranks[0].log, errors="replace") as f:
            res["recovered_lines"] = [l.strip() for l in f if RECOVERED in l]
        res["times"] = times
        return res
    except Exception:
        print(c.logs(), file=sys.stderr)
        raise
    finally:
        c.stop()


def remove_stale_boards():
    """Health boards of an earlier launcher that was SIGKILLed (its finally never ran):
    /dev/shm/r2ccl-<uid>-r2ex-<pid>-... whose launcher pid is gone."""
    prefix = "r2ccl-%d-r2ex-" % os.getuid()
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for n in names:
        if not n.startswith(prefix):
            continue
        pid = n[len(prefix):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join("/dev/shm", n))
            except OSError:
                pass
        except PermissionError:
            pass


class LocalEtcd:
    """A one-member etcd on 127.0.0.1 (free ports, a temporary data directory) for the daemons'
    control plane: what a single-machine run needs (a cluster uses its own, --etcd URL)."""

    def __init__(self, work_dir):
        self.binary = os.environ.get("R2CCL_ETCD", shutil.which("etcd") or "/usr/bin/etcd")
        if not os.access(self.binary, os.X_OK):
            raise SystemExit("etcd not found (%s): scripts/setup.sh installs Debian's etcd-server"
                             % self.binary)
        client, peer = free_ports(2)
        self.url = "http://127.0.0.1:%d" % client
        peer_url = "http://127.0.0.1:%d" % peer
        self.log = os.path.join(work_dir, "etcd.log")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [self.binary, "--name", "example", "--data-dir", os.path.join(work_dir, "etcd"),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", "example=" + peer_url],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise SystemExit("etcd did not start within 20 s:\n" + tail(self.log))

    def stop(self):
        _kill(self.proc)


def find_build(a):
    dirs = [a.build_dir] if a.build_dir else [os.path.join(REPO, "build")]
    for d in dirs:
        daemon = os.path.join(d, "bin", "r2ccl_snapshotd")
        lib = os.path.join(d, "lib", "libr2ccl-snapshot.so")
        if os.path.exists(daemon) and os.path.exists(lib):
            return daemon, lib
    raise SystemExit("r2ccl_snapshotd or libr2ccl-snapshot.so not found under %s (build them: "
                     "cmake --build BUILD --target r2ccl_snapshotd r2ccl_snapshot; pass "
                     "--build-dir BUILD)" % ", ".join(dirs))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build-dir", help="the CMake build directory (default: REPO/build)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    p.add_argument("--fail-at", type=int, default=20, help="the step node 3 is lost at")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--exact-tol", type=float, default=1e-6,
                   help="|b - a| bound, absolute (default 1e-6)")
    p.add_argument("--hint-tol", type=float, default=0.01,
                   help="|c - a| / a bound (default 0.01)")
    p.add_argument("--run-timeout", type=float, default=100.0, help="per run, s")
    p.add_argument("--keep", action="store_true", help="keep the logs (also kept on failure)")
    a = p.parse_args()
    if not 1 < a.fail_at < a.steps <= 50:
        p.error("need 1 < --fail-at < --steps <= 50")
    try:
        importlib.import_module("torch")  # the ranks need it; the launcher only checks
    except ImportError:
        print("SKIP: %s has no torch (Debian: apt-get install python3-torch)" % sys.executable)
        return SKIP
    a.daemon, a.lib = find_build(a)
    remove_stale_boards()
    a.work_dir = tempfile.mkdtemp(prefix="r2ccl-snapshot-example-")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("run_example: SIGTERM"))
    ok = False
    a.etcd = LocalEtcd(a.work_dir)
    try:
        t0 = time.monotonic()
        runs = {}
        for name, fault, factor, what in (
                ("a", False, None, "fault-free"),
                ("b", True, "1.0", "node 3 lost, R2CCL_RECOVERY_LR_FACTOR=1.0"),
                ("c", True, None, "node 3 lost, default recovery hint")):
            print("run %s: %s" % (name, what), flush=True)
            runs[name] = r = run_once(a, name, fault, factor)
            rec = r["recovery"]
            print("  %s: final eval loss %.12g (%.1f s; newest complete snapshot: step %s)%s"
                  % (name, r["final_eval_loss"], r["times"]["total"], r["complete_step"],
                "" if not rec else "; restored step %d after losing step %d; lr x %g for %d "
                "steps" % (rec["restored_step"], rec["failed_step"], rec["hint"][0],
                           rec["hint"][1])), flush=True)
            for line in r["recovered_lines"]:
                print("  " + line, flush=True)
        la, lb, lc = (runs[n]["final_eval_loss"] for n in "abc")
        d_exact = abs(lb - la)
        d_hint = abs(lc - la) / la
        checks = [
            ("|b - a| = %.3g <= %g (absolute)" % (d_exact, a.exact_tol), d_exact <= a.exact_tol),
            ("|c - a| / a = %.3g <= %g" % (d_hint, a.hint_tol), d_hint <= a.hint_tol),
            ("recovery line printed in b and c",
             all(runs[n]["recovered_lines"] and runs[n]["recovery"] for n in "bc")),
        ]
        for text, good in checks:
            print("%s %s" % ("PASS" if good else "FAIL", text))
        ok = all(g for _, g in checks)
        print("%s in %.1f s" % ("OK" if ok else "FAILED", time.monotonic() - t0))
        return 0 if ok else 1
    finally:
        a.etcd.stop()
        if ok and not a.keep:
            shutil.rmtree(a.work_dir, ignore_errors=True)
        else:
            print("logs: %s" % a.work_dir)


if __name__ == "__main__":
    sys.exit(main())
