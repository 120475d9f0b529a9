#!/usr/bin/env python3
"""snapshot_model.py - a back-of-the-envelope model of the snapshot sidecar at 8..4096 ranks.

This is a MODEL, not a measurement: arithmetic over the parameters below, some measured on a
2-core loopback cluster (scripts/bench_snapshot.sh passes them in), the rest assumptions that
are printed with the table. It knows the daemon's protocol (snapshot/daemon/r2ccl_snapshotd.cc)
but nothing about real NICs, switches, kernels or contention beyond what is written here.

What it predicts, per job size (ranks, RANKS_PER_NODE ranks per node):
  detection      suspicion path (the default): a silent peer is suspected after 3 heartbeat
                 periods (accrual.h: phi >= 8 and a 3-period floor), i.e. 2..3 periods after the
                 kill; the coordinator reads etcd once a period (control_plane.h), sees two
                 observers and evicts: + up to one period + the etcd writes. Lease path: the
                 victim's lease runs out TTL - (time since its last keep-alive) after the kill,
                 etcd revokes expired leases on a scan (ASSUMED 500 ms, etcd 3.4's lessor loop),
                 and the coordinator notices at its next period. Plus the measured agreement.
  control plane  on etcd, per second, for the whole job:
                 - lease keep-alives: every daemon, every max(TTL/3, period) rounded up to whole
                   periods (the control thread wakes on the period)
                 - election reads: every daemon reads the oldest key of P election/ every
                   period (elect(): a range with limit 1 sorted by create revision): 1 key each
                 - coordinator reads: members/ (N keys), suspect/, record every period (at
                   least every 250 ms)
                 - writes (transactions through raft): the cut once per step (fenced txn), a
                   record (2 puts) per membership change, an eviction (3 deletes) per node lost,
                   one suspicion key per observer that stops hearing the node (up to N - 1)
                 - watch fan-out: every daemon watches P w/ only (record, cut, KV), so every
                   event there is sent N times: N per cut write; per node loss the record (one
                   event) x N watchers; suspicion, member and election keys are read by the
                   coordinator alone
                 compared with etcd's documented guidance (ASSUMED to carry over: "more than
                 30,000 requests per second under heavy load" for a 3-member cluster on
                 GCE n-4 class machines, etcd.io/docs/v3.6/op-guide/performance/); a range of
                 N keys is counted as N requests (its answer is N times larger), which is
                 pessimistic for small keys
  heartbeats     UDP datagrams of 120 B, full mesh, every period: 2 (N-1) / period per node
  repl bytes     per node and step: its ranks' shards to R replicas each. A chain is a base
                 every BASE_EVERY snapshots and deltas between them:
                 bytes/rank/step = state x (1/base_ratio + (K-1)/delta_ratio) / K
                 (the amortised mean), and the base step's peak (state / base_ratio)
  repl time      those bytes at the NIC speed (egress of one node; every node sends as much as
                 it receives, so ingress is the same); "lag" when it exceeds the step time
  KV id exchange kv_put -> etcd (one txn) -> the watch delivers it to every daemon (N events),
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
    a("--misses", type=int, default=3, help="silent periods before a peer can be suspected (accrual floor)")
    a("--lease-ttl", type=float, default=3.0, help="daemons' etcd lease TTL, s (--lease-ttl)")
    a("--lease-scan-s", type=float, default=0.5, help="etcd's expired-lease scan interval (ASSUMED: etcd 3.4 lessor)")
    a("--agreement-s", type=float, default=0.03, help="agreement: detection -> every board (measured on loopback)")
    a("--etcd-rps", type=float, default=30000.0,
      help="requests/s etcd sustains (ASSUMED from etcd's performance guide, 3 members)")
    a("--event-bytes", type=float, default=200.0, help="one watch event on the JSON gateway, bytes (ASSUMED)")
    a("--step-s", type=float, default=1.0, help="training step time (a snapshot every step)")
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
    ka = max(o.lease_ttl / 3.0, period)
    ka = math.ceil(ka / period - 1e-9) * period  # the control thread wakes on the period

    print("snapshot sidecar scaling MODEL (arithmetic over the parameters below; not measured at scale)")
    print("measured inputs from: %s" % o.source)
    print("parameters:")
    print("  state per rank %s, %d ranks per node, R = %d replicas, base every %d snapshots"
          % (fmt_bytes(o.state_bytes), o.ranks_per_node, o.replicas, K))
    print("  compression: base %.2fx, delta %.1fx (lossless) -> mean %s per rank per step, base step %s"
          % (o.base_ratio, o.delta_ratio, fmt_bytes(per_rank_step), fmt_bytes(per_rank_base)))
    print("  NIC %.0f Gbit/s per node for snapshots, step %.2f s, heartbeat %.0f ms, lease TTL %.0f s "
          "(keep-alive every %.2f s), agreement %.3f s (measured)"
          % (o.nic_gbps, o.step_s, o.period_ms, o.lease_ttl, ka, o.agreement_s))
    print("  ASSUMED: etcd sustains %.0f requests/s; %0.f B per watch event; lease scan %.1f s; RTT %.2f ms"
          % (o.etcd_rps, o.event_bytes, o.lease_scan_s, o.rtt_ms))
    print("  restore from the home copy %.2f GB/s per rank (measured, one core per rank)" % o.restore_local_gbps)
    if o.take_copy_gbps:
        print("  take() copy %.2f GB/s (measured): %.3f s blocked per step, independent of the job size"
              % (o.take_copy_gbps, o.state_bytes / (o.take_copy_gbps * 1e9)))
    print()
    rows = []
    for ranks in ranks_list:
        nodes = max(1, math.ceil(ranks / o.ranks_per_node))
        rpn = min(o.ranks_per_node, ranks)
        R = min(o.replicas, nodes - 1)
        N = nodes
        det_sus = o.misses * period + period + o.agreement_s + 3 * o.rtt_ms / 1000.0
        det_lease = o.lease_ttl + o.lease_scan_s + period + o.agreement_s
        repl_bytes = rpn * per_rank_step * R
        repl_base = rpn * per_rank_base * R
        repl_t = repl_bytes / nic_Bps
        repl_tb = repl_base / nic_Bps
        lag = max(0.0, repl_t - o.step_s)
        keepalive_rps = N / ka
        elect_rps = N / period
        elect_keys = N / period  # one key per daemon
        coord_keys = (N + 2) / min(period, 0.25)
        cut_writes = 1.0 / o.step_s
        read_load = (keepalive_rps + elect_keys + coord_keys + cut_writes) / o.etcd_rps
        loss_writes = (N - 1) + 1 + 1  # suspicion keys, the eviction txn, the record txn
        loss_events = 1 * N  # the record, x N watchers (P w/ only)
        cut_events = N / o.step_s
        kv = o.rtt_ms / 1000.0 + N * o.event_bytes * 8 / (o.nic_gbps * 1e9) + o.kv_poll_ms / 2000.0
        restore_home = o.state_bytes / (o.restore_local_gbps * 1e9)
        restore_repl = max(rpn * chain_max / nic_Bps, restore_home) + o.rtt_ms / 1000.0
        hb_rate = 2 * (N - 1) / period
        rows.append(dict(ranks=ranks, N=N, R=R, det_sus=det_sus, det_lease=det_lease, rb=repl_bytes,
                         rt=repl_t, rtb=repl_tb, lag=lag, ka=keepalive_rps, el=elect_rps, ek=elect_keys,
                         ck=coord_keys, load=read_load, lw=loss_writes, le=loss_events, ce=cut_events,
                         hb=hb_rate, kv=kv, rh=restore_home, rr=restore_repl))
    print("| ranks | nodes | R | detection+agreement s, suspicion (lease) | repl. bytes/node/step (mean) "
          "| repl. s/step mean (base step) | lag s (base step) | restore from home s | restore from replicas s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["R"] == 0:
            print("| %d | %d | 0 | - | no replica (one node: a node loss loses the job) | - | - | %.2f | - |"
                  % (r["ranks"], r["N"], r["rh"]))
            continue
        print("| %d | %d | %d | %.2f (%.2f) | %s | %.3f (%.2f) | %.2f (%.2f) | %.2f | %.2f |"
              % (r["ranks"], r["N"], r["R"], r["det_sus"], r["det_lease"], fmt_bytes(r["rb"]), r["rt"], r["rtb"],
                 r["lag"], max(0.0, r["rtb"] - o.step_s), r["rh"], r["rr"]))
    print()
    print("control plane on etcd (per second, whole job, at heartbeat %.0f ms and a %.2f s step):"
          % (o.period_ms, o.step_s))
    print()
    print("| nodes | keep-alives/s | election ranges/s (keys/s) | coordinator keys read/s | cut txns/s "
          "| watch events/s (cut) | etcd load vs %.0f req/s | writes per node loss | watch events per node loss (MB) "
          "| heartbeats/s per node | KV id exchange s |" % o.etcd_rps)
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %d | %.0f | %.0f (%.0f) | %.0f | %.2f | %.0f | %.0f %% | %d | %d (%.1f) | %.0f | %.3f |"
              % (r["N"], r["ka"], r["el"], r["ek"], r["ck"], 1.0 / o.step_s, r["ce"], 100 * r["load"], r["lw"],
                 r["le"], r["le"] * o.event_bytes / 1e6, r["hb"], r["kv"]))
    print()
    print("notes:")
    print("  - election reads are one key per daemon per period (the oldest election/ key);")
    print("    the coordinator's members/ read is the only read that grows with N.")
    print("  - keep-alives: ASSUMED not raft writes (etcd 3.4 renews a lease on its leader), but each is a request.")
    print("  - a node loss at N nodes puts up to N - 1 suspicion keys (every survivor stops hearing it),")
    print("    raft writes, but no watch events: daemons watch P w/ only.")
    print("  - detection is 3 periods + one coordinator period (suspicion) or TTL + lease scan + one")
    print("    period (lease), independent of N if etcd keeps up; the lease path is the backstop.")
    print("  - heartbeats are a UDP full mesh: O(N) datagrams per node per period (120 B each).")
    print("  - the base step (every %d snapshots) sends %.0fx the mean; 'lag' uses the mean (the"
          % (K, per_rank_base / per_rank_step))
    print("    send queue absorbs the base step if the mean fits in a step).")
    print("  - restore from replicas assumes the replacement node's %d ranks fetch at once over its"
          % o.ranks_per_node)
    print("    NIC, a full chain each (a base + %d deltas, the worst case), replicas never the bottleneck." % (K - 1))
    print("  - not modelled: NCCL communicator init after the id exchange, etcd's disk (fsync) and")
    print("    its own network, stragglers, switch oversubscription, disk spill, the training's traffic.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
