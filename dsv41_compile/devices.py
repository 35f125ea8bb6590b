"""Devices as the step-time model sees them (`report.step_time`): device memory, peak matmul
rates, links and the latency of one collective. Each named device's figures are public
specifications; docs/devices.md gives each one's source, or says it is assumed. The latency of
a collective is an assumption (no vendor states it for a decode step's small messages): the
model answers at the two values of `LATENCIES`.

    device = DEVICES["950dt"]
    mine = Device(name="my-npu", hbm_bytes=96e9, hbm_bytes_per_s=3.2e12,
                  flops={"bf16": 400e12}, link_bytes_per_s=200e9, node_link_bytes_per_s=25e9)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "DEVICES",
    "LATENCIES",
    "MATMUL_DTYPES",
    "Device",
    "device_named",
    "latency_label",
    "timed_choice",
]

LATENCIES = (10e-6, 30e-6)
"""The two per-collective latencies (seconds) the model answers at: an assumption, the range of
small-message collectives on HCCL and NCCL within a node (docs/devices.md)."""


def latency_label(seconds: float) -> str:
    """How the tools name a latency in their tables and JSON: `"10us"`."""
    return f"{seconds * 1e6:.0f}us"


def timed_choice(
    option: str,
    given: str,
    chosen: str,
    seconds: Mapping[str, float],
    per: str,
    digits: int,
    device: str,
    rows: int,
) -> str:
    """How a choice between two cuts by time reads in `graph.py`: the chosen one's time, the
    other's, the device and the workload they were timed at."""
    (other,) = set(seconds) - {chosen}
    return (
        f"{option}={given!r}: {chosen}, {seconds[chosen] * 1e6:.{digits}f} us per {per} "
        f"against {seconds[other] * 1e6:.{digits}f} us {other} on {device} at {rows} rows "
        "per step"
    )


MATMUL_DTYPES = ("fp4", "fp8", "bf16")
"""A matmul's rate is its narrower operand's: from the narrowest to the widest. fp32 and fp16
operands run at the bf16 rate (no device here has a faster fp32 matmul)."""


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (one rank): what bounds a step on it. Rates are peak, dense, per second;
    bytes are decimal (1 GB = 1e9)."""

    name: str
    hbm_bytes: float
    """Device memory, bytes."""
    hbm_bytes_per_s: float
    """Device memory bandwidth."""
    flops: dict[str, float] = field(default_factory=dict)
    """Peak dense matmul FLOP/s by operand dtype ("bf16", "fp8" for FP8 / MXFP8, "fp4" for
    MXFP4). A dtype the device lacks is absent; its matmuls run at the next wider rate."""
    link_bytes_per_s: float
    """One rank's bandwidth to the other ranks of its node, one way."""
    node_link_bytes_per_s: float
    """One rank's bandwidth to ranks of other nodes, one way."""
    ranks_per_node: int = 8
    """The ranks that share a node's link (a server's accelerators; consecutive ranks): a
    collective over more ranks than this crosses nodes (`collective_seconds`)."""
    collective_latency: float = LATENCIES[0]
    """Seconds one collective takes before its bytes move (assumed: `LATENCIES`)."""

    def __post_init__(self) -> None:
        for name in ("hbm_bytes", "hbm_bytes_per_s", "link_bytes_per_s", "node_link_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Device {self.name!r}: {name} must be > 0")
        if "bf16" not in self.flops:
            raise ValueError(f"Device {self.name!r}: flops needs a 'bf16' rate")
        unknown = sorted(set(self.flops) - set(MATMUL_DTYPES))
        if unknown:
            raise ValueError(
                f"Device {self.name!r}: flops has {unknown}; its keys are {list(MATMUL_DTYPES)}"
            )
        if self.collective_latency < 0:
            raise ValueError(f"Device {self.name!r}: collective_latency must be >= 0")
        if self.ranks_per_node < 1:
            raise ValueError(f"Device {self.name!r}: ranks_per_node must be >= 1")

    def __hash__(self) -> int:  # a frozen value with a dict field: options hold it in keys
        return hash((self.name, self.hbm_bytes_per_s, tuple(sorted(self.flops.items()))))

    def matmul_flops(self, operand: str) -> float:
        """The peak rate of a matmul whose narrower operand is `operand` (one of
        `MATMUL_DTYPES`): the device's rate for it, else the next wider one it has."""
        for dtype in MATMUL_DTYPES[MATMUL_DTYPES.index(operand) :]:
            if dtype in self.flops:
                return self.flops[dtype]
        raise AssertionError("__post_init__ checked the bf16 rate")

    def roofline_seconds(self, bytes_read: float, flops: float, operand: str = "bf16") -> float:
        """A matmul's time: the longer of reading `bytes_read` from HBM and its `flops` at the
        rate of `operand` (`matmul_flops`)."""
        return max(bytes_read / self.hbm_bytes_per_s, flops / self.matmul_flops(operand))

    def collective_seconds(
        self, bytes_out: float, count: int = 1, *, group: int = 1, all_to_all: bool = False
    ) -> float:
        """`count` collectives in a row over groups of `group` consecutive ranks: a latency
        each and `bytes_out` in all leaving the rank. Within a node (`group <=
        ranks_per_node`) the bytes take the node's link. A group across nodes: an all-to-all
        sends the share of its bytes that goes to other nodes' ranks, `(group -
        ranks_per_node) / (group - 1)` (even splits), over the link between nodes, the rest
        over the node's, both at once; a ring collective (all-gather, reduce-scatter,
        all-reduce) moves all of its bytes through a hop between nodes."""
        latency = count * self.collective_latency
        if group <= self.ranks_per_node:
            return latency + bytes_out / self.link_bytes_per_s
        if not all_to_all:
            return latency + bytes_out / min(self.link_bytes_per_s, self.node_link_bytes_per_s)
        away = bytes_out * (group - self.ranks_per_node) / (group - 1)
        return latency + max(
            away / self.node_link_bytes_per_s, (bytes_out - away) / self.link_bytes_per_s
        )

    def with_latency(self, seconds: float) -> Device:
        return dataclasses.replace(self, collective_latency=seconds)


