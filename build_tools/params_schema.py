"""THE kernel-parameter schema: one struct per kernel family.

gen_params.py turns this into the C header kernel_src/include/pfa/attention/params.h
and the ctypes mirror pyflashattn/_params_gen.py; tests/test_params_layout.py proves
the two agree field by field (sizes and offsets), so the layout can never drift.

Field types: ptr (64-bit device address, 0 = absent), i64, i32, f32, tmap (a 128-byte CUtensorMap,
64-byte aligned: kernel parameters are the one place a TMA descriptor can travel per launch).
Order fields largest first so neither side needs padding tricks (tmap fields lead, and the
generator pads the ctypes mirror's tail to the struct's 64-byte alignment).
"""

PREFILL = (
    "PrefillParams",
    "single/ragged prefill over contiguous KV: one CTA = one packed-row tile of one kv head",
    [
        ("k_tmap", "tmap", "TMA kernels (manifest tma): K as a 3-D tensor map (head_dim, kv heads, rows), boxes "
         "of 64 elements x 1 head x BLOCK_N rows in the 128-byte swizzle; encoded by the host per K tensor"),
        ("v_tmap", "tmap", "TMA kernels: V, as k_tmap"),
        ("q_tmap", "tmap", "the 16-bit TMA kernels with q_tma: Q as a 3-D tensor map (head_dim, q heads, tokens), "
         "boxes of 64 elements x group heads x BLOCK_M / group tokens: a row tile's packed rows in order"),
        ("q", "ptr", "[qo_len, Hq, D] rows at q_stride_n, heads at q_stride_h (elements)"),
        ("k", "ptr", "key rows at k_stride_n, kv heads at k_stride_h (NHD or HND via strides)"),
        ("v", "ptr", "value rows at v_stride_n, kv heads at v_stride_h"),
        ("o", "ptr", "output in the format o_format names (q's dtype unless the plan asked for another)"),
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
        ("sinks", "ptr", "float32 [Hq] attention sinks (natural-log units of the scaled logit): a virtual key with "
         "no value in each row's normaliser, added where the row is finished (epilogue, or the merge when "
         "split); 0 = none"),
        ("scale_dev", "ptr", "float32 scalar on the device multiplying sm_scale_log2 (a tensor bmm1_scale, read "
         "at launch so a captured graph sees new values); 0 = none"),
        ("v_scale_dev", "ptr", "float32 scalar on the device multiplying v_scale (a tensor bmm2_scale); 0 = none"),
        ("kv_seq_lens", "ptr", "paged KV by block table: int32 / uint32 [B] key count of each request (its "
         "pages: kv_page_indices[kv_indptr[b] + t / page_size]); 0 = lengths from kv_last_page_len"),
        ("k_sf", "ptr", "NVFP4 K (the kv_dtype=nvfp4 kernels, whose k holds uint8 e2m1 code pairs [.., D/2]): its "
         "float8_e4m3fn block scales [.., D/16], one per 16 head-dim elements of a row, at k_sf_stride_*; 0 otherwise"),
        ("v_sf", "ptr", "NVFP4 V: its block scales, as k_sf"),
        ("softmax_stats", "ptr", "float32 [tokens, Hq, 2] TRT-LLM FMHAv2 softmax stats (row max of the final "
         "logits in natural units, row sum of exp(logit - max), sinks included), written by the general sm80 "
         "kernels' epilogue for unsplit rows only (the host plans such calls without split KV); 0 = none"),
        ("v_page_indices", "ptr", "paged K/V with separate V page ids (TRT-LLM's [B, 2, M] block tables): int32 V page "
         "ids indexed as kv_page_indices (request b's at kv_indptr[b] + page), clamped like K's; 0 = V shares K's ids"),
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
        ("k_sf_stride_page", "i64", "NVFP4: bytes between pages of k_sf"),
        ("k_sf_stride_n", "i64", "NVFP4: bytes between rows (tokens) of k_sf"),
        ("k_sf_stride_h", "i64", "NVFP4: bytes between kv heads of k_sf"),
        ("v_sf_stride_page", "i64", "NVFP4: bytes between pages of v_sf"),
        ("v_sf_stride_n", "i64", ""),
        ("v_sf_stride_h", "i64", ""),
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
        ("kv_fp8", "i32", "fp8 K/V storage of the kv_dtype=fp8 kernels: 1 = e4m3fn, 2 = e5m2 (0 = K/V in q's dtype, "
         "or NVFP4 codes, whose elements are their bytes); strides stay in elements"),
        ("kv_max_len", "i32", "key counts read from the device are clamped to it: block table (kv_seq_lens), at "
         "most the keys its table row's planned pages hold, so no row is read past its table; ragged (> 0: "
         "kv_indptr is the caller's device array, TRT-LLM), with kv_tokens; 0 = ragged kv_indptr built by plan()"),
        ("q_tokens", "i32", "tokens in q / o: with qo_max_len, what a request's rows are clamped into; with q_tma, "
         "what Q's boxes stay within"),
        ("qo_max_len", "i32", "> 0: qo_indptr is the caller's device array (TRT-LLM): a request's first row is "
         "clamped into [0, q_tokens] and its length to qo_max_len (the plan's row tiles cover it) and the tokens "
         "left, so bad metadata never reads or writes outside q / o; 0 = qo_indptr built by plan() (trusted)"),
        ("kv_tokens", "i32", "ragged K/V: rows in K / V (with kv_max_len > 0 a request's rows are clamped into "
         "them; the TMA kernels issue a box only within them; 0 = unknown: a request's last tile is copied)"),
        ("num_pages", "i32", "paged KV: pages in the cache; a page id outside [0, num_pages) is clamped into it, "
         "so bad metadata never reads outside the cache (0 = ids trusted, plan() checked them)"),
        ("spec_mask_words", "i32", "> 0: custom_mask is a speculative-decoding mask (XQA's): per query row "
         "spec_mask_words little-endian 32-bit words, bit j = draft key j of the request's last qo_len keys; "
         "the keys before the drafts are always visible. 0 = custom_mask is packed bits q * kv_len + kv"),
        ("chunk_shift", "i32", "chunked attention (TRT-LLM): log2 of the chunk size (>= 1); with causal, row q "
         "also needs kv >= floor(pos(q) / chunk) * chunk (MaskRule::left); 0 = none (a zeroed struct)"),
        ("o_format", "i32", "the output's element format (OutFormat): 0 = the kernel's 16-bit type, 1 = the other "
         "16-bit type (fp16 <-> bf16), 2 = float8_e4m3fn (saturated to +-448, round to nearest even); "
         "strides stay in elements; 3 = NVFP4 (e2m1 code pairs, low nibble first, strides in e2m1 elements = "
         "twice the bytes, block scales at o_sf)"),
        ("skip_softmax_factor", "f32", "skip-softmax sparsity (TRT-LLM's skip_softmax_threshold_scale_factor, semantics "
         "1.12): threshold T = factor / kv_len of the request; a KV tile whose row maxes all lie below the running "
         "maxes by more than ln(1/T) (every valid row of the kernel's vote group: SkipSoftmax in softmax_state.cuh) "
         "adds nothing to the sum or output and is skipped. 0 = off (kernels without it are never given a nonzero "
         "value: the manifest's skip_softmax_rows)"),
        # Last, so the fields before keep their offsets (the kernels that never read these compile
        # to the same SASS).
        ("q_scale_heads", "ptr", "fp8 Q (the e4m3 sm90 kernels): float32 [Hq] dequantisation scale of each query "
         "head, multiplying that head's logits (FlashInfer's scale_q); 0 = none"),
        ("k_scale_heads", "ptr", "fp8 Q: float32 [Hkv] scale of each kv head's K, multiplying its logits (scale_k); "
         "0 = none"),
        ("v_scale_heads", "ptr", "fp8 Q: float32 [Hkv] scale of each kv head's V, multiplying its output rows "
         "(scale_v); 0 = none"),
        ("o_sf", "ptr", "NVFP4 output (o_format 3): its float8_e4m3fn block scales, one per 16 head-dim elements "
         "of a (token, q head), in the 128x4 swizzle (nvfp4_out.cuh) of a [rows, Hq * D / 16] tensor (a multiple "
         "of 4 columns for every head dim); 0 otherwise. With o_sf_row0 and o_sf_scale it fills the struct's "
         "last 16 bytes, so its size and every other field's offset stay as they were"),
        ("o_sf_row0", "i32", "NVFP4 output: the o_sf row of token 0 (FP4Tensor.scale_start_index)"),
        ("o_sf_scale", "f32", "NVFP4 output: the encode-side global scale: block scale = e4m3(o_sf_scale * amax / 6), "
         "value = e2m1 * scale / o_sf_scale"),
        ("grid_x", "i32", "sm90 kernels (launched one-dimensionally: launch.configure_grid): the logical grid "
         "whose blocks a CTA a block, or the persistent CTAs (sm90/cta.cuh), run in LogicalGrid's order (work.cuh); "
         "unused by the sm80 kernels (their launch grid is the logical one)"),
        ("grid_y", "i32", ""),
        ("grid_z", "i32", ""),
        ("grid_section", "i32", "sm90 kernels: kv heads (grid x) per section of the logical grid's order; a "
         "section's blocks (its heads x every chunk and row tile) all come before the next section's, so the K/V "
         "the CTAs in flight read stays within L2 (routing.l2_section; grid_x = one section, which persistent "
         "launches without sched keep)"),
        ("sched", "ptr", "persistent kernels: int32 [2] zeroed (next block, CTAs finished), the dynamic tile "
         "scheduler's counters (sm90/tile_scheduler.cuh); the launch's last CTA zeroes them again for the next. "
         "0 = none: each CTA takes a fixed share of the blocks"),
        ("grid_section_z", "i32", "sm90 kernels: the z values [0, grid_section_z) run in grid_section's "
         "sections, the rest (the lightest work items or row tiles) after them with every x together, so the "
         "CTAs finish together (routing.section_head_z; grid_z with one section)"),
        ("q_tma", "i32", "the 16-bit TMA kernels: 1 = q_tmap holds Q's map (tma.q_geometry) and q_tokens Q's rows, "
         "so a row tile whose box stays within them comes by TMA; 0 = Q by the producer's copies"),
        # The divisors a block's work decode uses, as multipliers and shifts (fastdiv.cuh: n / d =
        # (umulhi(n, mul) + n) >> shift for 0 <= n < 2^31), set by the host beside the divisors
        # (params.fast_divisor): an integer division, run in software, is ~30 dependent instructions.
        # In the struct's tail padding, so its size and every other field's offset stay.
        ("div_group_mul", "u32", "group_size's multiplier (params.fill_score_fields)"),
        ("div_section_mul", "u32", "sm90 kernels: the multiplier of a section's blocks (grid_section * grid_y * "
         "grid_section_z; launch.configure_grid)"),
        ("div_x_mul", "u32", "sm90 kernels: grid_section's multiplier"),
        ("div_last_x_mul", "u32", "sm90 kernels: the last section's x values' (grid_x - its first x; "
         "grid_section's when the sections divide grid_x)"),
        ("div_y_mul", "u32", "sm90 kernels: grid_y's multiplier"),
        ("div_group_shift", "u8", "group_size's shift"),
        ("div_section_shift", "u8", "a section's blocks' shift"),
        ("div_x_shift", "u8", "grid_section's shift"),
        ("div_last_x_shift", "u8", "the last section's shift"),
        ("div_y_shift", "u8", "grid_y's shift"),
        ("sk_tiles", "i32", "persistent sm90 16-bit kernels, a single request's equal work items (stream-K, "
         "sm90/stream_k.cuh): KV tiles of every block; the blocks from sk_first on are shared out as equal "
         "ranges of tiles, an item split between two CTAs at most; 0 = off"),
        ("sk_first", "i32", "stream-K: the first block of the shared-out region (whole rounds of the grid "
         "before it run a block a CTA)"),
        ("sk_partial", "ptr", "stream-K: float32 slots, one per CTA, each CONSUMERS x (O_ACC + 4) x 128 "
         "values in the consumers' register order: an item's later keys' unnormalised O, row maxes and "
         "sums, left by the CTA that starts with them for the CTA that ends with the item's first keys"),
        ("sk_flags", "ptr", "stream-K: int32 [CTAs, CONSUMERS] zeroed: 1 once a slot's warpgroup part is "
         "written; its reader zeroes it again for the next launch"),
    ],
)

