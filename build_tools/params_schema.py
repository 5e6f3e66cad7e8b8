"""THE kernel-parameter schema: one struct per kernel family.

gen_params.py turns this into the C header kernel_src/include/pfa/attention/params.h
and the ctypes mirror pyflashattn/_params_gen.py; tests/test_params_layout.py proves
the two agree field by field (sizes and offsets), so the layout can never drift.

Field types: ptr (64-bit device address, 0 = absent), i64, i32, f32.
Order fields 8-byte ones first so neither side needs padding tricks.
"""

PREFILL = (
    "PrefillParams",
    "single/ragged prefill over contiguous KV: one CTA = one packed-row tile of one kv head",
    [
        ("q", "ptr", "[qo_len, Hq, D] rows at q_stride_n, heads at q_stride_h (elements)"),
        ("k", "ptr", "key rows at k_stride_n, kv heads at k_stride_h (NHD or HND via strides)"),
        ("v", "ptr", "value rows at v_stride_n, kv heads at v_stride_h"),
        ("o", "ptr", "output, same dtype as q"),
        ("lse", "ptr", "float32 [qo_len, Hq] contiguous, 0 = not requested"),
        ("o_partial", "ptr", "split-KV workspace: float32 [num_kv_chunks, qo_len, Hq, D]"),
        ("lse_partial", "ptr", "split-KV workspace: float32 [num_kv_chunks, qo_len, Hq]"),
        ("custom_mask", "ptr", "packed bits, little-endian, bit q * kv_len + kv (1 = keep); 0 = none"),
        ("alibi_slopes", "ptr", "float32 [Hq] ALiBi slopes; 0 = no ALiBi"),
        # ---- batch mode (work_request != 0): one CTA per (kv head, work item) ----
        ("work_request", "ptr", "int32 [grid] request of each work item; -1 = padding (CUDA-graph grids)"),
        ("work_qtile", "ptr", "int32 [grid] packed-row tile of the request"),
        ("work_chunk", "ptr", "int32 [grid] KV chunk of the request"),
        ("num_chunks", "ptr", "int32 [B] KV chunks per request (> 1: partial rows + merge)"),
        ("o_indptr", "ptr", "int32 [B+1] partial-row base per request (token-major, chunk fastest)"),
        ("qo_indptr", "ptr", "int32 [B+1] query rows of each request in q/o"),
        ("kv_indptr", "ptr", "int32 [B+1] ragged: key rows; paged: pages of each request"),
        ("kv_page_indices", "ptr", "int32 page ids (paged KV)"),
        ("kv_last_page_len", "ptr", "int32 [B] tokens in each request's last page (paged KV)"),
        ("mask_indptr", "ptr", "int32 [B+1] byte offset of each request's packed custom mask"),
        ("kv_chunk_size_dev", "ptr", "int32 scalar on the device; when set (batch plans) it overrides "
         "kv_chunk_size, so a replayed CUDA graph sees each new plan's chunking"),
        ("q_stride_n", "i64", ""),
        ("q_stride_h", "i64", ""),
        ("k_stride_n", "i64", ""),
        ("k_stride_h", "i64", ""),
        ("v_stride_n", "i64", ""),
        ("v_stride_h", "i64", ""),
        ("o_stride_n", "i64", ""),
        ("o_stride_h", "i64", ""),
        ("k_stride_page", "i64", "paged KV: elements between pages of K"),
        ("v_stride_page", "i64", "paged KV: elements between pages of V"),
        ("qo_len", "i32", ""),
        ("kv_len", "i32", ""),
        ("num_qo_heads", "i32", ""),
        ("num_kv_heads", "i32", ""),
        ("group_size", "i32", "num_qo_heads / num_kv_heads; packed row r = q_idx * group_size + head_in_group"),
        ("num_kv_chunks", "i32", "single request: KV chunks per (row tile, kv head); 1 = write o/lse directly"),
        ("rows_fastest", "i32", "single request: 1 = grid (row tiles, chunks, kv heads), a head's row tiles run "
         "together so its K/V stays in L2 (non-causal: every tile costs the same); 0 = grid (kv heads, chunks, "
         "row tiles), heaviest row tiles first"),
        ("kv_chunk_size", "i32", "keys per KV chunk, a multiple of the kernel's BLOCK_N"),
        ("causal", "i32", "bottom-right aligned causal mask"),
        ("window_left", "i32", "inclusive left window, -1 = none"),
        ("sm_scale_log2", "f32", "sm_scale * log2(e): logits go straight into exp2"),
        ("logits_soft_cap", "f32", "cap > 0: logit = cap * tanh(sm_scale * q.k / cap); 0 = off"),
        ("rope", "i32", "1 = ROPE_LLAMA (rotate-half) on q and k inside the kernel"),
        ("rope_rcp_scale", "f32", "1 / rope_scale"),
        ("rope_log2_theta", "f32", "log2(rope_theta): inv_freq_j = 2^(-2j/D * log2 theta) / rope_scale"),
        ("lse_scale", "f32", "1 for base-2 LSE (FlashInfer), ln 2 for natural-log LSE"),
        ("page_size", "i32", "paged KV: tokens per page"),
        ("page_shift", "i32", "log2(page_size) when a power of two, else -1"),
        ("v_scale", "f32", "output multiplier (fp8 V dequantisation scale); 1 otherwise"),
        ("kv_fp8", "i32", "fp8 K/V storage of the kv_dtype=fp8 kernels: 1 = e4m3fn, 2 = e5m2 (0 = K/V in q's dtype); "
         "strides stay in elements"),
    ],
)

