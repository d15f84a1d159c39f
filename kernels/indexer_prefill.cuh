// build_indexer_prefill_chunk_metadata: block b <= num_reqs sums the compressed
// rows max(L_i / ratio, 0) of the requests before it itself (no separate
// cumsum launch; O(num_reqs) reads per block, fine for a chunk's requests) and
// writes cu_compressed[b]. Block b < num_reqs then writes token_to_seq = b over
// its rows and, for its query tokens inside [query_slice_start,
// query_slice_stop), ks = cu[b] and ke = cu[b] + (prefix + 1 + j) / ratio
// (positions[a] + 1 for the context when positions are given: ShardQ). Under
// decode context parallelism ks and ke are rank-local: the block also sums the
// rows this rank holds of the requests before it (local_cu) and localises the
// key count; token_to_seq keeps the global layout. Block num_reqs writes -1
// over token_to_seq past the true total and empty ranges (ks = ke = total) for
// slice tokens past the chunk's last token. Every index is masked to its
// output's length.
#pragma once
#include "common.cuh"

struct IndexerPrefillParams {    // build_indexer_prefill_chunk_metadata
    QueryLayout query;           // the chunk's query_start_loc (any first value) and seq_lens
    int* cu_compressed;          // [num_reqs + 1] int32
    int* token_to_seq;           // [num_compressed] int32, -1 past the true total
    int* seqlen_ks;              // [query_slice_stop - query_slice_start] int32
    int* seqlen_ke;              // [query_slice_stop - query_slice_start] int32
    int* local_cu;               // [num_reqs + 1] int32, this rank's rows before each request
                                 // (written when dcp_world_size > 1)
    const void* positions;       // [chunk tokens] int32 or int64 (positions_int64), or null
    i64 positions_int64;
    i64 num_compressed;
    i64 ratio;
    i64 query_slice_start;
    i64 query_slice_stop;
    i64 dcp_world_size;
    i64 dcp_rank;
    i64 cp_interleave;           // compressed rows per rank at a time
};

namespace dsv4 {
__device__ __forceinline__ void indexer_prefill_chunk_metadata(const IndexerPrefillParams& p,
                                                               const Blocks& blocks = whole_grid()) {
    __shared__ i64 scratch[DSV4_THREADS / DSV4_WARP_LANES];
    const int* __restrict__ qsl = p.query.query_start_loc;
    const int* __restrict__ seq_lens = p.query.seq_lens;
    const i64 num_reqs = p.query.num_reqs, chunk_start = qsl[0];
    const i64 slice_start = p.query_slice_start, slice_stop = p.query_slice_stop;
    const bool sharded = p.dcp_world_size > 1;
    const auto local = [&](i64 rows) {
        return dcp_local_rows(rows, p.dcp_world_size, p.dcp_rank, p.cp_interleave);
    };
    for (i64 b = blocks.index; b <= num_reqs; b += blocks.count) {
        i64 earlier = 0, earlier_local = 0;
        for (i64 r = threadIdx.x; r < b; r += DSV4_THREADS) {
            i64 rows = (i64)seq_lens[r] / p.ratio;
            rows = rows > 0 ? rows : 0;
            earlier += rows;
            earlier_local += local(rows);
        }
        const i64 first_row = block_sum(earlier, scratch);
        const i64 first_key = sharded ? block_sum(earlier_local, scratch) : first_row;
        if (threadIdx.x == 0) p.cu_compressed[b] = (int)first_row;
        if (threadIdx.x == 0 && sharded) p.local_cu[b] = (int)first_key;
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
                i64 context = prefix + 1 + a - qs;
                if (p.positions != nullptr)
                    context = 1 + (p.positions_int64
                                   ? static_cast<const long long*>(p.positions)[a]
                                   : (i64) static_cast<const int*>(p.positions)[a]);
                const i64 keys = context / p.ratio;
                p.seqlen_ks[a - slice_start] = (int)first_key;
                p.seqlen_ke[a - slice_start] = (int)(first_key + (sharded ? local(keys) : keys));
            }
        } else {
            for (i64 x = first_row + threadIdx.x; x < p.num_compressed; x += DSV4_THREADS)
                p.token_to_seq[x] = DSV4_PAD_SLOT_ID;
            const i64 total = (i64)qsl[num_reqs] - chunk_start;
            for (i64 a = (total > slice_start ? total : slice_start) + threadIdx.x; a < slice_stop;
                 a += DSV4_THREADS) {
                p.seqlen_ks[a - slice_start] = (int)first_key;
                p.seqlen_ke[a - slice_start] = (int)first_key;
            }
        }
    }
}

}  // namespace dsv4
