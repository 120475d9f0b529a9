#!/usr/bin/env python3
"""snapshot_model.py - a back-of-the-envelope model of the snapshot sidecar at 8..4096 ranks.

This is a MODEL, not a measurement: arithmetic over the parameters below, some measured on a
2-core loopback cluster (scripts/bench_snapshot.sh passes them in), the rest assumptions that
are printed with the table. It knows the daemon's protocol (snapshot/daemon/r2ccl_snapshotd.cc)
but nothing about real NICs, switches, kernels or contention beyond what is written here.

What it predicts, per job size (ranks, RANKS_PER_NODE ranks per node):
  detection      a node is declared failed after MISSES missed heartbeats; the daemon checks on
                 its period tick, so MISSES..MISSES+1 periods (the table gives the worst case),
                 plus agreement: the coordinator writes the record and sends AGREED to every
                 other node (nodes x per-message cost), plus the measured agreement overhead
  repl bytes     per node and step: its ranks' shards to R replicas each. A chain is a base
                 every BASE_EVERY snapshots and deltas between them:
                 bytes/rank/step = state x (1/base_ratio + (K-1)/delta_ratio) / K
                 (the amortised mean), and the base step's peak (state / base_ratio)
  repl time      those bytes at the NIC speed (egress of one node; every node sends as much as
                 it receives, so ingress is the same); "lag" when it exceeds the step time
  coordinator    HELD reports per step: ranks x R (one per replica per (rank, step)); marker
                 rounds: one per step at most one per period (rounds run on the period tick):
                 MARKER + MARKER_DONE per node, plus COMPLETE to every node every period
  KV id exchange kv_put -> coordinator -> every node (nodes messages on the coordinator),
                 plus the client's kv_get poll (10 ms, half on average)
  restore        per rank, from its own node's home copy: the measured local restore rate
                 (GB/s of state, one core per rank); from replicas (a replacement node): its
                 ranks' chains over its NIC (all RANKS_PER_NODE ranks at once) and the decode,
                 whichever is slower, plus a fetch round trip
"""
import argparse
import math
import sys


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--ranks", default="8,64,512,4096", help="job sizes (comma list)")
    a("--ranks-per-node", type=int, default=8)
    a("--state-bytes", type=float, default=float(1 << 30), help="snapshot state per rank (bytes)")
    a("--delta-ratio", type=float, default=62.5, help="lossless delta compression ratio (measured)")
    a("--base-ratio", type=float, default=1.19, help="base compression ratio (measured)")
    a("--base-every", type=int, default=8, help="a base every K snapshots (R2CCL_SNAPSHOT_BASE_EVERY)")
    a("--nic-gbps", type=float, default=100.0, help="NIC bandwidth per node for snapshot traffic (Gbit/s)")
    a("--replicas", type=int, default=3)
    a("--period-ms", type=float, default=500.0, help="heartbeat period")
    a("--misses", type=int, default=3, help="missed heartbeats before a node is declared failed")
    a("--agreement-s", type=float, default=0.001, help="agreement overhead beyond detection (measured on loopback)")
    a("--step-s", type=float, default=1.0, help="training step time (a snapshot every step)")
    a("--msg-us", type=float, default=5.0, help="coordinator cost per small peer message (ASSUMED, not measured)")
    a("--rtt-ms", type=float, default=0.05, help="network round trip between nodes (ASSUMED)")
    a("--kv-poll-ms", type=float, default=10.0, help="kv_get poll interval (the client's)")
    a("--restore-local-gbps", type=float, default=0.5, help="restore from the home copy, GB/s of state per rank (measured)")
    a("--take-copy-gbps", type=float, default=None, help="take() copy rate, GB/s (measured; for the overhead column)")
    a("--source", default="defaults", help="where the measured values came from (printed)")
    return p.parse_args()


def fmt_bytes(b):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            return "%.1f %s" % (b / div, unit)
    return "%.0f B" % b