_T, _G = 1e12, 1e9

DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # Ascend 950DT and 950PR: Huawei's Ascend roadmap (Huawei Connect 2025); bf16 assumed
        # half the FP8 rate
        Device(
            name="950dt",
            hbm_bytes=144 * _G,
            hbm_bytes_per_s=4.0 * _T,
            flops={"bf16": 0.5e15, "fp8": 1e15, "fp4": 2e15},
            link_bytes_per_s=1.0 * _T,
            node_link_bytes_per_s=1.0 * _T,
        ),
        Device(
            name="950pr",
            hbm_bytes=128 * _G,
            hbm_bytes_per_s=1.6 * _T,
            flops={"bf16": 0.5e15, "fp8": 1e15, "fp4": 2e15},
            link_bytes_per_s=1.0 * _T,
            node_link_bytes_per_s=1.0 * _T,
        ),
        # Atlas A3: one die of an Ascend 910C package (two dies), in a CloudMatrix super-node
        Device(
            name="a3",
            hbm_bytes=64 * _G,
            hbm_bytes_per_s=1.6 * _T,
            flops={"bf16": 376 * _T},
            link_bytes_per_s=196 * _G,
            node_link_bytes_per_s=196 * _G,
            ranks_per_node=16,
        ),
        # Atlas A2: an Ascend 910B, 8 per server (HCCS), RoCE between servers
        Device(
            name="a2",
            hbm_bytes=64 * _G,
            hbm_bytes_per_s=1.6 * _T,
            flops={"bf16": 313 * _T},
            link_bytes_per_s=196 * _G,
            node_link_bytes_per_s=25 * _G,
        ),
        # NVIDIA H200 SXM: NVLink within a node, 400 Gb/s InfiniBand between nodes
        Device(
            name="h200",
            hbm_bytes=141 * _G,
            hbm_bytes_per_s=4.8 * _T,
            flops={"bf16": 989 * _T, "fp8": 1979 * _T},
            link_bytes_per_s=450 * _G,
            node_link_bytes_per_s=50 * _G,
        ),
    )
}
"""The named devices (docs/devices.md: each figure's source, or that it is assumed)."""


def device_named(name: str) -> Device:
    """The named device, or a ValueError listing the names."""
    if name not in DEVICES:
        raise ValueError(
            f"device={name!r} is not a known device; choose one of {sorted(DEVICES)}, or pass "
            "a dsv41_compile.devices.Device of your own"
        )
    return DEVICES[name]
