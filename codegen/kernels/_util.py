"""Launch helpers shared by the kernel modules."""

import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def persistent_programs(device: torch.device, work: int) -> int:
    """Programs for a grid that loops over `work` items: a few per SM fill a GPU, and every
    program writes one partial row of a reduction, so more would only grow that buffer."""
    if device.type == "cuda" and not interpreting():
        return max(1, min(work, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(work, 4))


def dot_precision(dtype: torch.dtype) -> str:
    # tl.dot defaults to tf32 for fp32 operands on GPU; fp32 inputs ask for fp32 results.
    return "ieee" if dtype == torch.float32 else "tf32"
