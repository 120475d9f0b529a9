"""Tests of scripts/gpu_e2e.sh without a GPU: the log checker's verdicts on synthetic NCCL logs
(one passing run of each kind, and the failures it must catch), the result table, and the
script's own behaviour here (syntax, shellcheck, usage errors, exit 3 without a GPU, and the
whole orchestration against a fake GPU whose workers run gloo on the CPU).

Run: python3 -m unittest -v test_gpu_e2e_checks   (in tests/scripts; ctest: gpu_e2e_checks)
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_e2e.sh")
sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu_e2e"))
import check_log  # noqa: E402

LIB = "/opt/r2ccl/lib"
T_REC = 1000.500  # CLOCK_MONOTONIC of the synthetic recovery


def read(path):
    with open(path) as f:
        return f.read()


def nccl(rank, msg, level="INFO"):
    return f"gpu-node:{4000 + rank}:{4100 + rank} [0] NCCL {level} {msg}"


def results(rank, tag, t0, n_passes=2, bad=None):
    out = []
    t = t0
    for p in range(n_passes):
        for b in (8192, 32768, 131072, 524288, 2097152, 8388608, 33554432, 134217728):
            t += 0.05
            wrong = 12 if bad == (p, b) else 0
            out.append(f"RESULT tag={tag} rank={rank} pass={p} bytes={b} iters=3 time_us=100.0 "
                        f"algbw_GBs={b / 1e5 / 1e3:.3f} busbw_GBs={b / 1e5 / 1e3:.3f} "
                        f"wrong_iters={1 if wrong else 0} wrong_elems={wrong} "
                        f"check={'BAD' if wrong else 'OK'} t={t:.6f}")
    return out


def rank_log(rank, kind="r2ccl", *, net_loaded=True, banner=True, network=None, channel=None,
             tuner=True, tuner_line="TUNER/Plugin: Using R2CCL (v5)", events=True, bad=None,
             done=True, rc=0, t0=999.0, extra=()):
    net = network or ("Socket" if kind == "socket" else "R2CCL")
    channel = channel or "NET/" + net
    lines = [f"WORKER tag={kind} rank={rank} world=2 torch=2.5.1 nccl=2.21.5 device=NVIDIA_H200 "
             f"hostid=r2ccl-e2e-node{rank}"]
    if kind == "socket":
        lines += [nccl(rank, "NCCL_NET_PLUGIN set by environment to none"),
                  nccl(rank, "NET/Plugin: Could not find: none libnccl-net-none.so."),
                  nccl(rank, "NET/Socket : Using [0]lo:127.0.0.1<0>")]
    else:
        lines.append(nccl(rank, f"NCCL_NET_PLUGIN set by environment to {LIB}/libnccl-net-r2ccl.so"))
        if net_loaded:
            lines += [nccl(rank, "NET/Plugin: Loaded net plugin R2CCL (v8)"),
                      nccl(rank, "NET/Plugin: Failed to find ncclCollNetPlugin_v8 symbol.")]
        if banner:
            lines.append(nccl(rank, "NET/R2CCL r2ccl 0.1.0 (git 230feb3dc8ec), NCCL net API v8, "
                                    "transport TCP (R2CCL_TRANSPORT=tcp), 2 rails: lo@127.0.0.1 "
                                    "(10000 Mbps), lo@127.0.0.2 (10000 Mbps); 2 backup paths, chunk "
                                    "512 KiB, 1 streams per path, stripe off"))
    lines.append(nccl(rank, f"Using network {net}"))
    lines.append(nccl(rank, f"NCCL_HOSTID set by environment to r2ccl-e2e-node{rank}"))
    if kind != "socket" and tuner:
        lines += [nccl(rank, f"NCCL_TUNER_PLUGIN set by environment to {LIB}/libnccl-tuner-r2ccl.so"),
                  nccl(rank, tuner_line),
                  nccl(rank, "TUNER/R2CCL r2ccl 0.1.0 (git 230feb3dc8ec), NCCL tuner API v3, "
                             "rules file: none")]
    peer = 1 - rank
    lines += [nccl(rank, "Channel 00/02 :    0   1"),
              nccl(rank, f"Channel 00/0 : {peer}[0] -> {rank}[0] [receive] via {channel}/0"),
              nccl(rank, f"Channel 01/0 : {peer}[0] -> {rank}[0] [receive] via {channel}/1"),
              nccl(rank, f"Channel 00/0 : {rank}[0] -> {peer}[0] [send] via {channel}/0"),
              nccl(rank, f"Channel 01/0 : {rank}[0] -> {peer}[0] [send] via {channel}/1")]
    lines += list(extra)
    res = results(rank, kind, t0, n_passes=4 if kind == "fault" else 2, bad=bad)
    if kind == "fault":
        lines.append(nccl(rank, "NET/R2CCL fault injection armed for rank %d: rank=1,rail=1,at=4000,"
                                "kind=reset,for=3000" % rank, "WARN"))
        lines += res[:10]
        if events:
            sw = ("switchover: rail lo@127.0.0.2 failed (socket error: Transport endpoint is not "
                  "connected); path 0 of conn e4ed5054e4ddfaca -> rail lo@127.0.0.1; 2 chunks to replay")
            rec = ("Successfully recovered in 0.001 s (rail lo@127.0.0.2: socket error, detected "
                   "after 0 ms, 2 chunks replayed)")
            lines += [nccl(rank, "NET/R2CCL " + sw, "WARN"), f"[{T_REC - 0.001:.6f}] [R2CCL] {sw}",
                      nccl(rank, "NET/R2CCL " + rec, "WARN"), f"[{T_REC:.6f}] [R2CCL] {rec}"]
        lines += res[10:]
    else:
        lines += res
    if done:
        wrong = 12 if bad else 0
        lines.append(f"DONE tag={kind} rank={rank} passes=2 results={len(res)} wrong={wrong}")
    lines.append(f"GPU_E2E_EXIT rank={rank} rc={rc}")
    return "\n".join(lines) + "\n"


def verdicts(kind, logs, **kw):
    c = check_log.check_run(kind, logs, **kw)
    return {name: status for status, name, _ in c.rows}, c


def failed(kind, logs, **kw):
    v, c = verdicts(kind, logs, **kw)
    return sorted(n for n, s in v.items() if s == "FAIL"), c


class PassingRuns(unittest.TestCase):
    def test_r2ccl_passes(self):
        bad, c = failed("r2ccl", [rank_log(0), rank_log(1)])
        self.assertEqual(bad, [], "\n".join(c.lines()))
        v, _ = verdicts("r2ccl", [rank_log(0), rank_log(1)])
        for name in ("NCCL loaded the r2ccl net plugin", "r2ccl net banner in NCCL's log",
                     "NCCL selected network R2CCL ('Using network R2CCL')",
                     "every channel via NET/R2CCL", "no channel via SHM or P2P",
                     "NCCL loaded the r2ccl tuner plugin", "no path failure in the fault-free run",
                     "every all_reduce correct, workers exited 0"):
            self.assertEqual(v.get(name), "PASS", name)

    def test_fault_passes(self):
        logs = [rank_log(0, "fault"), rank_log(1, "fault")]
        bad, c = failed("fault", logs)
        self.assertEqual(bad, [], "\n".join(c.lines()))
        v, _ = verdicts("fault", logs)
        for name in ("R2CCL_FAULT_INJECT armed", "the injected rail failure caused a switchover",
                     "r2ccl recovered ('Successfully recovered')",
                     "the job kept running after the recovery"):
            self.assertEqual(v.get(name), "PASS", name)

    def test_socket_passes(self):
        bad, c = failed("socket", [rank_log(0, "socket"), rank_log(1, "socket")])
        self.assertEqual(bad, [], "\n".join(c.lines()))

    def test_older_tuner_phrase(self):  # NCCL 2.21-2.25
        logs = [rank_log(r, tuner_line="TUNER/Plugin: Using tuner plugin R2CCL") for r in (0, 1)]
        self.assertEqual(failed("r2ccl", logs)[0], [])

    def test_internal_net_init_is_a_note(self):
        extra = [nccl(0, "NET/IB : No device found."), nccl(0, "NET/Socket : Using [0]lo:127.0.0.1<0>")]
        v, _ = verdicts("r2ccl", [rank_log(0, extra=extra), rank_log(1)])
        self.assertNotIn("FAIL", v.values())
        self.assertEqual(v.get("NCCL initialised an internal net (not used for any channel)"), "NOTE")

    def test_no_tuner_skip(self):
        logs = [rank_log(r, tuner=False) for r in (0, 1)]
        v, _ = verdicts("r2ccl", logs, expect_tuner=False)
        self.assertEqual(v["NCCL loaded the r2ccl tuner plugin"], "SKIP")
        self.assertNotIn("FAIL", v.values())


class FailingRuns(unittest.TestCase):
    def test_plugin_not_loaded(self):
        # NCCL_NET_PLUGIN pointing nowhere: no load line, no banner, and with NCCL_NET=R2CCL
        # comm init fails and the worker dies.
        extra = [nccl(0, "NET/Plugin: Could not find: /nowhere/libnccl-net-r2ccl.so"),
                 nccl(0, "Failed to initialize any NET plugin", "WARN"),
                 "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
                 "invalid usage"]
        logs = [rank_log(0, net_loaded=False, banner=False, network="IB", extra=extra, done=False,
                         rc=1),
                rank_log(1, net_loaded=False, banner=False)]
        bad, _ = failed("r2ccl", logs)
        for name in ("NCCL loaded the r2ccl net plugin", "r2ccl net banner in NCCL's log",
                     "NCCL selected network R2CCL ('Using network R2CCL')",
                     "no fallback to NCCL's internal Socket/IB nets",
                     "every all_reduce correct, workers exited 0"):
            self.assertIn(name, bad)

    def test_network_not_found_older_nccl(self):  # NCCL 2.19-2.25's words for the same
        extra = [nccl(0, "Error: network R2CCL not found.", "WARN")]
        logs = [rank_log(0, net_loaded=False, banner=False, extra=extra, done=False, rc=1),
                rank_log(1)]
        self.assertIn("no fallback to NCCL's internal Socket/IB nets", failed("r2ccl", logs)[0])

    def test_banner_only_on_stderr_is_not_nccl(self):
        # The plugin loaded by something else prints its banner to stderr, not through NCCL.
        extra = ["NET/R2CCL INFO r2ccl 0.1.0 (git 230feb3dc8ec), NCCL net API v11, transport TCP "
                 "(x), 2 rails: a (1 Mbps), b (1 Mbps); 2 backup paths"]
        bad, _ = failed("r2ccl", [rank_log(0, banner=False, extra=extra), rank_log(1)])
        self.assertEqual(bad, ["r2ccl net banner in NCCL's log"])

    def test_one_rail_banner_fails(self):
        logs = [rank_log(0).replace("2 rails: lo@127.0.0.1 (10000 Mbps), lo@127.0.0.2 (10000 Mbps)",
                                    "1 rails: lo@127.0.0.1 (10000 Mbps)"), rank_log(1)]
        self.assertEqual(failed("r2ccl", logs)[0], ["r2ccl net banner in NCCL's log"])

    def test_fell_back_to_socket(self):
        logs = [rank_log(r, net_loaded=False, banner=False, network="Socket",
                         channel="NET/Socket") for r in (0, 1)]
        bad, _ = failed("r2ccl", logs)
        for name in ("NCCL selected network R2CCL ('Using network R2CCL')",
                     "every channel via NET/R2CCL", "no fallback to NCCL's internal Socket/IB nets"):
            self.assertIn(name, bad)

    def test_one_channel_via_ib(self):
        extra = [nccl(1, "Channel 02/0 : 1[0] -> 0[0] [send] via NET/IB/0/GDRDMA")]
        bad, _ = failed("r2ccl", [rank_log(0), rank_log(1, extra=extra)])
        self.assertEqual(bad, ["every channel via NET/R2CCL",
                               "no fallback to NCCL's internal Socket/IB nets"])

    def test_shm_channel(self):
        extra = [nccl(0, "Channel 02 : 0[0] -> 1[0] via SHM/direct/direct")]
        bad, _ = failed("r2ccl", [rank_log(0, extra=extra), rank_log(1)])
        self.assertEqual(bad, ["every channel via NET/R2CCL", "no channel via SHM or P2P"])

    def test_p2p_channel(self):
        extra = [nccl(0, "Channel 00/0 : 0[0] -> 1[0] via P2P/CUMEM/read")]
        bad, _ = failed("socket", [rank_log(0, "socket", extra=extra), rank_log(1, "socket")])
        self.assertEqual(bad, ["every channel via NET/Socket", "no channel via SHM or P2P"])

    def test_tuner_not_loaded(self):
        bad, _ = failed("r2ccl", [rank_log(0, tuner=False), rank_log(1)])
        self.assertEqual(bad, ["NCCL loaded the r2ccl tuner plugin"])

    def test_no_recovery_line(self):
        logs = [rank_log(r, "fault", events=False) for r in (0, 1)]
        bad, _ = failed("fault", logs)
        self.assertEqual(bad, ["r2ccl recovered ('Successfully recovered')",
                               "the injected rail failure caused a switchover",
                               "the job kept running after the recovery"])

    def test_give_up(self):
        extra = ["[1000.9] [R2CCL] give-up: conn 0123 on device 1 (lo@127.0.0.2) has no usable path"]
        bad, _ = failed("fault", [rank_log(0, "fault"), rank_log(1, "fault", extra=extra)])
        self.assertEqual(bad, ["r2ccl recovered ('Successfully recovered')"])

    def test_job_stopped_at_the_fault(self):
        # Both ranks' last results come before the recovery: the job did not keep running.
        logs = [rank_log(r, "fault", t0=T_REC - 100) for r in (0, 1)]
        bad, _ = failed("fault", logs)
        self.assertEqual(bad, ["the job kept running after the recovery"])

    def test_wrong_result(self):
        bad, c = failed("fault", [rank_log(0, "fault", bad=(1, 8388608)), rank_log(1, "fault")])
        self.assertEqual(bad, ["every all_reduce correct, workers exited 0"])
        self.assertIn("WRONG RESULTS", "\n".join(c.lines()))

    def test_timed_out_worker(self):
        bad, c = failed("r2ccl", [rank_log(0, done=False, rc=124), rank_log(1)])
        self.assertEqual(bad, ["every all_reduce correct, workers exited 0"])
        self.assertIn("timed out", "\n".join(c.lines()))

    def test_missing_rank_log(self):
        bad, _ = failed("r2ccl", [rank_log(0)])
        self.assertEqual(bad, ["both ranks' logs present"])

    def test_switchover_in_fault_free_run(self):
        extra = ["[5.0] [R2CCL] switchover: rail lo@127.0.0.1 failed (heartbeat miss); path 0 of "
                 "conn 01 -> rail lo@127.0.0.2; 0 chunks to replay"]
        bad, _ = failed("r2ccl", [rank_log(0, extra=extra), rank_log(1)])
        self.assertEqual(bad, ["no path failure in the fault-free run"])

    def test_socket_run_with_r2ccl(self):
        extra = [nccl(0, "NET/R2CCL r2ccl 0.1.0 (git x), NCCL net API v8, transport TCP (y), 2 rails: "
                         "a; b")]
        bad, _ = failed("socket", [rank_log(0, "socket", extra=extra), rank_log(1, "socket")])
        self.assertEqual(bad, ["r2ccl not loaded in the baseline"])


class Table(unittest.TestCase):
    def test_table(self):
        tenth = lambda m: f"{m.group(1)}={float(m.group(2)) / 10:.4f}"  # noqa: E731
        so = re.sub(r"(algbw_GBs|busbw_GBs)=([\d.]+)", tenth, rank_log(0, "socket"))
        md = check_log.table({"r2ccl": rank_log(0), "fault": rank_log(0, "fault"), "socket": so})
        rows = [x for x in md.splitlines() if x.startswith("| ")]
        self.assertEqual(len(rows), 1 + 8)  # header + 8 sizes
        self.assertTrue(rows[1].startswith("| 8 KiB |"))
        self.assertEqual(rows[-1], "| 128 MiB | 1.34 | 1.34 | 1.34 (pass 0) | 0.13 | 0.13 | 10.00 |")

    def test_table_missing_run(self):
        md = check_log.table({"r2ccl": rank_log(0), "fault": None, "socket": None})
        self.assertIn("| 128 MiB | 1.34 | 1.34 | - | - | - | - |", md)

    def test_cli_exit_status(self):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for r, text in enumerate((rank_log(0), rank_log(1, tuner=False))):
                paths.append(os.path.join(d, f"rank{r}.log"))
                with open(paths[-1], "w") as f:
                    f.write(text)
            run = lambda *a: subprocess.run(  # noqa: E731
                [sys.executable, os.path.join(ROOT, "scripts", "gpu_e2e", "check_log.py"), *a],
                capture_output=True, text=True)
            p = run("check", "--kind", "r2ccl", *paths)
            self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
            self.assertIn("FAIL  r2ccl: NCCL loaded the r2ccl tuner plugin", p.stdout)
            p = run("check", "--kind", "r2ccl", "--no-tuner", *paths)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            shutil.copy(paths[0], os.path.join(d, "x"))
            p = run("table", "--run", f"r2ccl={d}")
            self.assertEqual(p.returncode, 0)
            self.assertIn("| 128 MiB |", p.stdout)


class Script(unittest.TestCase):
    def run_script(self, *args, env=None, timeout=120):
        return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True,
                              env=env, timeout=timeout, cwd=ROOT)

    def test_syntax(self):
        subprocess.run(["bash", "-n", SCRIPT], check=True)

    @unittest.skipUnless(shutil.which("shellcheck"), "shellcheck not installed")
    def test_shellcheck(self):
        p = subprocess.run(["shellcheck", SCRIPT], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stdout)

    def test_usage(self):
        self.assertEqual(self.run_script("--help").returncode, 0)
        self.assertEqual(self.run_script("--bogus").returncode, 2)
        self.assertEqual(self.run_script("--fault-rail", "7").returncode, 2)

    @unittest.skipIf(shutil.which("nvidia-smi"), "this machine has nvidia-smi")
    def test_no_gpu_exit_3(self):
        with tempfile.TemporaryDirectory() as d:
            p = self.run_script("--out", d, "--build", os.environ.get("R2CCL_BUILD_DIR", "build"))
            self.assertEqual(p.returncode, 3, p.stdout + p.stderr)
            self.assertIn("FAIL  preflight: nvidia-smi not found", p.stdout)
            self.assertIn("NO GPU", p.stdout)
            self.assertTrue(os.path.exists(os.path.join(d, "preflight.txt")))

    def test_stage_to(self):
        with tempfile.TemporaryDirectory() as d:
            b = os.path.join(d, "b", "lib")
            os.makedirs(b)
            for n in ("libnccl-net-r2ccl.so", "libnccl-tuner-r2ccl.so"):
                shutil.copy("/bin/true", os.path.join(b, n))  # any ELF file
            p = self.run_script("--build", os.path.join(d, "b"), "--stage-to", os.path.join(d, "s"))
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertTrue(os.path.exists(os.path.join(d, "s", "lib", "libnccl-tuner-r2ccl.so")))

    def test_orchestration_with_a_fake_gpu(self):
        """The whole script against a fake nvidia-smi and a python wrapper whose workers run gloo
        on the CPU: the jobs, exit statuses, logs and table work; the NCCL log checks fail (no
        NCCL here), the worker checks pass."""
        probe = subprocess.run(["/usr/bin/python3", "-c", "import torch.distributed"],
                               capture_output=True)
        if probe.returncode != 0:
            self.skipTest("/usr/bin/python3 has no torch (python3-torch)")
        build = os.environ.get("R2CCL_BUILD_DIR", os.path.join(ROOT, "build"))
        if not os.path.exists(os.path.join(build, "lib", "libnccl-tuner-r2ccl.so")):
            self.skipTest(f"no plugins in {build}")
        with tempfile.TemporaryDirectory() as d:
            bindir = os.path.join(d, "bin")
            os.makedirs(bindir)
            with open(os.path.join(bindir, "nvidia-smi"), "w") as f:
                f.write("#!/bin/sh\necho '0, Fake GPU, 1.0, 1 MiB'\n")
            with open(os.path.join(bindir, "fakepy"), "w") as f:
                f.write(textwrap.dedent("""\
                    #!/bin/bash
                    if [ "$1" = "-" ]; then
                      cat >/dev/null
                      printf 'python=3\\ntorch=9.9\\ntorch_cuda=12.4\\ncuda_available=1\\n'
                      printf 'device=Fake\\nnccl=2.21.5\\nnccl_lib=/fake\\n'
                      exit 0
                    fi
                    case "$1" in
                      *worker.py) exec /usr/bin/python3 "$@" --cpu --max-bytes 131072 --min-seconds 1 ;;
                    esac
                    exec /usr/bin/python3 "$@"
                    """))
            for n in ("nvidia-smi", "fakepy"):
                os.chmod(os.path.join(bindir, n), 0o755)
            env = dict(os.environ, PATH=bindir + os.pathsep + os.environ["PATH"])
            out = os.path.join(d, "out")
            p = self.run_script("--build", build, "--out", out, "--python",
                                os.path.join(bindir, "fakepy"), env=env, timeout=200)
            self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
            checks = read(os.path.join(out, "checks.txt"))
            for kind in ("r2ccl", "fault", "socket"):
                self.assertIn(f"PASS  {kind}: every all_reduce correct, workers exited 0", checks)
                self.assertIn(f"GPU_E2E_EXIT rank=1 rc=0",
                              read(os.path.join(out, kind, "rank1.log")))
            self.assertIn("FAIL  r2ccl: NCCL loaded the r2ccl net plugin", checks)
            self.assertIn("R2CCL_FAULT_INJECT=rank=1,rail=0,at=4000,kind=reset,for=3000",
                          read(os.path.join(out, "fault", "cmd.txt")))
            md = read(os.path.join(out, "results.md"))
            self.assertIn("| 128 KiB |", md)


if __name__ == "__main__":
    unittest.main()
