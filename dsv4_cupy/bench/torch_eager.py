"""Baselines the benchmark compares against (never used by the library itself).

* ``c128a_torch`` / ``build_torch``: the same ops written as plain torch-eager
  tensor code on the GPU (what one would write without custom kernels).
* ``c128a_numpy``: a plain NumPy vectorised version of the C128A op, the CPU
  baseline of the numba path.
"""
from __future__ import annotations

import numpy as np

from ..spec import compressed_row_owner, visible_rows


def c128a_torch(positions, ratio, num_decode_tokens, token_to_req, block_table, block_size,
                slot_mapping, width, global_decode, lens, prefill):
    import torch
    nd = num_decode_tokens
    cols = torch.arange(width, device=positions.device)
    n = visible_rows(positions.long(), ratio).clamp(max=width)
    if nd:
        block_cols = (cols // block_size).clamp(max=block_table.shape[1] - 1)
        blocks = block_table[token_to_req[:nd].long()][:, block_cols]
        slots = blocks * block_size + (cols % block_size).int()
        global_decode[:nd, :width] = torch.where(cols[None] < n[:nd, None], slots, -1)
        lens[:nd] = torch.where(slot_mapping[:nd] >= 0, n[:nd].clamp(min=0), 0).int()
    rows = positions.shape[0] - nd
    if rows:
        prefill[:rows, :width] = torch.where(cols[None] < n[nd:, None], cols[None].int(), -1)


def build_torch(qsl, seq_lens, block_table, positions, slot_mapping, num_tokens, nd, ratio,
                storage_block_size, width, req_buf, slots_buf, global_decode, lens, prefill):
    """Token map (searchsorted on the device qsl), compressed slot mapping and
    C128A rows in torch-eager ops."""
    import torch
    device = qsl.device
    t = torch.arange(num_tokens, device=device)
    req = torch.searchsorted(qsl[1:], t.int(), right=True).clamp(max=qsl.shape[0] - 2)
    req = torch.where(t < qsl[-1], req, 0)
    req_buf[:num_tokens] = req.int()
    i = torch.arange(slots_buf.shape[0], device=device)
    r = torch.searchsorted(qsl[1:], i.int(), right=True).clamp(max=qsl.shape[0] - 2)
    start = qsl[r]
    inside = (i >= start) & (i < qsl[r + 1])
    pos = seq_lens[r].long() - (qsl[r + 1] - start).long() + (i - start)
    valid = inside & (pos >= 0) & ((pos + 1) % ratio == 0)
    c = torch.where(valid, pos // ratio, 0)
    column, offset, _ = compressed_row_owner(c, storage_block_size, 1, 1)
    entry = block_table[r, column.clamp(max=block_table.shape[1] - 1)].clamp(min=0).long()
    slots_buf.copy_(torch.where(valid, entry * storage_block_size + offset, -1))
    if positions is not None and num_tokens:
        c128a_torch(positions[:num_tokens], ratio, nd, req_buf, block_table, storage_block_size,
                    slot_mapping, width, global_decode, lens, prefill)


def c128a_numpy(positions, ratio, num_decode_tokens, token_to_req, block_table, block_size,
                slot_mapping, width, global_decode, lens, prefill):
    nd = num_decode_tokens
    n = np.minimum(visible_rows(positions.astype(np.int64), ratio), width)
    cols = np.arange(width)
    if nd:
        block_cols = np.minimum(cols // block_size, block_table.shape[1] - 1)
        blocks = block_table[token_to_req[:nd]][:, block_cols]
        slots = (blocks * block_size + cols % block_size).astype(np.int32)
        global_decode[:nd, :width] = np.where(cols[None] < n[:nd, None], slots, -1)
        lens[:nd] = np.where(slot_mapping[:nd] >= 0, np.maximum(n[:nd], 0), 0)
    rows = positions.shape[0] - nd
    if rows:
        prefill[:rows, :width] = np.where(cols[None] < n[nd:, None], cols[None], -1)
