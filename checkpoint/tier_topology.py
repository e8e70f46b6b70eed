"""Which node each rank runs on, and which ranks on other nodes hold a rank's local-tier replicas.

Nodes come from ``LOCAL_WORLD_SIZE`` (set by ``torchrun``: consecutive ranks share a node) or else
from each rank's host name (one ``all_gather_object``); a caller (a test, a launcher with its own
placement) may name them explicitly. Replicas go to the ranks with the same local index on the next
``replication`` nodes, so a node lost takes no replica of its own ranks with it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Topology", "detect_nodes"]


def detect_nodes(group: dist.ProcessGroup | None = None) -> list[Hashable]:
    """The node of every rank of ``group``: ``rank // LOCAL_WORLD_SIZE`` when it is set, else the host name."""
    world = dist.get_world_size(group)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.isdigit() and int(local) > 0:
        return [rank // int(local) for rank in range(world)]
    names: list[object] = [None] * world
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return [str(name) for name in names]


@dataclass(frozen=True)
class Topology:
    """Nodes and replica peers of a job of ``len(nodes)`` ranks."""

    nodes: tuple[Hashable, ...]
    """the node of each rank (any hashable name), by rank"""
    replication: int = 1
    """how many ranks on other nodes hold a copy of each rank's local checkpoints"""

    def __post_init__(self) -> None:
        count = len(self.groups())
        if self.replication < 0:
            raise ValueError(f"replication must be >= 0, got {self.replication}")
        if self.replication >= count and self.replication > 0:
            raise ValueError(
                f"replication={self.replication} needs at least {self.replication + 1} nodes (a copy on each of "
                f"that many other nodes), but the job has {count} ({self.nodes}); lower replication or name the "
                "nodes (nodes=[...], one per rank)"
            )

    @classmethod
    def of(cls, nodes: Sequence[Hashable], replication: int) -> Topology:
        return cls(tuple(nodes), replication)

    def groups(self) -> list[list[int]]:
        """The ranks of each node, nodes in the order of their lowest rank."""
        by_node: dict[Hashable, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            by_node.setdefault(node, []).append(rank)
        return list(by_node.values())

    def peers(self, rank: int) -> list[int]:
        """The ranks holding copies of ``rank``'s local checkpoints, nearest node first."""
        groups = self.groups()
        home = next(i for i, g in enumerate(groups) if rank in g)
        index = groups[home].index(rank)
        chosen = []
        for hop in range(1, self.replication + 1):
            node = groups[(home + hop) % len(groups)]
            chosen.append(node[index % len(node)])
        return chosen

    def sources(self, rank: int) -> list[int]:
        """The ranks whose local checkpoints ``rank`` holds copies of."""
        return [other for other in range(len(self.nodes)) if rank in self.peers(other)]

    def holders(self, rank: int) -> list[int]:
        """Where ``rank``'s checkpoints live: the rank itself first, then its peers."""
        return [rank, *self.peers(rank)]
