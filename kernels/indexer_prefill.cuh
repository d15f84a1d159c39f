// build_indexer_prefill_chunk_metadata: block b <= num_reqs sums the compressed
// rows max(L_i / ratio, 0) of the requests before it itself (no separate
// cumsum launch; O(num_reqs) reads per block, fine for a chunk's requests) and
// writes cu_compressed[b]. Block b < num_reqs then writes token_to_seq = b over
// its rows and, for its query tokens inside [query_slice_start,
// query_slice_stop), ks = cu[b] and ke = cu[b] + (prefix + 1 + j) / ratio.
// Block num_reqs writes -1 over token_to_seq past the true total and empty
// ranges (ks = ke = total) for slice tokens past the chunk's last token.
// Every index is masked to its output's length.
#pragma once
#include "common.cuh"

struct IndexerPrefillParams {    // build_indexer_prefill_chunk_metadata
    QueryLayout query;           // the chunk's query_start_loc (any first value) and seq_lens
    int* cu_compressed;          // [num_reqs + 1] int32
    int* token_to_seq;           // [num_compressed] int32, -1 past the true total
    int* seqlen_ks;              // [query_slice_stop - query_slice_start] int32
    int* seqlen_ke;              // [query_slice_stop - query_slice_start] int32
    i64 num_compressed;
    i64 ratio;
    i64 query_slice_start;
    i64 query_slice_stop;
};

namespace dsv4 {
__device__ __forceinline__ void indexer_prefill_chunk_metadata(const IndexerPrefillParams& p,
                                                               const Blocks& blocks = whole_grid()) {
    __shared__ i64 scratch[DSV4_THREADS / DSV4_WARP_LANES];
    const int* __restrict__ qsl = p.query.query_start_loc;
    const int* __restrict__ seq_lens = p.query.seq_lens;
    const i64 num_reqs = p.query.num_reqs, chunk_start = qsl[0];
    const i64 slice_start = p.query_slice_start, slice_stop = p.query_slice_stop;
    for (i64 b = blocks.index; b <= num_reqs; b += blocks.count) {
        i64 earlier = 0;
        for (i64 r = threadIdx.x; r < b; r += DSV4_THREADS) {
            const i64 rows = (i64)seq_lens[r] / p.ratio;
            earlier += rows > 0 ? rows : 0;
        }
        const i64 first_row = block_sum(earlier, scratch);
        if (threadIdx.x == 0) p.cu_compressed[b] = (int)first_row;
        if (b < num_reqs) {
            const i64 seq_len = seq_lens[b];
            const i64 rows = seq_len / p.ratio > 0 ? seq_len / p.ratio : 0;
            const i64 rows_end = min(first_row + rows, p.num_compressed);
            for (i64 x = first_row + threadIdx.x; x < rows_end; x += DSV4_THREADS)
                p.token_to_seq[x] = (int)b;
            const i64 qs = (i64)qsl[b] - chunk_start, qe = (i64)qsl[b + 1] - chunk_start;
            const i64 prefix = seq_len - (qe - qs);
            const i64 stop = min(qe, slice_stop);
            for (i64 a = (qs > slice_start ? qs : slice_start) + threadIdx.x; a < stop;
                 a += DSV4_THREADS) {
                p.seqlen_ks[a - slice_start] = (int)first_row;
                p.seqlen_ke[a - slice_start] = (int)(first_row + (prefix + 1 + a - qs) / p.ratio);
            }
        } else {
            for (i64 x = first_row + threadIdx.x; x < p.num_compressed; x += DSV4_THREADS)
                p.token_to_seq[x] = DSV4_PAD_SLOT_ID;
            const i64 total = (i64)qsl[num_reqs] - chunk_start;
            for (i64 a = (total > slice_start ? total : slice_start) + threadIdx.x; a < slice_stop;
                 a += DSV4_THREADS) {
                p.seqlen_ks[a - slice_start] = (int)first_row;
                p.seqlen_ke[a - slice_start] = (int)first_row;
            }
        }
    }
}

}  // namespace dsv4
