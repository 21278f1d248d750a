"""What a collective costs on a GPU cluster's network, for the data-sheet presets (`shoal plan --preset`):
NCCL's own performance model with the bus bandwidths that nccl-tests measures on such clusters.

The model is the one NCCL tunes itself by (src/graph/tuning.cc, NVIDIA/nccl at 01afd20): a collective
over n ranks on N nodes takes a base latency, a latency per step (2(n-1) steps for a ring all-reduce,
n-1 for an all-gather or reduce-scatter, of which 2(N-1) or N-1 cross the network; a tree all-reduce
2((n/N - 1) intra + log2 N inter)), and its bytes over the algorithm bandwidth (the bus bandwidth x n /
steps for a ring, x 1/2 for a tree); NCCL picks the fastest of its algorithms and protocols for each
message (here ring and tree, Simple and LL: LL is the low-latency protocol at a quarter of the
bandwidth). The bus bandwidths are nccl-tests' `busbw` at large messages, which already holds what the
links achieve (protocol, NVLS, in-network reduction):

  nvlink4-ndr400   H100/H200 HGX: 8 GPUs on NVLink 4 / NVSwitch, 460 GB/s in a node (measured 460-480,
                   Alaya NeW, "NCCL-tests in practice", 2026-05-06); 400 GB/s across nodes of 8 on
                   InfiniBand NDR, a 400 Gb/s NIC per GPU (measured 400-450, Saturn Cloud, "Validating
                   Multi-Node GPU Clusters with NCCL Tests"); 40 GB/s with one GPU per node (no NVLink
                   behind the NIC: measured 40-50, same source)
  nvlink3-hdr200   A100 HGX: NVLink 3, 230 GB/s (measured 230-250, Alaya NeW); across nodes on
                   InfiniBand HDR 230 GB/s (measured 250-300, Saturn Cloud; taken no faster than in a
                   node); one GPU per node 20 GB/s (HDR's 25 GB/s at NDR's measured 0.8 of its line)

  nvlink4-roce400, nvlink4-eth100, nvlink3-efa400, nvlink3-opa400
                   known by their links alone (RoCE 400 Gb/s a GPU; 100 GbE a GPU; 4 x 100 Gb/s EFA or
                   Omni-Path a node): no nccl-tests figure of their own was found, so each NIC is taken at
                   the fraction of its line rate that NDR's one-GPU-per-node busbw reaches (40 of 50 GB/s,
                   Saturn Cloud above: 0.8), the node's NICs together across whole nodes (from_links)

A group that has p of its members in each node goes across nodes at a bus bandwidth on the straight line
between the one-GPU-per-node figure (p = 1) and the whole-node one (p = the node's GPUs): p NICs carry it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.errors import UserError

# NCCL's latencies, microseconds (tuning.cc): base per algorithm and protocol, then per step on each link
BASE_US = {("ring", "ll"): 3.6, ("ring", "simple"): 8.4, ("tree", "ll"): 4.4, ("tree", "simple"): 0.0}
STEP_US = {("nvlink", "ring", "ll"): 0.47, ("nvlink", "ring", "simple"): 3.4,
           ("nvlink", "tree", "ll"): 0.52, ("nvlink", "tree", "simple"): 28.0,
           ("net", "ring", "ll"): 2.7, ("net", "ring", "simple"): 9.6,
           ("net", "tree", "ll"): 5.0, ("net", "tree", "simple"): 50.0}
LL_SHARE = {"ring": 1 / 4, "tree": 1 / 3.8}  # LL's share of the bus bandwidth (tuning.cc)
TREE_SHARE = 0.9  # a tree's bus bandwidth against the ring's (tuning.cc)


@dataclass(frozen=True)
class Network:
    name: str
    gpus_per_node: int  # the node the figures were measured on
    intra: float  # bus bandwidth in a node, bytes/s
    across: float  # bus bandwidth across whole nodes
    one_per_node: float  # bus bandwidth across nodes with one GPU of the group in each

    def bus_bandwidth(self, per_node: int, nodes: int) -> float:
        if nodes <= 1:
            return self.intra
        p = min(max(per_node, 1), self.gpus_per_node)
        if self.gpus_per_node == 1:
            return self.one_per_node
        return self.one_per_node + (self.across - self.one_per_node) * (p - 1) / (self.gpus_per_node - 1)

    def seconds(self, op: str, nbytes: float, n: int, per_node: int) -> float:
        """Seconds of collective `op` (all_reduce, all_gather, reduce_scatter, all_to_all: `nbytes` the whole
        tensor; send_recv: one message) over n ranks, `per_node` of them in each node."""
        if n <= 1 and op != "send_recv":
            return 0.0
        per_node = max(1, min(per_node, n))
        nodes = math.ceil(n / per_node)
        busbw = self.bus_bandwidth(per_node, nodes)
        if op == "send_recv":  # one hop: a step of the ring's latency on its link, the bytes at the bus bandwidth
            link = "net" if nodes > 1 else "nvlink"
            return min(1e-6 * (BASE_US[("ring", proto)] + STEP_US[(link, "ring", proto)])
                       + nbytes / (busbw * (LL_SHARE["ring"] if proto == "ll" else 1.0)) for proto in ("ll", "simple"))
        if op not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            raise ValueError(f"no model for collective {op!r}")
        # all_to_all (`nbytes`: what one rank sends in all, a share to each rank): each rank sends and receives
        # (n - 1) / n of it, as a reduce-scatter moves, in n - 1 steps of one peer each; nccl-tests' bus bandwidth
        # of an all-to-all is defined so (algorithm bandwidth x (n - 1) / n), so the ring's formula holds
        steps, cross = (2 * (n - 1), 2 * (nodes - 1)) if op == "all_reduce" else (n - 1, nodes - 1)
        times = []
        for proto in ("ll", "simple"):
            share = LL_SHARE["ring"] if proto == "ll" else 1.0
            latency = (BASE_US[("ring", proto)] + (steps - cross) * STEP_US[("nvlink", "ring", proto)]
                       + cross * STEP_US[("net", "ring", proto)])
            times.append(1e-6 * latency + nbytes * steps / n / (busbw * share))
            if op == "all_reduce":  # a tree: its latency grows with log2 of the nodes, half the bytes' rate
                tshare = TREE_SHARE * (LL_SHARE["tree"] if proto == "ll" else 1.0)
                tlat = BASE_US[("tree", proto)] + 2 * ((per_node - 1) * STEP_US[("nvlink", "tree", proto)]
                                                       + math.log2(nodes) * STEP_US[("net", "tree", proto)])
                times.append(1e-6 * tlat + nbytes / (0.5 * busbw * tshare))
        return min(times)


# The fraction of a NIC's line rate that nccl-tests' busbw reaches with one GPU per node: 40-50 GB/s on a
# 400 Gb/s (50 GB/s) NDR NIC (Saturn Cloud, above), the lower end taken
NIC_FRACTION = 0.8


def from_links(name: str, intra: float, nic_gbit: float, nics: int, gpus_per_node: int = 8,
               fraction: float = NIC_FRACTION) -> Network:
    """A network known by its links alone (no nccl-tests figure of its own found): across whole nodes the
    node's NICs together, with one GPU per node one NIC, each at `fraction` of its line rate."""
    nic = nic_gbit * 1e9 / 8
    return Network(name, gpus_per_node, intra, fraction * nic * nics, fraction * nic)


