"""α–β cost of collectives per link tier, and which tier each parallel axis lands on.

A ring collective over n ranks of a payload of S bytes takes, per rank (Thakur et al. 2005; NCCL's
bus-bandwidth convention): all-reduce 2(n−1)·α + 2(n−1)/n·S/β; all-gather and reduce-scatter
(n−1)·α + (n−1)/n·S/β (S the full, unsharded size); all-to-all (n−1)·α + (n−1)/n·S/β; a point-to-point
send α + S/β. α is the latency of one ring step, β the link bandwidth of the slowest hop.

Ranks are laid out tp fastest, then cp, dp, pp (tessera.topology's default order), so a group whose
members span ``stride × size`` consecutive ranks stays inside one node when that is at most the node's
GPU count, and otherwise crosses the network, where each GPU has its own NIC bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    alpha_s: float  # seconds per ring step
    bytes_per_s: float  # bandwidth per GPU, one direction


def link_for(gpu, stride: int, size: int) -> Link:
    """The link a group of ``size`` ranks spaced ``stride`` apart uses."""
    if stride * size <= gpu.gpus_per_node:  # NCCL reaches nccl_efficiency of the line rate
        return Link(gpu.intra_alpha_s, gpu.intra_bytes_per_s * gpu.nccl_efficiency)
    return Link(gpu.inter_alpha_s, gpu.inter_bytes_per_s * gpu.nccl_efficiency)


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2.0 * (n - 1) / n * nbytes / link.bytes_per_s


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """Also reduce-scatter and all-to-all: each rank moves (n−1)/n of the full size."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes / link.bytes_per_s


reduce_scatter_s = all_gather_s
all_to_all_s = all_gather_s


def p2p_s(nbytes: float, link: Link) -> float:
    return link.alpha_s + nbytes / link.bytes_per_s


def axis_links(gpu, layout) -> dict[str, Link]:
    """Link of each axis's group under the order pp-dp-cp-tp (tp fastest)."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    return {
        "tp": link_for(gpu, 1, tp),
        "cp": link_for(gpu, tp, cp),
        "dp": link_for(gpu, tp * cp, dp),
        "ep": link_for(gpu, tp * cp, layout.ep),  # ep peers are neighbours inside dp
        "pp": link_for(gpu, tp * cp * dp, layout.pp),
    }
