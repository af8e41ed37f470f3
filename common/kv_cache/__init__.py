"""KV cache bookkeeping: cache group (paged blocks, per-request state slots) and tensor specs, the cache tensors of those specs (allocated, sized,
listed), block pools (block 0 = null), prefix caching by chained hashes."""
from .block_hash import hash_block, hash_blocks
from .block_pool import NULL_BLOCK, BlockPool
from .cache_tensors import allocate_cache_tensors, cache_bytes_per_block, tensors_by_group
from .kv_cache_manager import KVCacheManager, KVCacheStats
from .spec import CacheGroupSpec, CacheTensorSpec, check_cache_specs, check_cache_tensors

__all__ = ["CacheGroupSpec", "CacheTensorSpec", "BlockPool", "NULL_BLOCK", "KVCacheManager", "KVCacheStats", "hash_block",
           "hash_blocks", "check_cache_tensors", "check_cache_specs", "allocate_cache_tensors", "cache_bytes_per_block",
           "tensors_by_group"]
