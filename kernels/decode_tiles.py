"""Tile-level device functions of the decode attention kernel (kernels.decode_attention):
load one BLOCK_N tile of a KV head through the block table, attend to it (online softmax,
log2 domain; an FP8 tile widened to q's dtype first), and rotate / quantize / store the
decode token's own k and v (the fused form)."""

import triton
import triton.language as tl

from tandem.kernels.dot import dot
from tandem.kernels.fp8_kv import quantize_kv_fp8
from tandem.kernels.fp8_quant import row_scale, to_codes


@triton.jit
def _load_kv_tile(k_base, v_base, block_table_row, start_n, end,
                  stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, block_size,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, ids=0, ids_first=0, IDS_REG: tl.constexpr = 0,
                  K_ROWS: tl.constexpr = False):
    """Keys and values at positions start_n .. start_n + BLOCK_N - 1 of one KV head, those
    from end on masked: (k [HEAD_DIM, BLOCK_N], v [BLOCK_N, HEAD_DIM], positions, valid);
    with K_ROWS k as [BLOCK_N, HEAD_DIM], the cache's rows as they lie (FP8_QK's operand).
    The block ids come from the block table row, or with IDS_REG from ``ids`` (the row's
    entries ids_first .. ids_first + IDS_REG - 1, loaded once by the caller): no load then
    stands between the tile's index and its K/V addresses, so the loop's loads can run ahead."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_valid = offs_n < end
    if IDS_REG > 0:
        local = tl.where(kv_valid, offs_n // block_size - ids_first, 0)
        block_ids = tl.gather(ids, local, 0).to(tl.int64)
    else:
        block_ids = tl.load(block_table_row + offs_n // block_size, mask=kv_valid, other=0).to(tl.int64)
    slots = (offs_n % block_size).to(tl.int64)
    if K_ROWS:
        k = tl.load(k_base + (block_ids * stride_k_block + slots * stride_k_slot)[:, None] + offs_d[None, :],
                    mask=kv_valid[:, None], other=0.0)
    else:
        k = tl.load(k_base + (block_ids * stride_k_block + slots * stride_k_slot)[None, :] + offs_d[:, None],
                    mask=kv_valid[None, :], other=0.0)
    v = tl.load(v_base + (block_ids * stride_v_block + slots * stride_v_slot)[:, None] + offs_d[None, :],
                mask=kv_valid[:, None], other=0.0)
    return k, v, offs_n, kv_valid


@triton.jit
def _rotated_new_kv(k_row, v_row, cos, sin, partner_d, dtype: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The decode token's rotated k [1, HEAD_DIM] (fp32 math, rounded once, as in kernels.rotary)
    and its v [HEAD_DIM]."""
    offs_d = tl.arange(0, HEAD_DIM)
    k_new = tl.load(k_row + offs_d).to(tl.float32)[None, :]
    k_partner = tl.load(k_row + partner_d).to(tl.float32)[None, :]
    return (k_new * cos + k_partner * sin).to(dtype), tl.load(v_row + offs_d)


