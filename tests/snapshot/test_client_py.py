"""The Python binding (snapshot/python/r2ccl_snapshot.py) against the fake daemon
(tests/support/fake_snapd, launched per test). Needs R2CCL_TEST_FAKE_SNAPD (ctest sets it, and
R2CCL_SNAPSHOT_LIB); skips without it. The torch tests skip without torch.

    R2CCL_TEST_FAKE_SNAPD=build/bin/fake_snapd R2CCL_SNAPSHOT_LIB=build/lib/libr2ccl-snapshot.so \
      PYTHONPATH=snapshot/python /usr/bin/python3 -m unittest -v test_client_py   # in tests/snapshot
"""

import os
import re
import shutil
import subprocess
import tempfile
import time
import unittest

import numpy as np

import r2ccl_snapshot as rs

FAKE = os.environ.get("R2CCL_TEST_FAKE_SNAPD")

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


@unittest.skipUnless(FAKE, "R2CCL_TEST_FAKE_SNAPD not set")
class FakeDaemonTest(unittest.TestCase):
    complete_limit = None

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="r2snappy")
        self.sock = os.path.join(self.dir, "d.sock")
        args = [FAKE, self.sock]
        if self.complete_limit is not None:
            args += ["--complete-limit", str(self.complete_limit)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.assertEqual(self.proc.stdout.readline().strip(), "ready")

    def tearDown(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def wait_complete(self, snap, step):
        for _ in range(500):
            if snap.state()["complete_step"] == step:
                return
            time.sleep(0.01)
        self.fail("step %d never became complete: %r" % (step, snap.state()))


class TestNumpy(FakeDaemonTest):
    complete_limit = 4

    def test_round_trip_metadata_events_kv(self):
        rng = np.random.default_rng(1)
        w = rng.normal(0, 0.02, 50000).astype(np.float32)
        h = rng.normal(0, 1, 20000).astype(np.float16)
        raw = np.arange(3000, dtype=np.int64)
        with rs.Snapshot(0, 1, socket=self.sock) as snap:
            self.assertEqual(snap.register("w", w), 0)
            self.assertEqual(snap.register(1, h, lossy=True), 1)
            self.assertEqual(snap.register("raw", raw), 2)
            saved = {}
            for step in range(1, 7):
                w[rng.integers(0, w.size, 100)] += 1e-3
                h += rng.normal(0, 1e-2, h.size).astype(np.float16)
                raw[step] = -step
                snap.set_loss_scale(2.0 ** step)
                snap.set_rng_state(bytes([step]) * (100 + step))
                st = snap.take(step)
                self.assertEqual(st["skipped"], 0)
                self.assertEqual(st["step"], step)
                snap.flush(10)
                saved[step] = (w.copy(), h.copy(), raw.copy(), st)
            # step 5's take reported step 4's lossy error
            err4 = saved[5][3]["prev_max_abs_error"]
            self.assertEqual(saved[5][3]["prev_step"], 4)
            self.assertGreater(err4, 0)
            self.wait_complete(snap, 4)  # 5 and 6 are never complete (--complete-limit 4)
            w[:] = 0
            h[:] = 0
            raw[:] = 0
            self.assertEqual(snap.restore(10), 4)
            np.testing.assert_array_equal(w, saved[4][0])
            np.testing.assert_array_equal(raw, saved[4][2])
            self.assertLessEqual(
                np.max(np.abs(h.astype(np.float32) - saved[4][1].astype(np.float32))),
                err4 * 1.0001)
            self.assertEqual(snap.get_loss_scale(), 16.0)
            self.assertEqual(snap.get_rng_state(), bytes([4]) * 104)
            s = snap.state()
            self.assertEqual(s["epoch"], 1)
            self.assertEqual(s["members"], [0])

            # events: the complete step 4 first, then an epoch change pushed by the fake
            ev = snap.wait_event(5)
            self.assertEqual(ev["changes"], rs.CHANGED_COMPLETE)
            self.assertIsNone(snap.wait_event(0.05))
            self.proc.stdin.write("epoch 7\n")
            self.proc.stdin.flush()
            ev = snap.wait_event(5)
            self.assertEqual(ev["epoch"], 7)
            self.assertEqual(ev["changes"], rs.CHANGED_EPOCH)

            # kv
            snap.kv_put("pg-7", "127.0.0.1:1234")
            self.assertEqual(snap.kv_get("pg-7", 1), b"127.0.0.1:1234")
            with self.assertRaises(rs.SnapshotTimeout):
                snap.kv_get("nope", 0.05)

            # misuse surfaces as SnapshotError with the library's message
            with self.assertRaises(rs.SnapshotError) as cm:
                snap.take(4)  # not beyond the restored step
            self.assertIn("beyond", str(cm.exception))
            with self.assertRaises(ValueError):
                snap.register(7, w)

    def test_errors(self):
        with self.assertRaises(rs.SnapshotError) as cm:
            rs.Snapshot(0, 1, socket=os.path.join(self.dir, "absent.sock"))
        self.assertEqual(cm.exception.name, "R2CCL_SNAP_ERR_CONNECT")
        self.assertIn("absent.sock", str(cm.exception))
        old = os.environ.get("R2CCL_SNAPSHOT_INTERVAL")
        os.environ["R2CCL_SNAPSHOT_INTERVAL"] = "zero"
        try:
            with self.assertRaises(rs.SnapshotError) as cm:
                rs.Snapshot(0, 1, socket=self.sock)
            self.assertIn("R2CCL_SNAPSHOT_INTERVAL", str(cm.exception))
        finally:
            if old is None:
                del os.environ["R2CCL_SNAPSHOT_INTERVAL"]
            else:
                os.environ["R2CCL_SNAPSHOT_INTERVAL"] = old
        with rs.Snapshot(0, 1, socket=self.sock) as snap:
            with self.assertRaises(ValueError):
                snap.register("strided", np.zeros((10, 10), np.float32)[:, 1])
            with self.assertRaises(rs.SnapshotError):
                snap.restore(1)  # nothing registered


class TestExports(unittest.TestCase):
    @unittest.skipUnless(os.environ.get("R2CCL_SNAPSHOT_LIB") and shutil.which("nm"),
                         "R2CCL_SNAPSHOT_LIB or nm missing")
    def test_only_the_c_api_is_exported(self):
        out = subprocess.run(["nm", "-D", "--defined-only", os.environ["R2CCL_SNAPSHOT_LIB"]],
                             check=True, capture_output=True, text=True).stdout
        names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
        # Exactly the functions the C header declares (a function added to one and not the
        # other fails here).
        header = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "snapshot",
                              "include", "r2ccl", "snapshot_client.h")
        with open(header) as f:
            declared = sorted(set(re.findall(r"^(?:int|void|const char\*) (r2ccl_snap_\w+)\(",
                                             f.read(), re.M)))
        self.assertGreaterEqual(len(declared), 19)
        self.assertEqual(names, declared)


@unittest.skipUnless(torch is not None, "torch not installed")
class TestTorch(FakeDaemonTest):
    def test_module_and_optimizer(self):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x, y = torch.randn(64, 16), torch.randn(64, 4)

        def train_step():
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        train_step()  # optimizer state exists from here
        snap = rs.Snapshot(0, 1, socket=self.sock)
        with self.assertRaises(ValueError):  # a fresh optimizer has no state yet
            rs.Snapshot(0, 1, socket=self.sock).register_torch_module(
                model, torch.optim.Adam(model.parameters()))
        names = snap.register_torch_module(model, opt)
        self.assertEqual(names[:4], ["param:0.weight", "param:0.bias", "param:2.weight",
                                     "param:2.bias"])
        self.assertIn("opt:0.weight:exp_avg", names)
        for step in range(1, 4):
            train_step()
            snap.capture_torch_rng()
            snap.take(step)
        snap.flush(10)
        self.wait_complete(snap, 3)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        want_opt = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
        want_rng = torch.get_rng_state()
        snap.close()

        # A replacement process: same architecture, fresh values, one step to create the state.
        torch.manual_seed(123)
        model2 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                     torch.nn.Linear(32, 4))
        opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
        opt2.zero_grad()
        torch.nn.functional.mse_loss(model2(x), y).backward()
        opt2.step()
        torch.rand(5)  # moves the generator
        with rs.Snapshot(0, 1, socket=self.sock) as snap2:
            snap2.register_torch_module(model2, opt2)
            self.assertEqual(snap2.restore(10), 3)
            snap2.restore_torch_rng()
        for k, v in model2.state_dict().items():
            self.assertTrue(torch.equal(v, want[k]), k)
        for p, w in zip(model2.parameters(), want_opt):
            self.assertTrue(torch.equal(opt2.state[p]["exp_avg_sq"], w))
        self.assertTrue(torch.equal(torch.get_rng_state(), want_rng))
        self.assertEqual(int(opt2.state[next(iter(model2.parameters()))]["step"]), 4)

    def test_reinit_process_group(self):
        import torch.distributed as dist
        self.assertEqual(rs.remap_rank(5, [1, 5, 3]), (2, 3))
        with rs.Snapshot(0, 1, socket=self.sock) as snap:
            addr = rs.reinit_process_group(snap, epoch=3, rank=0, world=1, host="127.0.0.1",
                                           timeout_s=30)
            self.assertTrue(dist.is_initialized())
            self.assertEqual(dist.get_world_size(), 1)
            self.assertEqual(snap.kv_get("pg-3", 1).decode(), addr)
            t = torch.ones(3)
            dist.all_reduce(t)
            self.assertTrue(torch.equal(t, torch.ones(3)))
            # again at the next epoch: the old group is destroyed first
            rs.reinit_process_group(snap, epoch=4, rank=0, world=1, host="127.0.0.1",
                                    timeout_s=30)
            self.assertTrue(dist.is_initialized())
            dist.destroy_process_group()


if __name__ == "__main__":
    unittest.main()
