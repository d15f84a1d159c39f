"""One DeepSeek-V4 step on the CPU (numpy arrays, numba path), op by op and then
through DeepseekV4MetadataBuilder, with a check that both give the same result.

The step: three decode requests with one MTP draft token (query length 2) and
long contexts, then one 300-token prefill behind a 4K-token prefix, for the
C128A group (compress ratio 128). The other examples reuse make_step,
move_step, make_builder and assert_same_metadata from here.

Run:  python examples/numpy_pipeline.py
"""
import dataclasses

import numpy as np

import dsv4_cupy as d4

MAX_MODEL_LEN = 1 << 17          # 128K tokens: C128A rows hold up to 1024 entries
MAX_TOKENS = 512                 # max_num_batched_tokens: rows of the persistent buffers
RATIO = 128                      # the C128A KV-cache group
STORAGE_BLOCK = 256 // RATIO     # compressed rows per 256-token KV block
SPEC_TOKENS = 1                  # MTP: decodes have query length 1 + 1
QUERY_LENS = [2, 2, 2, 300]      # decodes first, then the prefill (vLLM's order)


def make_step(seed=0):
    """A numpy CommonAttentionMetadata; every seed gives the same shapes."""
    rng = np.random.default_rng(seed)
    prefixes = [int(p) for p in rng.integers(1_000, MAX_MODEL_LEN - 2, size=3)] + [4096]
    seq_lens = np.array(prefixes) + QUERY_LENS            # include this step's queries
    qsl = np.zeros(len(QUERY_LENS) + 1, np.int32)
    qsl[1:] = np.cumsum(QUERY_LENS)
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(QUERY_LENS, seq_lens)])
    block_table = rng.integers(0, 50_000, size=(len(QUERY_LENS), MAX_MODEL_LEN // 256),
                               dtype=np.int32)
    # The uncompressed slot of every token: its block's id * 256 + offset in the block.
    request = np.repeat(np.arange(len(QUERY_LENS)), QUERY_LENS)
    slot_mapping = block_table[request, positions // 256].astype(np.int64) * 256 + positions % 256
    return d4.CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.copy(), seq_lens=seq_lens.astype(np.int32),
        block_table_tensor=block_table, slot_mapping=slot_mapping, positions=positions,
        num_reqs=len(QUERY_LENS), num_actual_tokens=len(positions),
        max_query_len=max(QUERY_LENS), max_seq_len=int(seq_lens.max()))


# The step's device arrays (query_start_loc_cpu always stays on the host).
DEVICE_FIELDS = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "positions")


def move_step(step, move):
    """The step with its device arrays converted by ``move`` (e.g. ``cupy.asarray``)."""
    return dataclasses.replace(step, **{name: move(getattr(step, name)) for name in DEVICE_FIELDS})


def make_builder(like):
    return d4.DeepseekV4MetadataBuilder(RATIO, MAX_MODEL_LEN, MAX_TOKENS,
                                        num_speculative_tokens=SPEC_TOKENS, like=like)


# The array fields of a C128A DeepseekV4Metadata.
FIELDS = ("req_id_per_token", "slot_mapping", "c128a_global_decode_topk_indices",
          "c128a_decode_topk_lens", "c128a_prefill_topk_indices")


def assert_same_metadata(got, want, to_numpy=np.asarray):
    """Array fields of ``got`` (any kind, converted with ``to_numpy``) equal ``want``'s."""
    for name in FIELDS:
        np.testing.assert_array_equal(to_numpy(getattr(got, name)), getattr(want, name),
                                      err_msg=name)


def main():
    step = make_step()
    T = step.num_actual_tokens
    print(f"step: {step.num_reqs} requests, {T} tokens, seq_lens {step.seq_lens.tolist()}")

    # 1. The request of every token.
    req = d4.token_to_req_indices(step.query_start_loc, T)
    # 2. Decodes (query length <= 1 + SPEC_TOKENS) and prefills, from the host copy.
    split = d4.split_decodes_and_prefills(step, decode_threshold=1 + SPEC_TOKENS)
    num_decodes, num_prefills, nd, num_prefill_tokens = split
    print(f"split: {num_decodes} decodes ({nd} tokens), {num_prefills} prefill "
          f"({num_prefill_tokens} tokens)")
    # 3. Compressed slot mapping into a persistent buffer longer than the step:
    #    the whole buffer is reset to -1, so stale slots past T never survive.
    slot_buffer = np.zeros(MAX_TOKENS, np.int64)
    slots = d4.get_compressed_slot_mapping(T, step.slot_mapping, step.query_start_loc,
                                           step.seq_lens, step.block_table_tensor, STORAGE_BLOCK,
                                           RATIO, out=slot_buffer)
    assert (slot_buffer[T:] == -1).all()
    print(f"compressed slots: {int((slots >= 0).sum())} of {T} tokens close a 128-token group; "
          f"buffer[{T}:{MAX_TOKENS}] is all -1")
    # 4. C128A top-k rows, written into persistent buffers of the full capacity.
    capacity = d4.c128a_capacity(MAX_MODEL_LEN)
    gd_buffer = np.empty((MAX_TOKENS, capacity), np.int32)
    lens_buffer = np.empty(MAX_TOKENS, np.int32)
    pf_buffer = np.empty((MAX_TOKENS, capacity), np.int32)
    gd, lens, pf = d4.build_c128a_topk_metadata(
        step.positions, RATIO, nd, req, step.block_table_tensor, STORAGE_BLOCK,
        step.slot_mapping, gd_buffer, lens_buffer, pf_buffer, max_compressed_tokens=capacity)
    print(f"c128a: decode rows {gd.shape}, lengths {lens.tolist()}; prefill rows {pf.shape}")
    # A decode token at position p sees (p + 1) // 128 compressed rows.
    np.testing.assert_array_equal(lens, (step.positions[:nd] + 1) // RATIO)

    # The builder does all four in one call, into its own persistent buffers.
    md = make_builder("numpy").build(0, step)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens,
            md.num_prefill_tokens) == split
    # Its decode rows have a head axis of 1: [nd, 1, capacity].
    for name, want in zip(FIELDS, (req, slots, gd[:, None, :], lens, pf)):
        np.testing.assert_array_equal(getattr(md, name), want, err_msg=name)
    print("builder (like='numpy') matches the direct calls")


if __name__ == "__main__":
    main()
