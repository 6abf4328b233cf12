"""Paged decode attention's split phase for models without GQA (one query head per KV head).

``kernels.decode_attention`` pads the one query row of an MHA head to 16 for
``tl.dot``; here a program instead takes HEADS neighbouring heads of one
sequence, whose keys and values lie side by side in the cache's
``[block, slot, head, dim]`` layout (HEADS * head_dim contiguous elements per
token), and computes the scores and the weighted sum with fp32 multiply-adds.
Same split arithmetic, partial-result layout and merge as
``kernels.decode_attention``, which chooses between the two.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _decode_partial_mha_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    partial_out_ptr, partial_lse_ptr, out_ptr,
    stride_q_s, stride_q_h, stride_bt,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
    stride_po_s, stride_po_h, stride_po_split, stride_pl_s, stride_pl_h,
    stride_o_s, stride_o_h,
    qk_scale, window, block_size, num_splits,
    HEADS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DIRECT_OUT: tl.constexpr,
):
    """Program (head block b, sequence, split j) over the keys P_j of split j (as in
    ``_decode_partial_kernel``), for each head h of b * HEADS + [0, HEADS):
        s_p = scale * log2(e) * sum_d q[h, d] k[p, h, d],   m = max_p s_p
        partial_out[h, j] = sum_p 2^(s_p - m) v[p, h] / sum_p 2^(s_p - m)
        partial_lse[h, j] = m + log2(sum_p 2^(s_p - m))      (-inf if P_j is empty)
    """
    head0 = tl.program_id(0) * HEADS
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = 0
    share = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * share
    end = tl.minimum(start + share, seq_len)

    offs_h = tl.arange(0, HEADS)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = head0 + offs_h
    q = tl.load(q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + offs_d[None, :]).to(tl.float32)
    k_head = (heads * stride_k_head)[None, :, None] + offs_d[None, None, :]  # [1, HEADS, HEAD_DIM]
    v_head = (heads * stride_v_head)[None, :, None] + offs_d[None, None, :]
    block_table_row = block_tables_ptr + seq * stride_bt

    m_i = tl.full([HEADS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([HEADS], dtype=tl.float32)
    acc = tl.zeros([HEADS, HEAD_DIM], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_valid = offs_n < end
        block_ids = tl.load(block_table_row + offs_n // block_size, mask=kv_valid, other=0).to(tl.int64)
        slots = (offs_n % block_size).to(tl.int64)
        k_rows = (block_ids * stride_k_block + slots * stride_k_slot)[:, None, None]
        v_rows = (block_ids * stride_v_block + slots * stride_v_slot)[:, None, None]
        valid3 = kv_valid[:, None, None]
        k = tl.load(k_cache_ptr + k_rows + k_head, mask=valid3, other=0.0).to(tl.float32)  # [N, HEADS, D]
        s = tl.sum(k * q[None, :, :], axis=2) * qk_scale  # [N, HEADS]
        s = tl.where(kv_valid[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(v_cache_ptr + v_rows + v_head, mask=valid3, other=0.0).to(tl.float32)  # [N, HEADS, D]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=0)
        m_i = m_new

    no_keys = l_i == 0.0  # only for an empty share; NaN in the cache stays NaN
    out = acc / tl.where(no_keys, 1.0, l_i)[:, None]
    if DIRECT_OUT:
        tl.store(out_ptr + seq * stride_o_s + heads[:, None] * stride_o_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty))
    else:
        lse = tl.where(no_keys, float("-inf"), m_i + tl.log2(tl.where(no_keys, 1.0, l_i)))
        tl.store(partial_lse_ptr + seq * stride_pl_s + heads * stride_pl_h + split, lse)
        if end > start:  # an empty split's output is never read
            tl.store(partial_out_ptr + seq * stride_po_s + heads[:, None] * stride_po_h
                     + split * stride_po_split + offs_d[None, :], out)


def heads_per_program(num_kv_heads: int, wanted: int) -> int:
    """The largest power of two <= ``wanted`` that divides ``num_kv_heads``."""
    heads = 1
    while heads * 2 <= wanted and num_kv_heads % (heads * 2) == 0:
        heads *= 2
    return heads


def launch_split_phase_mha(q, k_cache, v_cache, block_tables, seq_lens, partial_out, partial_lse, out,
                           po_strides, pl_strides, qk_scale, sliding_window, num_splits, direct,
                           heads, block_n, num_warps, num_stages):
    num_seqs, num_heads, head_dim = q.shape
    assert num_heads % heads == 0 and heads & (heads - 1) == 0
    _decode_partial_mha_kernel[(num_heads // heads, num_seqs, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, partial_out, partial_lse, out,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *po_strides, *pl_strides, out.stride(0), out.stride(1),
        qk_scale, sliding_window or 0, k_cache.shape[1], num_splits,
        HEADS=heads, BLOCK_N=block_n, HEAD_DIM=head_dim, HAS_WINDOW=sliding_window is not None,
        DIRECT_OUT=direct, num_warps=num_warps, num_stages=num_stages,
    )
