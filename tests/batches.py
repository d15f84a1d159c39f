"""Random and hand-made DeepSeek-V4 batches for the tests (numpy, decodes first)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import reference as ref

POISON = -7


@dataclass
class Batch:
    qsl: np.ndarray            # int32 [R + 1]
    seq_lens: np.ndarray       # int32 [R]
    block_table: np.ndarray    # int32 [R, max_blocks]
    positions: np.ndarray      # int64 [T]
    slot_mapping: np.ndarray   # int64 [T], -1 = padding
    num_tokens: int            # T, padding tokens included
    max_query_len: int
    max_seq_len: int
    ratio: int
    storage_block_size: int
    threshold: int

    @property
    def num_reqs(self) -> int:
        return self.qsl.shape[0] - 1

    def split(self):
        return ref.split_decodes_and_prefills(self.qsl.tolist(), self.threshold, False,
                                              self.num_tokens, self.max_query_len)

    def token_map(self):
        return np.array(ref.token_to_req(self.qsl.tolist(), self.num_tokens), np.int32)


def make_batch(query_lens, prefixes, *, ratio=128, block_size=256, rng=None, pad_tokens=0,
               threshold=1, pad_position=0, table_cols=None, negative_tail=False):
    """A batch from per-request query lengths and cached-prefix lengths."""
    rng = rng or np.random.default_rng(0)
    query_lens = np.asarray(query_lens, np.int64)
    prefixes = np.asarray(prefixes, np.int64)
    seq = prefixes + query_lens
    qsl = np.zeros(len(query_lens) + 1, np.int32)
    qsl[1:] = np.cumsum(query_lens)
    storage = max(block_size // ratio, 1)
    # Enough columns for the compressed slot mapping (blocks of `storage`
    # compressed rows) and for C128A decode lookups of every visible row.
    need = max([int(s) // ratio // storage + 2 for s in seq] + [1])
    cols = table_cols or need
    table = rng.integers(0, 1 << 20, size=(len(query_lens), cols), dtype=np.int32)
    if negative_tail and len(query_lens):
        for r in range(len(query_lens)):
            used = int(seq[r]) // ratio // storage + 1
            table[r, used:] = -1
    positions = [np.arange(s - q, s) for q, s in zip(query_lens, seq)]
    positions.append(np.full(pad_tokens, pad_position))
    positions = np.concatenate(positions).astype(np.int64) if positions else np.zeros(0, np.int64)
    slots = rng.integers(0, 1 << 30, size=positions.shape[0]).astype(np.int64)
    if pad_tokens:
        slots[-pad_tokens:] = -1
    return Batch(qsl=qsl, seq_lens=seq.astype(np.int32), block_table=table, positions=positions,
                 slot_mapping=slots, num_tokens=int(positions.shape[0]),
                 max_query_len=int(query_lens.max()) if len(query_lens) else 0,
                 max_seq_len=int(seq.max()) if len(seq) else 0, ratio=ratio,
                 storage_block_size=storage, threshold=threshold)


def random_batch(rng, *, ratio=128, max_prefix=1 << 20, max_decodes=12, max_prefills=3,
                 max_prefill_len=96, block_size=256):
    """Decodes first (MTP query lengths 1-8), then prefills, zero-length requests
    sprinkled in, padding tokens at the end; prefixes up to ``max_prefix``."""
    spec = int(rng.integers(0, 8))                       # num_speculative_tokens 0..7
    threshold = 1 + spec
    n_dec = int(rng.integers(0, max_decodes + 1))
    n_pre = int(rng.integers(0, max_prefills + 1))
    q = [int(rng.integers(1, threshold + 1)) for _ in range(n_dec)]
    q += [int(rng.integers(threshold + 1, threshold + 1 + max_prefill_len)) for _ in range(n_pre)]
    if q and rng.random() < 0.3:                         # a zero-length request among decodes
        q.insert(int(rng.integers(0, n_dec + 1)), 0)
    q += [0] * int(rng.integers(0, 3))                   # padding requests
    small = rng.random() < 0.5
    top = 4096 if small else max_prefix
    prefixes = [int(rng.integers(0, max(1, top - x))) for x in q]
    pad = int(rng.integers(0, 4))
    return make_batch(q, prefixes, ratio=ratio, block_size=block_size, rng=rng, pad_tokens=pad,
                      threshold=threshold, pad_position=int(rng.integers(0, 200)),
                      negative_tail=rng.random() < 0.3)


def poisoned(shape, dtype=np.int32):
    return np.full(shape, POISON, dtype)
