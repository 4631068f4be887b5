"""portattn: portable Triton attention kernels for LLM serving on AMD and NVIDIA GPUs.

The public ops (DESIGN.md §2). Importing this package never touches a device.
"""

from portattn.blocksize import MultipleOf, Participant, select_common_block_size

__all__ = [
    "MultipleOf",
    "Participant",
    "select_common_block_size",
]