MERGE = (
    "MergeParams",
    "combine split-KV partials (float32 o, base-2 lse) into the final output",
    [
        ("o_partial", "ptr", "float32 [num_kv_chunks, rows, Hq, D]"),
        ("lse_partial", "ptr", "float32 [num_kv_chunks, rows, Hq]"),
        ("o", "ptr", "output in the kernel's dtype"),
        ("lse", "ptr", "float32 [rows, Hq] contiguous, 0 = not requested"),
        ("merge_indptr", "ptr", "int32 [rows+1]: row r merges partial rows [m[r], m[r+1]) of a batch plan "
         "(empty = written directly, skip); 0 = single request layout [num_kv_chunks, rows]"),
        ("o_stride_n", "i64", ""),
        ("o_stride_h", "i64", ""),
        ("rows", "i32", ""),
        ("num_heads", "i32", ""),
        ("head_dim", "i32", ""),
        ("num_kv_chunks", "i32", "single request: KV chunks per row (0: per-token merge_indptr)"),
        ("lse_scale", "f32", "applied to the final LSE only (partials stay base 2)"),
    ],
)

PACKBITS = (
    "PackbitsParams",
    "pack bool/uint8 values into bits (one output byte per thread), optionally per segment",
    [
        ("x", "ptr", "input: 1-byte values, nonzero = 1"),
        ("y", "ptr", "output: uint8 packed bytes"),
        ("in_indptr", "ptr", "int32 [num_segments + 1] element offsets of the segments; 0 = one segment of n"),
        ("out_indptr", "ptr", "int32 [num_segments + 1] byte offsets of the packed segments; 0 = one segment"),
        ("n", "i64", "number of input elements (single segment)"),
        ("num_segments", "i32", ""),
        ("little", "i32", "1 = bit i of a byte is element 8*byte + i (little); 0 = numpy's default big"),
    ],
)

FAMILIES = {"prefill": PREFILL, "merge": MERGE, "packbits": PACKBITS}

C_TYPES = {"ptr": "uint64_t", "i64": "int64_t", "i32": "int32_t", "f32": "float"}
SIZES = {"ptr": 8, "i64": 8, "i32": 4, "f32": 4}