MERGE = (
    "MergeParams",
    "combine split-KV partials (float32 o, base-2 lse) into the final output",
    [
        ("o_partial", "ptr", "float32 [num_kv_chunks, rows, Hq, D]"),
        ("lse_partial", "ptr", "float32 [num_kv_chunks, rows, Hq]"),
        ("o", "ptr", "output in the format o_format names"),
        ("lse", "ptr", "float32 [rows, Hq] contiguous, 0 = not requested"),
        ("sinks", "ptr", "float32 [Hq] attention sinks added to each merged row's normaliser (PrefillParams.sinks)"),
        ("merge_indptr", "ptr", "int32 [rows+1]: row r merges partial rows [m[r], m[r+1]) of a batch plan "
         "(empty = written directly, skip); 0 = single request layout [num_kv_chunks, rows]"),
        ("o_stride_n", "i64", ""),
        ("o_stride_h", "i64", ""),
        ("rows", "i32", ""),
        ("num_heads", "i32", ""),
        ("head_dim", "i32", ""),
        ("num_kv_chunks", "i32", "single request: KV chunks per row (0: per-token merge_indptr)"),
        ("lse_scale", "f32", "applied to the final LSE only (partials stay base 2)"),
        ("o_format", "i32", "the output's element format, as PrefillParams.o_format"),
        ("o_sf", "ptr", "NVFP4 output: its block scales (PrefillParams.o_sf)"),
        ("o_sf_row0", "i32", "NVFP4 output: as PrefillParams.o_sf_row0"),
        ("o_sf_scale", "f32", "NVFP4 output: as PrefillParams.o_sf_scale"),
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

PAGE = (
    "PageParams",
    "paged KV cache helpers (flashinfer.page), by mode: 0 = append K/V rows into their pages, "
    "1 = batch indices and positions from append_indptr and seq_lens, 2 = seq_lens of a paged batch",
    [
        ("append_k", "ptr", "mode 0: [nnz, num_heads, head_dim] rows at append_k_stride_n, heads at _h"),
        ("append_v", "ptr", "mode 0: [nnz, num_heads, head_dim] rows at append_v_stride_n, heads at _h"),
        ("k_cache", "ptr", "mode 0: K pages at k_stride_page, slots at k_stride_n, heads at k_stride_h"),
        ("v_cache", "ptr", "mode 0: V pages at v_stride_page, slots at v_stride_n, heads at v_stride_h"),
        ("batch_indices", "ptr", "int32 [nnz]: mode 0 reads it, mode 1 writes it (-1 = token of no request)"),
        ("positions", "ptr", "int32 [nnz]: mode 0 reads it, mode 1 writes it (-1 = token of no request)"),
        ("kv_indices", "ptr", "int32 [num_indices] page ids (mode 0)"),
        ("kv_indptr", "ptr", "int32 [batch_size + 1] pages of each request (modes 0, 2)"),
        ("kv_last_page_len", "ptr", "int32 [batch_size] (mode 2)"),
        ("append_indptr", "ptr", "int32 [batch_size + 1] appended tokens of each request (mode 1)"),
        ("seq_lens", "ptr", "int32 [batch_size]: mode 1 reads it, mode 2 writes it"),
        ("append_k_stride_n", "i64", "elements"),
        ("append_k_stride_h", "i64", ""),
        ("append_v_stride_n", "i64", ""),
        ("append_v_stride_h", "i64", ""),
        ("k_stride_page", "i64", ""),
        ("k_stride_n", "i64", ""),
        ("k_stride_h", "i64", ""),
        ("v_stride_page", "i64", ""),
        ("v_stride_n", "i64", ""),
        ("v_stride_h", "i64", ""),
        ("mode", "i32", "0 = append, 1 = batch indices / positions, 2 = seq_lens"),
        ("nnz", "i32", "tokens (modes 0, 1)"),
        ("batch_size", "i32", ""),
        ("num_heads", "i32", "kv heads (mode 0)"),
        ("head_dim", "i32", ""),
        ("page_size", "i32", ""),
        ("num_pages", "i32", "pages in the cache: a page id outside [0, num_pages) is never written"),
        ("num_indices", "i32", "entries of kv_indices: an index outside [0, num_indices) is never read"),
        ("elem_bytes", "i32", "bytes per element (1, 2 or 4): the copy is dtype-agnostic"),
        ("vec_bytes", "i32", "bytes per copy (16, 8, 4, 2 or 1): divides every address, stride and row"),
        ("tokens_per_block", "i32", "mode 0: tokens of one CTA (<= PageKernel::MAX_TOKENS)"),
    ],
)

FAMILIES = {"prefill": PREFILL, "merge": MERGE, "packbits": PACKBITS, "page": PAGE}

CASCADE = (
    "CascadeMergeParams",
    "cascade merge of attention states (v, lse): one warp per (row, head); merge_state(s) and the in-place form",
    [
        ("v_a", "ptr", "values of state 0 [seq, H, D]; stacked mode (v_b = 0): every state, [seq, N, H, D]"),
        ("s_a", "ptr", "float32 LSE of state 0 [seq, H]; stacked mode: [seq, N, H]"),
        ("v_b", "ptr", "values of state 1 (pair mode, num_states = 2); 0 = stacked mode"),
        ("s_b", "ptr", "float32 LSE of state 1 (pair mode)"),
        ("v_out", "ptr", "merged values [seq, H, D] (in place: = v_a)"),
        ("s_out", "ptr", "merged float32 LSE [seq, H] (in place: = s_a)"),
        ("mask", "ptr", "bool/uint8 [seq]: rows whose byte is 0 are left untouched; 0 = every row"),
        ("v_a_stride_n", "i64", "strides in elements"),
        ("v_a_stride_s", "i64", "stacked mode: between states"),
        ("v_a_stride_h", "i64", ""),
        ("v_b_stride_n", "i64", ""),
        ("v_b_stride_h", "i64", ""),
        ("v_out_stride_n", "i64", ""),
        ("v_out_stride_h", "i64", ""),
        ("s_a_stride_n", "i64", ""),
        ("s_a_stride_s", "i64", "stacked mode: between states"),
        ("s_a_stride_h", "i64", ""),
        ("s_b_stride_n", "i64", ""),
        ("s_b_stride_h", "i64", ""),
        ("s_out_stride_n", "i64", ""),
        ("s_out_stride_h", "i64", ""),
        ("mask_stride", "i64", ""),
        ("seq", "i32", ""),
        ("num_heads", "i32", ""),
        ("head_dim", "i32", ""),
        ("num_states", "i32", "N >= 0 (0: v = 0, lse = -inf)"),
        ("vec16", "i32", "1 = 16-byte value accesses (pointers 16-byte aligned, strides and head_dim multiples of "
         "16 / itemsize); 0 = one element per access"),
        ("lse_log2_scale", "f32", "LSE units -> base 2: 1 (FlashInfer's base-2 LSE) or log2(e) (natural-log LSE)"),
        ("lse_rcp_scale", "f32", "1 / lse_log2_scale: the merged LSE comes back in the inputs' units"),
    ],
)
FAMILIES["cascade"] = CASCADE

C_TYPES = {"ptr": "uint64_t", "i64": "int64_t", "i32": "int32_t", "u32": "uint32_t", "u8": "uint8_t", "f32": "float",
           "tmap": "TensorMapBytes"}
SIZES = {"ptr": 8, "i64": 8, "i32": 4, "u32": 4, "u8": 1, "f32": 4, "tmap": 128}
ALIGNS = {"ptr": 8, "i64": 8, "i32": 4, "u32": 4, "u8": 1, "f32": 4, "tmap": 64}  # a CUtensorMap is 64-byte aligned