@triton.jit
def _cache_new_kv(k_rot, v_new, k_scale, v_scale, KV_FP8: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """What the cache holds of the decode token's k and v: themselves, or with KV_FP8 their E4M3
    codes under the KV head's scales (kernels.fp8_kv)."""
    if KV_FP8:
        return quantize_kv_fp8(k_rot, k_scale, SOFT_ROUND), quantize_kv_fp8(v_new, v_scale, SOFT_ROUND)
    else:
        return k_rot, v_new


@triton.jit
def _store_new_kv(k_slot, v_slot, k_rot, v_new, HEAD_DIM: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(k_slot + offs_d[None, :], k_rot.to(k_slot.dtype.element_ty))
    tl.store(v_slot + offs_d, v_new.to(v_slot.dtype.element_ty))


@triton.jit
def _f16_query(q, qk_scale):
    """F16_DOT: q [GROUP_PAD, HEAD_DIM] times the score scale (softmax's, log2(e) and the K scale)
    as fp16, so that q . code is the score in its final units: within fp16's normal range every
    bf16 q keeps its 8 mantissa bits; below it (products too small to matter) the error of a
    score is at most 2^-25 * 448 a dimension, and a product past fp16's range (a score above
    65504, whose softmax is one-hot either way) is clamped to it."""
    q = q.to(tl.float32) * qk_scale
    q = tl.maximum(q, -65504.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN
    return tl.minimum(q, 65504.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float16)


@triton.jit
def _f16_value_scale(v_scale):
    """F16_DOT: the KV head's V scale as (u, 2^e): u = v_scale * 2^-e in [1/32, 1/16) as fp16
    (its mantissa rounded to fp16's 11 bits), which V's codes are multiplied by in the tile
    (|code| * u < 28), and 2^e, which the output is."""
    e = ((v_scale.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 122  # v_scale < 2^(e - 4)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return (v_scale * down).to(tl.float16), ((127 + e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_query(q, qk_scale, SOFT_ROUND: tl.constexpr):
    """FP8_QK: q [GROUP_PAD, HEAD_DIM] as E4M3 codes, each head a row under its own scale
    (``fp8_quant``'s row math: its largest |q| / 448, 1 for a head of zeros), and the scores' scale
    per head: that scale times ``qk_scale`` (softmax's, log2(e) and the K scale). A head holding a
    NaN gets a NaN scale, so its output is NaN (the clamp of its codes would drop it)."""
    qf = q.to(tl.float32)
    q_scale = row_scale(tl.max(tl.abs(qf), 1), 448.0)  # [GROUP_PAD]
    codes = to_codes(qf, q_scale[:, None], 448.0, SOFT_ROUND)
    q_scale = tl.where(tl.sum((qf != qf).to(tl.int32), 1) > 0, float("nan"), q_scale)
    return codes, q_scale * qk_scale


@triton.jit
def _attend_kv_tile_fp8_scores(acc, l_i, m_i, q8, score_scale, k, v, kv_valid, v_scale,
                               DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """FP8_QK: one online-softmax step whose scores come from an FP8 product with nothing
    widened: k [BLOCK_N, HEAD_DIM] E4M3 codes (the cache's rows, K_ROWS) times the query's codes
    q8 [GROUP_PAD, HEAD_DIM] (``_fp8_query``), transposed so that the keys are the product's
    rows: s^T [BLOCK_N, GROUP_PAD] (on sm90 one wgmma m64 x GROUP_PAD x 32 over E4M3 per 64 keys
    and 32 dimensions), times each head's ``score_scale``. P.V as F16_DOT's: P in fp16, V's codes
    widened to fp16 times ``v_scale`` (``_f16_value_scale``'s u; the caller scales the output)."""
    s_t = tl.dot(k, tl.trans(q8))  # [BLOCK_N, GROUP_PAD], fp32
    s_t = s_t * score_scale[None, :]
    s_t = tl.where(kv_valid[:, None], s_t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s_t, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.trans(tl.exp2(s_t - m_new[None, :]))  # [GROUP_PAD, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v.to(tl.float16) * v_scale
    acc = acc * alpha[:, None] + dot(p.to(tl.float16), v, DOT_PRECISION, DOT_UPCAST)
    return acc, l_i, m_new


@triton.jit
def _attend_tile(acc, l_i, m_i, q, k, v, kv_valid, qk_scale, score_scale, v_scale,
                 DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
                 V_DEQUANT: tl.constexpr, F16_DOT: tl.constexpr, FP8_QK: tl.constexpr):
    """One tile in the kernel's form: FP8_QK's (``_attend_kv_tile_fp8_scores``, q as E4M3 codes with
    ``score_scale``) or ``_attend_kv_tile``'s."""
    if FP8_QK:
        return _attend_kv_tile_fp8_scores(acc, l_i, m_i, q, score_scale, k, v, kv_valid, v_scale,
                                          DOT_PRECISION, DOT_UPCAST)
    else:
        return _attend_kv_tile(acc, l_i, m_i, q, k, v, kv_valid, qk_scale, DOT_PRECISION, DOT_UPCAST, KV_FP8,
                               v_scale, V_DEQUANT, F16_DOT)


@triton.jit
def _attend_kv_tile(acc, l_i, m_i, q, k, v, kv_valid, qk_scale,
                    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_FP8: tl.constexpr = False,
                    v_scale=1.0, V_DEQUANT: tl.constexpr = False, F16_DOT: tl.constexpr = False):
    """One online-softmax step (log2 domain) of q [GROUP_PAD, HEAD_DIM] over a loaded tile.
    KV_FP8: k and v are E4M3 codes, widened to q's dtype here (exact); the caller has folded the
    K scale into qk_scale and applies the V scale to the output.
    V_DEQUANT (with KV_FP8): v instead widened through fp32 times ``v_scale`` to q's dtype (the
    value a 16-bit cache would hold; the caller leaves the output unscaled). The fp32 step keeps
    Triton from moving V to P.V's operand layout as 8-bit codes, which it reads back from shared
    memory a byte at a time (ldmatrix transposes only 16-bit elements); the 16-bit tile goes
    through ldmatrix as a bf16 cache's does.
    F16_DOT (with KV_FP8): q is fp16 with the score scale in it (``_f16_query``; ``qk_scale`` is
    not used); k and v are widened to fp16, one conversion per two codes (E4M3 -> f16x2; bf16 takes
    two more a value), and v is multiplied in fp16 by ``v_scale`` (``_f16_value_scale``'s u: a
    value known only at run time, so that Triton does not move the 8-bit codes into P.V's operand
    layout); the caller scales the output by the 2^e beside u."""
    if KV_FP8 and F16_DOT:
        k = k.to(tl.float16)
        v = v.to(tl.float16) * v_scale
    elif KV_FP8:
        k = k.to(q.dtype)
        if V_DEQUANT:
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        else:
            v = v.to(q.dtype)
    s = dot(q, k, DOT_PRECISION, DOT_UPCAST)  # [GROUP_PAD, BLOCK_N]
    if not (KV_FP8 and F16_DOT):
        s = s * qk_scale
    s = tl.where(kv_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return acc, l_i, m_new
