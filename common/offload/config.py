"""The `moe_offload:` settings of a preset (and their command-line twins), checked when made."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from .placement import DynamicPlacement, FrequencyPlacement, Placement, PrefixPlacement

PLACEMENTS = ("prefix", "frequency", "dynamic")
HOST_BACKENDS = ("torch", "kt")


@dataclasses.dataclass(frozen=True)
class MoEOffloadConfig:
    """resident_experts: N device slots per MoE layer (hash-routed and MTP layers too), 0..E (0: every routed
    expert on the host); the other experts run on the host. placement: which experts take the slots (prefix: 0..N-1; frequency: the N most routed in
    `frequency_file`; dynamic: the N the last prefill routed most, starting from frequency_file's, else the
    prefix). host_backend: torch (exact, fp32) or kt (kt-kernel's MXFP4 kernels, bf16 activations)."""

    resident_experts: int
    placement: str = "prefix"
    frequency_file: str | None = None
    host_backend: str = "torch"

    def __post_init__(self):
        n = self.resident_experts
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"moe_offload resident_experts must be an int >= 0, got {n!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"moe_offload placement {self.placement!r}: expected one of {list(PLACEMENTS)}")
        if self.host_backend not in HOST_BACKENDS:
            raise ValueError(f"moe_offload host_backend {self.host_backend!r}: expected one of {list(HOST_BACKENDS)}")
        if self.placement == "frequency" and not self.frequency_file:
            raise ValueError("moe_offload placement frequency needs a frequency_file (write one with "
                             "--record-routing PATH)")
        if self.placement == "prefix" and self.frequency_file:
            raise ValueError("moe_offload frequency_file is read by placement frequency or dynamic, not prefix")
        if self.frequency_file and not Path(self.frequency_file).is_file():
            raise ValueError(f"moe_offload frequency_file {self.frequency_file}: no such file")

    @classmethod
    def from_dict(cls, spec) -> "MoEOffloadConfig":
        """A preset's `moe_offload:` mapping -> the config; ValueError naming an unknown or bad key."""
        if not isinstance(spec, dict):
            raise ValueError(f"moe_offload must be a mapping, got {spec!r}")
        fields = [f.name for f in dataclasses.fields(cls)]
        if unknown := sorted(set(spec) - set(fields)):
            raise ValueError(f"unknown moe_offload settings {unknown}; expected {fields}")
        if "resident_experts" not in spec:
            raise ValueError("moe_offload needs resident_experts")
        return cls(**spec)

    def make_placement(self) -> Placement:
        """The placement policy (reads frequency_file; ValueError if it is not a routing-count file)."""
        n = self.resident_experts
        start = FrequencyPlacement.from_file(n, self.frequency_file) if self.frequency_file else PrefixPlacement(n)
        if self.placement == "dynamic":
            return DynamicPlacement(n, start)
        return start
