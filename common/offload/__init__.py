"""MoE expert offload: N resident experts per layer on the device, the others computed on the host CPU in MXFP4."""
from .config import HOST_BACKENDS, PLACEMENTS, MoEOffloadConfig
from .expert_offload import ExpertOffload
from .host_experts import HostExperts, HostMoEHandle, MXFP4Experts, TorchHostExperts, dequant_expert
from .kt_backend import KTKernelHostExperts, kt_kernel_unavailable
from .placement import (
    DynamicPlacement,
    FrequencyPlacement,
    PrefixPlacement,
    ResidentExperts,
    RoutedSplit,
    RoutingCounter,
    load_routing_counts,
)

__all__ = ["HOST_BACKENDS", "PLACEMENTS", "MoEOffloadConfig", "ExpertOffload", "HostExperts", "HostMoEHandle",
           "MXFP4Experts", "TorchHostExperts", "dequant_expert", "KTKernelHostExperts", "kt_kernel_unavailable",
           "DynamicPlacement", "FrequencyPlacement", "PrefixPlacement", "ResidentExperts", "RoutedSplit",
           "RoutingCounter", "load_routing_counts"]