NETWORKS = {
    "nvlink4-ndr400": Network("nvlink4-ndr400", 8, 460e9, 400e9, 40e9),
    "nvlink3-hdr200": Network("nvlink3-hdr200", 8, 230e9, 230e9, 20e9),
    # H100 HGX with 8 x 400 Gb/s RoCE v2 (Ethernet; Meta's Llama 3 RoCE cluster, Grand Teton nodes)
    "nvlink4-roce400": from_links("nvlink4-roce400", 460e9, 400, 8),
    # cloud nodes with less network than GPUs: A100 HGX with 4 x 100 Gb/s EFA (AWS p4d.24xlarge: 400 Gb/s a
    # node) and with 4 x 100 Gb/s Omni-Path (Jean Zay's gpu_p5, where BLOOM trained)
    "nvlink3-efa400": from_links("nvlink3-efa400", 230e9, 100, 4),
    "nvlink3-opa400": from_links("nvlink3-opa400", 230e9, 100, 4),
    # H100 HGX on 100 Gb/s Ethernet a GPU (8 x 100 GbE; a commodity cloud's network)
    "nvlink4-eth100": from_links("nvlink4-eth100", 460e9, 100, 8),
}


def network(name: str) -> Network:
    key = name.lower()
    if key not in NETWORKS:
        raise UserError(f"unknown network {name!r}; use one of {', '.join(NETWORKS)}")
    return NETWORKS[key]