def main():
    o = parse()
    ranks_list = [int(x) for x in o.ranks.split(",") if x.strip()]
    K = o.base_every
    per_rank_step = o.state_bytes * (1.0 / o.base_ratio + (K - 1) / o.delta_ratio) / K
    per_rank_base = o.state_bytes / o.base_ratio
    chain_max = o.state_bytes / o.base_ratio + (K - 1) * o.state_bytes / o.delta_ratio
    nic_Bps = o.nic_gbps * 1e9 / 8
    period = o.period_ms / 1000.0
    msg = o.msg_us / 1e6

    print("snapshot sidecar scaling MODEL (arithmetic over the parameters below; not measured at scale)")
    print("measured inputs from: %s" % o.source)
    print("parameters:")
    print("  state per rank %s, %d ranks per node, R = %d replicas, base every %d snapshots"
          % (fmt_bytes(o.state_bytes), o.ranks_per_node, o.replicas, K))
    print("  compression: base %.2fx, delta %.1fx (lossless) -> mean %s per rank per step, base step %s"
          % (o.base_ratio, o.delta_ratio, fmt_bytes(per_rank_step), fmt_bytes(per_rank_base)))
    print("  NIC %.0f Gbit/s per node for snapshots, step %.2f s, heartbeat %.0f ms, %d misses"
          % (o.nic_gbps, o.step_s, o.period_ms, o.misses))
    print("  ASSUMED: %.1f us per small message on the coordinator's one event-loop thread, RTT %.2f ms"
          % (o.msg_us, o.rtt_ms))
    print("  restore from the home copy %.2f GB/s per rank (measured, one core per rank)" % o.restore_local_gbps)
    if o.take_copy_gbps:
        print("  take() copy %.2f GB/s (measured): %.3f s blocked per step, independent of the job size"
              % (o.take_copy_gbps, o.state_bytes / (o.take_copy_gbps * 1e9)))
    print()
    hdr = ("ranks", "nodes", "detect s", "repl/node/step", "repl s (base)", "lag s",
           "HELD msg/s", "marker msg/s", "KV id s", "restore home s", "restore repl s")
    rows = []
    for ranks in ranks_list:
        nodes = max(1, math.ceil(ranks / o.ranks_per_node))
        rpn = min(o.ranks_per_node, ranks)
        R = min(o.replicas, nodes - 1)
        detect = (o.misses + 1) * period + o.agreement_s + nodes * msg + o.rtt_ms / 2000.0
        repl_bytes = rpn * per_rank_step * R
        repl_base = rpn * per_rank_base * R
        repl_t = repl_bytes / nic_Bps
        repl_tb = repl_base / nic_Bps
        lag = max(0.0, repl_t - o.step_s)
        steps_per_s = 1.0 / max(o.step_s, period)  # one marker round per period at most
        held_rate = ranks * R / o.step_s
        marker_rate = 2 * nodes * steps_per_s + nodes / period  # MARKER + MARKER_DONE, COMPLETE
        coord_load = (held_rate + marker_rate + nodes / period) * msg  # + heartbeats in
        kv = o.rtt_ms / 1000.0 + nodes * msg + o.rtt_ms / 2000.0 + o.kv_poll_ms / 2000.0
        restore_home = o.state_bytes / (o.restore_local_gbps * 1e9)
        restore_repl = max(rpn * chain_max / nic_Bps, restore_home) + o.rtt_ms / 1000.0
        hb_rate = 2 * (nodes - 1) / period  # heartbeats sent + received per node (full mesh)
        rows.append((ranks, nodes, R, detect, repl_bytes, repl_t, repl_tb, lag, held_rate, marker_rate,
                     hb_rate, coord_load, kv, restore_home, restore_repl))
    print("| ranks | nodes | R | detection s (worst) | repl. bytes/node/step (mean) | repl. s/step mean (base step) "
          "| lag s (base step) | HELD msg/s | marker+COMPLETE msg/s | heartbeats msg/s/node | coordinator busy "
          "| KV id exchange s | restore from home s | restore from replicas s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (ranks, nodes, R, detect, rb, rt, rtb, lag, held, mk, hb, load, kv, rh, rr) in rows:
        if R == 0:
            print("| %d | %d | 0 | - | no replica (one node: a node loss loses the job) | - | - | - | - | - | - | - | %.2f | - |"
                  % (ranks, nodes, rh))
            continue
        print("| %d | %d | %d | %.2f | %s | %.3f (%.2f) | %.2f (%.2f) | %.0f | %.0f | %.0f | %.1f %% | %.3f | %.2f | %.2f |"
              % (ranks, nodes, R, detect, fmt_bytes(rb), rt, rtb, lag, max(0.0, rtb - o.step_s), held, mk, hb,
                 100 * load, kv, rh, rr))
    print()
    print("notes:")
    print("  - detection is dominated by the heartbeat period ((misses + 1) x period worst case); the")
    print("    message terms are microseconds even at 512 nodes, if the coordinator keeps up.")
    print("  - 'coordinator busy' = fraction of one core spent on HELD, marker, COMPLETE and incoming")
    print("    heartbeats at the ASSUMED per-message cost; above ~50 % rounds would fall behind")
    print("    (HELD reports are not batched today: one 40-byte frame per replica, rank and step).")
    print("  - heartbeats are a full mesh: every node sends one to every other node every period")
    print("    (and holds a TCP connection to each): O(nodes^2) in total, O(nodes) per node.")
    print("  - the base step (every %d snapshots) sends %.0fx the mean; 'lag' uses the mean (the"
          % (K, per_rank_base / per_rank_step))
    print("    send queue absorbs the base step if the mean fits in a step).")
    print("  - restore from replicas assumes the replacement node's %d ranks fetch at once over its"
          % o.ranks_per_node)
    print("    NIC, a full chain each (a base + %d deltas, the worst case), replicas never the bottleneck." % (K - 1))
    print("  - not modelled: NCCL communicator init after the id exchange, stragglers, switch")
    print("    oversubscription, disk spill, the training's own traffic sharing the NIC.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
