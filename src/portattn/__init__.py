"""portattn: portable Triton attention kernels for LLM serving on AMD and NVIDIA GPUs.

The public ops (docs/design.md §2). Importing this package never touches a device.
"""

from portattn.blocksize import MultipleOf, Participant, select_common_block_size
from portattn.kernels.kv_cache import gather_kv_cache, write_kv_cache
from portattn.kernels.mla_decode import mla_decode
from portattn.kernels.page_indices import expand_page_indices
from portattn.kernels.paged_attention import paged_attention
from portattn.ops_registry import participant, supported_block_sizes
from portattn.policy.mla import MlaConfig
from portattn.policy.paged import PagedConfig, PrefillConfig

__all__ = [
    "MultipleOf",
    "Participant",
    "select_common_block_size",
    "write_kv_cache",
    "gather_kv_cache",
    "expand_page_indices",
    "mla_decode",
    "paged_attention",
    "supported_block_sizes",
    "participant",
    "PagedConfig",
    "PrefillConfig",
    "MlaConfig",
]
