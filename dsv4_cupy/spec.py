"""DeepSeek-V4 sparse-MLA facts: constants, C128A widths, KV-cache layout, backend.

Everything here is plain integers and strings; nothing touches arrays or kernels.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from .device import require_gpu
from .errors import NoGPUError, UnsupportedDeviceError
from .scalars import check_int

#: FlashMLA decode asserts ``extra_topk % B_TOPK == 0`` with B_TOPK 64 or 128, and
#: an unaligned width (17 for max_model_len 2136) crashed the sm100 head-64 kernel.
C128A_TOPK_ALIGNMENT = 128
#: Logical tokens per KV-cache block for every DeepSeek-V4 group.
KV_BLOCK_SIZE = 256
NOPE_HEAD_DIM = 448
ROPE_HEAD_DIM = 64
HEAD_SIZE = NOPE_HEAD_DIM + ROPE_HEAD_DIM
#: fp8_ds_mla bytes per token: 448 fp8 NoPE + 64 bf16 RoPE (128 B) + 8 scale bytes.
FP8_DS_MLA_BYTES_PER_TOKEN = NOPE_HEAD_DIM + 2 * ROPE_HEAD_DIM + 8
#: The largest finite FP8 E4M3 (e4m3fn) value: what a tile's amax is scaled to.
FP8_E4M3_MAX = 448.0
#: An fp8_ds_mla page of B states is block-planar: B records of FP8_RECORD_BYTES
#: (the NoPE dims as FP8, then the RoPE dims as bf16), then B scale records of
#: SCALE_RECORD_BYTES (a UE8M0 byte per QUANT_TILE NoPE dims, then a zero pad byte).
FP8_RECORD_BYTES = NOPE_HEAD_DIM + 2 * ROPE_HEAD_DIM
SCALE_RECORD_BYTES = FP8_DS_MLA_BYTES_PER_TOKEN - FP8_RECORD_BYTES
QUANT_TILE = 64
#: vLLM pads every fp8_ds_mla page (and the indexer's) to a multiple of this.
PAGE_ALIGNMENT = 576
#: The indexer's cache: INDEXER_HEAD_DIM FP8 values, then one float32 scale per
#: row, block-planar too (all values, then all scales).
INDEXER_HEAD_DIM = 128
INDEXER_SCALE_BYTES = 4
INDEXER_ROW_BYTES = INDEXER_HEAD_DIM + INDEXER_SCALE_BYTES
#: Tokens of DeepSeek-V4's sliding window (the width of its SWA rows).
SWA_WINDOW_SIZE = 128
#: Rows per block of the SWA cache.
SWA_BLOCK_SIZE = 64
#: Compress ratio of the C4A layers (and of their indexer's cache), and their
#: compressed rows per cache block.
C4A_RATIO = 4
C4A_BLOCK_SIZE = KV_BLOCK_SIZE // C4A_RATIO
#: Compress ratio of the C128A layers, and their compressed rows per cache block.
C128A_RATIO = 128
C128A_BLOCK_SIZE = KV_BLOCK_SIZE // C128A_RATIO
#: The compress ratios of vLLM 0.34's DeepSeek-V4 layer types: SWA-only, C2A
#: (V4.1), C4A, C128A (any other it refuses).
GROUP_RATIOS = (1, 2, C4A_RATIO, C128A_RATIO)
#: vLLM's ``PREFILL_CHUNK_SIZE``: requests' worth of gathered workspace per prefill chunk.
PREFILL_CHUNK_SIZE = 4
#: The indexer's top-k (``hf_config.index_topk``): V4-Flash, V4-Pro.
INDEX_TOPKS = (512, 1024)
#: Sentinel for "no slot" in slot mappings and top-k index rows.
PAD_SLOT_ID = -1
#: Upper bound of block sizes and compress ratios: keeps every slot product in int64.
MAX_BLOCK_SIZE = 1 << 30


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


#: FlashMLA sparse prefill needs the row width to be a multiple of its top-k block.
COMBINED_WIDTH_ALIGNMENT = 128
#: DSpark's non-causal SWA rows are padded to this many columns.
DSPARK_WIDTH_ALIGNMENT = 64


def combined_width(topk: int, window_size: int, max_image_tokens: int = 0) -> int:
    """``C = round_up(topk + window_size + max_image_tokens, 128)``: 640 (C4A Flash),
    8320 (C128A at 1M), 128 (SWA); images widen a row by what a token may see of them."""
    return round_up(topk + window_size + max_image_tokens, COMBINED_WIDTH_ALIGNMENT)


def get_dspark_swa_index_width(window_size: int, num_speculative_tokens: int) -> int:
    """Columns of DSpark's non-causal SWA rows (vLLM 0.34's function of the same
    name): ``round_up(window + speculative tokens, 64)``, negatives read as 0."""
    return round_up(max(window_size, 0) + max(num_speculative_tokens, 0),
                    DSPARK_WIDTH_ALIGNMENT)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def visible_rows(positions, compress_ratio: int):
    """Compressed rows a query at ``positions`` sees: ``(p + 1) // compress_ratio``,
    the division truncating toward zero as vLLM's Triton kernel does (so
    negative positions give 0 or a negative count, never -1 for p = -2).

    Works on ints and on numpy or torch integer arrays alike; the kernels and
    the numba path hold their own copies of this rule.
    """
    q = positions + 1
    return abs(q) // compress_ratio * ((q >= 0) * 2 - 1)


def compressed_row_owner(row, block_size: int, cp_world_size: int, cp_interleave: int):
    """``(block column, offset inside the block, owning rank)`` of compressed row
    ``row`` when ``cp_world_size`` ranks share the cache ``cp_interleave`` rows at
    a time (1, 1: no sharding). Works on ints and integer arrays."""
    virtual_block = block_size * cp_world_size
    column = row // virtual_block
    within = row - column * virtual_block
    rank = within // cp_interleave % cp_world_size
    offset = within // (cp_world_size * cp_interleave) * cp_interleave + within % cp_interleave
    return column, offset, rank



def c128a_capacity(max_model_len: int) -> int:
    """Columns of the persistent C128A buffers: ``round_up(cdiv(L, 128), 128)``.

    65,536 -> 512; 262,144 -> 2048; 1,048,576 -> 8192; 2,136 -> 128.
    """
    max_model_len = check_int("max_model_len", max_model_len, minimum=1)
    return round_up(cdiv(max_model_len, C128A_RATIO), C128A_TOPK_ALIGNMENT)


def c128a_active_width(max_seq_len: int, capacity: int) -> int:
    """vLLM's live width (#52823): ``clamp(next_pow2(max(max_seq_len // 128, 1)), 128, capacity)``.

    Always a multiple of 128 (a power of two >= 128, or ``capacity``). The clamp
    to ``capacity`` keeps a capture at ``max_seq_len`` slightly above
    ``max_model_len`` (bug 4: the 1M-context capture assertion) inside the buffer.
    """
    max_seq_len = check_int("max_seq_len", max_seq_len, minimum=0)
    capacity = check_int("capacity", capacity, minimum=C128A_TOPK_ALIGNMENT)
    if capacity % C128A_TOPK_ALIGNMENT:
        raise ValueError(f"capacity: expected a multiple of {C128A_TOPK_ALIGNMENT}, got "
                         f"{capacity}")
    return active_width(max_seq_len, capacity)


def active_width(max_seq_len: int, capacity: int) -> int:
    """``c128a_active_width`` of checked ints (the builders' per-step path,
    without calls: the alignment is a power of two, so the clamp from below
    holds every ``next_pow2`` of a count up to it)."""
    rows = max_seq_len // C128A_RATIO
    width = 1 << (rows - 1).bit_length() if rows > C128A_TOPK_ALIGNMENT else C128A_TOPK_ALIGNMENT
    return width if width < capacity else capacity


_CACHE_DTYPES = ("auto", "fp8_ds_mla", "fp8")


#: States per block of DeepSeek-V4's fp8_ds_mla caches: the SWA and C4A caches', C128A's.
CACHE_BLOCK_STATES = (SWA_BLOCK_SIZE, C4A_BLOCK_SIZE, C128A_BLOCK_SIZE)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                   cache_dtype: str = "auto") -> tuple[int, ...]:
    """Shape of one layer's KV cache: ``(num_blocks, block_size, 584)`` bytes for
    ``"fp8_ds_mla"`` (and its alias ``"fp8"``), else ``(num_blocks, block_size, head_size)``.

    ``block_size`` is the cache's states per block (vLLM's kernel block size):
    64 for the SWA and C4A caches, 2 for C128A's; the logical block (256) is
    refused for fp8_ds_mla. ``num_kv_heads`` is accepted for vLLM signature
    compatibility (MLA has one latent head). The per-block byte stride of a
    real cache is padded (``kv_cache.kv_cache_layout``): always read it from
    the cache's ``stride(0)``.
    """
    num_blocks = check_int("num_blocks", num_blocks, minimum=0)
    block_size = check_int("block_size", block_size, minimum=1)
    check_int("num_kv_heads", num_kv_heads, minimum=1)
    head_size = check_int("head_size", head_size, minimum=1)
    if cache_dtype not in _CACHE_DTYPES:
        raise ValueError(f"cache_dtype: expected one of {_CACHE_DTYPES}, got {cache_dtype!r}")
    if cache_dtype in ("fp8_ds_mla", "fp8"):
        if block_size not in CACHE_BLOCK_STATES:
            logical = " (the logical block: pass 256 // compress_ratio)" \
                if block_size == KV_BLOCK_SIZE else ""
            raise ValueError(f"block_size: expected the states per cache block, "
                             f"{SWA_BLOCK_SIZE} (SWA and C4A) or {C128A_BLOCK_SIZE} (C128A), "
                             f"got {block_size}{logical}")
        return (num_blocks, block_size, FP8_DS_MLA_BYTES_PER_TOKEN)
    return (num_blocks, block_size, head_size)


@dataclass(frozen=True)
class DeviceCapability:
    major: int
    minor: int

    def __str__(self) -> str:
        return f"sm_{self.major}{self.minor}"


class DeepseekV4FlashMLABackend:
    """Capability facts of vLLM's ``FLASHMLA_SPARSE_DSV4`` backend."""

    name = "FLASHMLA_SPARSE_DSV4"
    supported_dtypes = ("bfloat16",)
    supported_kv_cache_dtypes = _CACHE_DTYPES
    supported_kernel_block_sizes = (KV_BLOCK_SIZE,)
    supported_head_sizes = (HEAD_SIZE,)
    supported_compute_capability_majors = (9, 10)
    cudagraph_support = "UNIFORM_BATCH"

    @staticmethod
    def get_name() -> str:
        return DeepseekV4FlashMLABackend.name

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return list(DeepseekV4FlashMLABackend.supported_kernel_block_sizes)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(cls.supported_head_sizes)

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        """True for Hopper (9.x) and datacenter Blackwell (10.x); accepts an object
        with ``.major`` or a ``(major, minor)`` pair."""
        major = capability.major if hasattr(capability, "major") else capability[0]
        return major in cls.supported_compute_capability_majors

    get_kv_cache_shape = staticmethod(kv_cache_shape)

    @classmethod
    def current_device_capability(cls) -> DeviceCapability:
        """The compute capability of CuPy's current device; raises ``NoGPUError``."""
        device = require_gpu()
        cc = int(device.compute_capability)
        return DeviceCapability(cc // 10, cc % 10)

    @classmethod
    def check_device(cls, *, strict: bool = False) -> DeviceCapability:
        """Check the current device against the backend's compute capabilities.

        The array functions are plain CUDA and run anywhere; an unsupported
        device gets one ``UserWarning`` (or ``UnsupportedDeviceError`` with
        ``strict=True``). ``NoGPUError`` when there is no usable GPU.
        """
        cap = cls.current_device_capability()
        if not cls.supports_compute_capability(cap):
            message = (f"{cls.name} supports compute capability 9.x and 10.x; "
                       f"this device is {cap.major}.{cap.minor} ({cap})")
            if strict:
                raise UnsupportedDeviceError(message)
            _warn_once(message)
        return cap


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message + "; results are still computed by the generic CUDA kernels",
                      UserWarning, stacklevel=3)


__all__ = [
    "C128A_TOPK_ALIGNMENT", "KV_BLOCK_SIZE", "HEAD_SIZE", "NOPE_HEAD_DIM", "ROPE_HEAD_DIM",
    "FP8_DS_MLA_BYTES_PER_TOKEN", "PAD_SLOT_ID", "MAX_BLOCK_SIZE", "C4A_RATIO", "C128A_RATIO",
    "PREFILL_CHUNK_SIZE", "cdiv",
    "round_up", "next_power_of_2", "visible_rows", "compressed_row_owner", "c128a_capacity", "c128a_active_width", "kv_cache_shape",
    "DeviceCapability", "DeepseekV4FlashMLABackend", "NoGPUError",
]
