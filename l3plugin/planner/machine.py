"""The machine the planner plans for: one GPU's memory, compute and links, as flags with presets.

Every default is a public H100 SXM datasheet figure or a stated assumption (``assumptions`` lists them
all; the report prints them):
    80 GB HBM3                    --gpu-memory-gb 80 (read as GiB, as torch reports it)
    989 TFLOPs dense BF16         --peak-tflops 989
    NVLink 900 GB/s bidirectional --intra-node-gbps 450 (GB/s each way per GPU, what a ring step uses)
    400 Gb/s InfiniBand per GPU   --inter-node-gbps 50 (GB/s; the paper's RoCE is also 50 GB/s per GPU)
    8 GPUs per node               --gpus-per-node 8 (an HGX H100 node)
Assumptions (not datasheet figures):
    --mfu 0.5: fraction of peak that forward/backward compute reaches. The paper measures 400 TFLOPs/GPU
        end to end at 8K, 40% of peak, including its 12% bubble (m = p) and exposed TP collectives, which
        this model adds on top; compute alone therefore runs near 400 x 1.12 / 989 = 45% or a little
        more. 0.5 is an assumption in that range, not fitted to any layout (with it the paper's 8K layout
        is estimated at 382 model TFLOPs/GPU).
    --usable-memory-fraction 0.95 and 2 GiB reserved: allocator fragmentation and the transient tensors
        of the layer being computed; the CUDA context and NCCL buffers.
    --latency-us 5: per ring step of a collective or per P2P message (order of NCCL's on NVLink and
        InfiniBand); a ring collective over g ranks takes g-1 steps.
    --cp-kv regather: CP keeps only its local K/V for backward and all-gathers them again there
        (l3plugin's cp_kv="regather", the default of its CP attention; Transformer Engine's all-gather CP
        does the same); the paper's claim that CP cuts activation memory by the sequence split holds only
        then. ``keep`` (cp_kv="keep") saves the gathered K/V instead (memory instead of a second all-gather).
        The two modes are l3plugin.cp's CP_KV_MODES (a test keeps them equal; the planner imports
        no torch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from l3plugin.arguments.checks import check_number

GIB = float(2**30)
CP_KV_MODES = ("regather", "keep")





@dataclass(frozen=True)
class Hardware:
    """Per-GPU figures; ``gpus_per_node`` and memory size travel in PlanRequest (they shape the search)."""

    name: str = "h100"
    peak_tflops: float = 989.0  # H100 SXM dense BF16 (datasheet)
    mfu: float = 0.5  # achieved fraction of peak in forward/backward compute (see module docstring)
    intra_node_gbps: float = 450.0  # GB/s each way per GPU: NVLink 4, 900 GB/s bidirectional
    inter_node_gbps: float = 50.0  # GB/s per GPU: one 400 Gb/s NIC per GPU
    latency_s: float = 5e-6  # per ring step or P2P message
    usable_fraction: float = 0.95  # of GPU memory, before the fixed reservation
    reserved_gb: float = 2.0  # CUDA context and NCCL communicator buffers
    cp_kv: str = "regather"  # "keep": save the all-gathered K/V for backward instead of gathering again

    def __post_init__(self):
        for name, flag in (("peak_tflops", "--peak-tflops"), ("intra_node_gbps", "--intra-node-gbps"),
                           ("inter_node_gbps", "--inter-node-gbps")):
            check_number(flag, getattr(self, name), 0, low_open=True)
        check_number("--mfu", self.mfu, 0, 1, low_open=True)
        check_number("--usable-memory-fraction", self.usable_fraction, 0, 1, low_open=True)
        for name, flag in (("latency_s", "--latency-us"), ("reserved_gb", "reserved_gb")):
            check_number(flag, getattr(self, name), 0)
        if self.cp_kv not in CP_KV_MODES:
            raise ValueError(f"--cp-kv={self.cp_kv!r} is invalid: choose one of {', '.join(CP_KV_MODES)}")

    def usable_bytes(self, memory_gb: float) -> float:
        return max(0.0, memory_gb * self.usable_fraction - self.reserved_gb) * GIB

    def headroom_text(self) -> str:
        return f"{1 - self.usable_fraction:.0%} + {self.reserved_gb:g} GiB headroom"

    def to_dict(self) -> dict:
        return asdict(self)


MACHINES = {
    "h100": Hardware(),
}
# Preset node shape: (GiB per GPU, GPUs per node); they live in PlanRequest since they shape the search.
MACHINE_NODES = {
    "h100": (80.0, 8),  # H100 SXM 80 GB HBM3; HGX H100 8-GPU node
}

# CLI flag -> (Hardware field, scale from the flag's unit to the field's)
FLAG_FIELDS = {"peak_tflops": ("peak_tflops", 1.0), "mfu": ("mfu", 1.0),
               "intra_node_gbps": ("intra_node_gbps", 1.0), "inter_node_gbps": ("inter_node_gbps", 1.0),
               "latency_us": ("latency_s", 1e-6), "usable_memory_fraction": ("usable_fraction", 1.0),
               "cp_kv": ("cp_kv", None)}


def machine_from_flags(preset: str, **flags) -> Hardware:
    """A preset with the flags that were given (None = keep the preset's value) applied."""
    if preset not in MACHINES:
        raise ValueError(f"--machine={preset!r} is not a known preset: choose one of {', '.join(MACHINES)}")
    changes = {}
    for flag, value in flags.items():
        if value is None:
            continue
        name, scale = FLAG_FIELDS[flag]
        changes[name] = value * scale if scale else value
    return replace(MACHINES[preset], **changes)


def assumptions(hw: Hardware, gpus_per_node: int, memory_gb: float) -> list[str]:
    """Every figure the estimates rest on, in words, for the report."""
    return [
        f"machine {hw.name}: {memory_gb:g} GiB per GPU, {hw.usable_fraction:.0%} usable minus {hw.reserved_gb:g} GiB "
        f"(CUDA context, NCCL buffers); {gpus_per_node} GPUs per node",
        f"compute: {hw.peak_tflops:g} dense BF16 TFLOPs x MFU {hw.mfu:g}; backward = 2 x forward; no recomputation",
        f"links: {hw.intra_node_gbps:g} GB/s each way per GPU inside a node (NVLink), {hw.inter_node_gbps:g} GB/s "
        f"per GPU across nodes; a group leaving its node runs at the network rate; {hw.latency_s * 1e6:g} us per "
        f"ring step (g-1 steps for a collective over g ranks) or P2P message",
        "TP: 2 all-gathers + 2 reduce-scatters per layer per direction (sequence parallel), fully exposed (paper 5.2)",
        "CP: K/V all-gather per layer in forward, " + (
            "all-gather again + dK/dV reduce-scatter in backward (only local K/V kept), fully exposed (paper 5.2)"
            if hw.cp_kv == "regather" else
            "dK/dV reduce-scatter in backward; the gathered K/V stay in memory until then, fully exposed")
        + "; load balanced by the 2 x CP chunk split (causal mask; document-mask imbalance not modelled)",
        "PP: bubble simulated with the schedule (P2P latency included); DP (ZeRO) traffic overlaps compute except "
        "the last chunk's share",
    ]
