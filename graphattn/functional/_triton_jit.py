"""The Triton kernels of edge attention (see :mod:`graphattn.functional.triton_kernels`).

Imported only through :func:`graphattn.functional.triton_kernels.kernels`, which loads this file
once per Triton mode: ``triton.jit`` decides at definition time whether a kernel is compiled or
interpreted (``TRITON_INTERPRET=1``), and the interpreter resolves helpers through module
globals, so each mode needs its own copy of the module.

Layout: in the one-node kernels (``forward_kernel``, ``backward_target_kernel``,
``backward_source_kernel``) a program owns one node (grid axis 0) and ``BLOCK_H`` heads (grid axis
1); tiles are ``(BE, BH, BC)`` = (edges, heads, channels of v, ``C``) and ``(BE, BH, BCK)``
(channels of q, k and att, ``CK``; 1 for the additive score, whose q and k are ``[N, H]``),
statistics ``(BH)``, all in fp32; with ``SUM_STEPS > 0`` (the launch of the rows of many blocks,
``triton_kernels.SUM_STEPS``) their sums over a row's edges run in fp32 over ``SUM_STEPS`` tiles at
a time, and those block sums add in float64. In the row-block kernels (``*_rows_kernel``) a program
owns ``BLOCK_N`` nodes and takes one edge of each per step: the tiles are ``(BN, BH, BC)`` and
``(BN, BH, BCK)``, statistics ``(BN, BH)``, and nothing is summed across the lanes. The helpers take
tiles of either kind, ``(BL, ...)``, BL lanes of edges. The score is the compile-time ``SCORE``, a
value of ``SCORE_KINDS``: branches test ``ADDITIVE`` and ``GATV2``, and dot is the remaining case.
The per-edge terms ``edge_key`` ``[E, H, CK]`` and ``edge_value`` ``[E, H, C]`` (flags ``HAS_EK``,
``HAS_EV``) are read at the edge ids, in the same tiles as the keys and values of the sources they
are added to.
"""

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from graphattn.functional.triton_kernels import SCORE_KINDS, interpret_mode

ADDITIVE = tl.constexpr(SCORE_KINDS["additive"])
GATV2 = tl.constexpr(SCORE_KINDS["gatv2"])



def _for_this_mode(fn):
    """A function of Triton's standard library, usable by kernels of this module's mode.

    ``triton.language`` defines ``tl.sum``, ``tl.max``... with ``triton.jit`` when it is first
    imported (torch_geometric imports it), in the mode of that moment. An interpreted kernel
    cannot call a compiled-mode function, so in interpreter mode the function is wrapped again.
    """
    if isinstance(fn, JITFunction) and interpret_mode():
        return triton.jit(fn.fn)
    return fn


_sum = _for_this_mode(tl.sum)
_max = _for_this_mode(tl.max)


@triton.jit
def _edge_values(ptr, edge_id, offs_h, ok2, H: tl.constexpr):
    """Load an ``[E, H]`` tensor at ``(edge_id, offs_h)`` as fp32 ``(BE, BH)``."""
    return tl.load(ptr + edge_id[:, None] * H + offs_h[None, :], mask=ok2,
                   other=0.0).to(tl.float32)


# SplitMix64 (see graphattn.functional.dropout): the state's increment and the two multipliers of
# its output mix, as in graphattn.functional.cpu
_GAMMA = tl.constexpr(0x9E3779B97F4A7C15)
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX2 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _dropout_multipliers(drop, entry, ok):
    """The dropout multipliers of the flat mask entries ``entry`` (int64, any shape: entry
    ``e H + h`` is edge e, head h) as fp32 of the same shape, 0 where not ``ok``. ``drop`` is
    a mask ``[E, H]`` to read, or, as int64, the parameters ``[3]`` of a seeded mask (seed,
    threshold, fp32 bits of the kept entries' multiplier;
    :func:`graphattn.functional.dropout.seeded_mask_parameters`): each entry is then drawn here
    as the CPU mask draws it, from output ``entry + 1`` of SplitMix64 seeded with the seed,
    and kept when its 32 high bits reach the threshold; nothing of size ``[E, H]`` is read."""
    if drop.dtype.element_ty == tl.int64:
        seed = tl.load(drop).to(tl.uint64)
        threshold = tl.load(drop + 1).to(tl.uint64)
        kept = tl.load(drop + 2).to(tl.int32).to(tl.float32, bitcast=True)
        z = seed + (entry + 1).to(tl.uint64) * _GAMMA
        z = (z ^ (z >> 30)) * _MIX1
        z = (z ^ (z >> 27)) * _MIX2
        z = z ^ (z >> 31)
        return tl.where(ok & ((z >> 32) >= threshold), kept, 0.0)
    return tl.load(drop + entry, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def seeded_mask_kernel(drop, out, n, BLOCK: tl.constexpr):
    """Grid (cdiv(n, BLOCK)): write the ``n`` entries of the seeded mask ``drop`` (its
    parameters ``[3]``) to ``out`` in ``out``'s dtype, the multipliers the other kernels draw
    in registers."""
    entry = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = entry < n
    tl.store(out + entry, _dropout_multipliers(drop, entry, ok).to(out.dtype.element_ty),
             mask=ok)


@triton.jit
def _rows(ptr, rows, hc, ok3, H: tl.constexpr, C: tl.constexpr):
    """Load an ``[N, H, C]`` tensor at node ids ``rows`` (or an ``[E, H, C]`` one at edge ids)
    as fp32 ``(BE, BH, BC)``."""
    return tl.load(ptr + rows[:, None, None] * (H * C) + hc[None, :, :], mask=ok3,
                   other=0.0).to(tl.float32)


@triton.jit
def _with_edge_term(x, term, edge_id, hc, ok3, H: tl.constexpr, C: tl.constexpr,
                    HAS_TERM: tl.constexpr):
    """``x`` plus the ``[E, H, C]`` per-edge ``term`` at ``edge_id`` when ``HAS_TERM``
    (k_j + ek_e, v_j + ev_e), then ``(BE, BH, BC)``; ``x`` itself otherwise."""
    if HAS_TERM:
        return x + _rows(term, edge_id, hc, ok3, H, C)
    else:
        return x


@triton.jit
def _attention_vector(att, hc, hc_ok, SCORE: tl.constexpr):
    """The ``[H, C]`` att of gatv2 at ``hc`` as fp32 ``(BH, BC)``; 1.0 for the other scores."""
    if SCORE == GATV2:
        return tl.load(att + hc, mask=hc_ok, other=0.0).to(tl.float32)
    else:
        return 1.0


@triton.jit
def _score_operand(ptr, node, offs_h, hc, ok2, ok3, H: tl.constexpr, C: tl.constexpr,
                   SCORE: tl.constexpr):
    """q or k at rows ``node``: ``(BE, BH)`` when additive, ``(BE, BH, BC)`` otherwise."""
    if SCORE == ADDITIVE:
        return tl.load(ptr + node[:, None] * H + offs_h[None, :], mask=ok2,
                       other=0.0).to(tl.float32)
    else:
        return _rows(ptr, node, hc, ok3, H, C)


@triton.jit
def _leaky_relu(z, slope):
    """LeakyReLU with negative slope ``slope``."""
    return tl.where(z > 0, z, z * slope)


@triton.jit
def _leaky_relu_grad(z, slope):
    """Derivative of LeakyReLU, with the slope at 0 like torch."""
    return tl.where(z > 0, 1.0, slope)


@triton.jit
def _tanh(x):
    """tanh in fp32 (Triton has no tanh of its own that its interpreter runs too), in Cephes'
    arithmetic, as the ``cpu`` kernels compute it: for ``|x| >= 0.625``
    ``sign(x) (1 - e) / (1 + e)``, ``e = exp(-2 |x|)`` (no overflow); below, where 1 - e
    cancels (all of tanh lost for ``|x| < 3e-8``: a soft cap far above the scores then flattened
    them to 0), ``x + x^3 P(x^2)``, P of degree 4."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    z = x * x
    small = (((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
               + 1.33314422036e-1) * z - 3.33332819422e-1) * z * x + x)
    return tl.where(a < 0.625, small, tl.where(x < 0, -t, t))


@triton.jit
def _dot_or_gatv2(q, k, att, scale, slope, SCORE: tl.constexpr):
    """The dot or gatv2 score ``(BE, BH)`` before its bias (and cap)."""
    if SCORE == GATV2:
        return _sum(att[None, :, :] * _leaky_relu(q + k, slope), axis=2) * scale
    else:
        return _sum(q * k, axis=2) * scale


@triton.jit
def _scores(q, k, b, att, scale, slope, cap, SCORE: tl.constexpr, HAS_CAP: tl.constexpr):
    """Scores ``(BE, BH)`` from broadcastable q, k operands, bias b and att ``(BH, BC)``; with
    ``HAS_CAP`` (dot and gatv2) the score before its bias soft-capped,
    ``cap * tanh(s / cap)``."""
    if SCORE == ADDITIVE:
        return _leaky_relu(q + k + b, slope) * scale
    else:
        s = _dot_or_gatv2(q, k, att, scale, slope, SCORE)
        if HAS_CAP:
            s = cap * _tanh(s / cap)
        return s + b


@triton.jit
def _pre_activation_grad(ds, q, k, b, att, scale, slope, cap, SCORE: tl.constexpr,
                         HAS_CAP: tl.constexpr):
    """Gradient with respect to the score's pre-activation (the bias term, but for a cap):
    ``ds`` for dot and gatv2, times the derivative of the cap ``1 - tanh^2`` (recomputed from
    q and k) with ``HAS_CAP``; through LeakyReLU for additive."""
    if SCORE == ADDITIVE:
        return ds * scale * _leaky_relu_grad(q + k + b, slope)
    elif HAS_CAP:
        t = _tanh(_dot_or_gatv2(q, k, att, scale, slope, SCORE) / cap)
        return ds * (1.0 - t * t)
    else:
        return ds


@triton.jit
def _operand_terms(dz, q, k, other, slope, SCORE: tl.constexpr):
    """Each edge's gradient term of a node's score operand, ``(BL, BH)`` when additive,
    ``(BL, BH, BCK)`` otherwise: q in the target pass, k in the source pass, ``other`` the
    opposite one. ``dz`` is the bias-term gradient (:func:`_pre_activation_grad`). Dot and gatv2
    leave out the factor ``scale * att`` (att is 1 for dot), the same for every edge, which the
    kernel applies once to the sum."""
    if SCORE == ADDITIVE:
        return dz
    elif SCORE == GATV2:
        return dz[:, :, None] * _leaky_relu_grad(q + k, slope)
    else:
        return dz[:, :, None] * other


@triton.jit
def _edge_key_grad(dz, q, k, att, scale, slope, SCORE: tl.constexpr):
    """Gradient of each edge's key term ek_e, ``(BE, BH, BCK)``, from the bias-term gradient
    ``dz`` ``(BE, BH)``: ``dz * scale * q_i`` for dot and ``dz * scale * att *
    LeakyReLU'(q_i + k_j + ek_e)`` for gatv2, with ``k`` the key of the edge. (ek_e enters the
    score as k_j does: this is the term of dk_j of that edge.)"""
    if SCORE == GATV2:
        return dz[:, :, None] * _leaky_relu_grad(q + k, slope) * (att * scale)[None, :, :]
    else:
        return dz[:, :, None] * q * scale


@triton.jit
def _softmax_stats(lse, at, ok):
    """The softmax statistics of ``lse`` ``[N_dst, H, 2]`` at the (target, head) pairs ``at``
    (``target * H + head``, any shape): the row maximum m and log l, side by side in memory.
    Masked pairs read m = +inf, log l = 0, so that their weights are 0."""
    m = tl.load(lse + at * 2, mask=ok, other=float("inf"))
    log_l = tl.load(lse + at * 2 + 1, mask=ok, other=0.0)
    return m, log_l


@triton.jit
def _softmax_weights(s, m, log_l):
    """alpha = exp((s - m) - log l), s - m first: m + log l would round to m when
    |m| >> log l (a bias of -1e9 on every edge of a row) and lose the 1 / l."""
    return tl.exp((s - m) - log_l)


@triton.jit
def _head_channels(offs_h, h_ok, C: tl.constexpr, CK: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_CK: tl.constexpr):
    """Offsets in a node's row of the heads ``offs_h`` ``(BH)`` (``h_ok``: those read and
    written): ``(BH, BC)`` over the channels of v and ``(BH, BCK)`` over those of q, k and
    att, each with its mask."""
    offs_c = tl.arange(0, BLOCK_C)  # (BC)
    hc = offs_h[:, None] * C + offs_c[None, :]  # (BH, BC)
    hc_ok = h_ok[:, None] & (offs_c < C)[None, :]
    offs_ck = tl.arange(0, BLOCK_CK)  # (BCK)
    hck = offs_h[:, None] * CK + offs_ck[None, :]  # (BH, BCK): q, k and att
    hck_ok = h_ok[:, None] & (offs_ck < CK)[None, :]
    return hc, hc_ok, hck, hck_ok


@triton.jit
def _one_row(order, rowptr, max_degree, offs_h, H: tl.constexpr, HEAVY_ONLY: tl.constexpr,
             LIGHT_ONLY: tl.constexpr):
    """The row of a program of the one-row kernels, the positions ``[start, end)`` of its
    edges and the heads ``(BH)`` it reads and writes. The row is ``program_id(0)``; with
    ``HEAVY_ONLY``, the ``program_id(0)``-th row of the degree ``order``, handled only when
    its degree exceeds ``max_degree`` (the rows the row-block kernels, or the launch with
    ``LIGHT_ONLY``, leave out), else given no edge and no head: nothing is read or written.
    With ``LIGHT_ONLY``, row ``program_id(0)`` only when its degree is at most
    ``max_degree``."""
    pid = tl.program_id(0).to(tl.int64)
    if HEAVY_ONLY:
        row = tl.load(order + pid).to(tl.int64)
    else:
        row = pid
    # in the CSR's dtype: int32 positions stay triton_kernels.CSR_POSITION_MARGIN below 2^31 - 1,
    # so that e0 + arange(BLOCK_E) past the row's end cannot wrap (int64 bounds would cost up
    # to 16 registers a thread, and a spill, in the committed resource tables)
    start = tl.load(rowptr + row)
    end = tl.load(rowptr + row + 1)
    h_ok = offs_h < H
    if HEAVY_ONLY:
        heavy = end - start > max_degree
        end = tl.where(heavy, end, start)
        h_ok = tl.where(heavy, h_ok, False)
    if LIGHT_ONLY:
        light = end - start <= max_degree
        end = tl.where(light, end, start)
        h_ok = tl.where(light, h_ok, False)
    return row, start, end, h_ok


@triton.jit
def _row_block(order, rowptr, num_rows, max_degree, BLOCK_N: tl.constexpr):
    """The rows ``(BN)`` of a program of the row-block kernels: ``BLOCK_N`` consecutive
    positions of the degree ``order`` (rows sorted by decreasing degree, so the rows of a
    program have about the same number of edges). Returns them (int64), the position of their
    first edge, their degree, and ``mine``: the lanes that hold a row of degree at most
    ``max_degree``, which this kernel owns (the degree is 0 on the other lanes)."""
    lane = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN)
    lane_ok = lane < num_rows
    row = tl.load(order + lane, mask=lane_ok, other=0).to(tl.int64)
    start = tl.load(rowptr + row, mask=lane_ok, other=0)
    degree = tl.load(rowptr + row + 1, mask=lane_ok, other=0) - start
    mine = lane_ok & (degree <= max_degree)
    return row, start, tl.where(mine, degree, 0), mine


@triton.jit
def _forward_tile(q_i, k, v, bias, att_h, drop, edge_key, edge_value, col, eid, scores, pos,
                  e_ok, offs_h, hc, hck, h_ok, hc_ok, hck_ok, scale, slope, cap,
                  H: tl.constexpr, C: tl.constexpr, CK: tl.constexpr, SCORE: tl.constexpr,
                  HAS_CAP: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_DROP: tl.constexpr, HAS_EK: tl.constexpr,
                  HAS_EV: tl.constexpr, NEED_SCORES: tl.constexpr):
    """A tile of edges into their targets, at CSR positions ``pos`` ``(BL)`` (``e_ok``: the
    real ones), with the target's q ``q_i`` (one row broadcast, or one per lane): the scores
    ``(BL, BH)`` (-inf where masked; written at the edge ids when ``NEED_SCORES``), the dropout
    multipliers ``(BL, BH)`` (1.0 without dropout) and the values ``(BL, BH, BC)`` of the
    edges."""
    ok2 = e_ok[:, None] & h_ok[None, :]  # (BL, BH)
    ok3 = e_ok[:, None, None] & hc_ok[None, :, :]  # (BL, BH, BC)
    ok3k = e_ok[:, None, None] & hck_ok[None, :, :]  # (BL, BH, BCK)
    src = tl.load(col + pos, mask=e_ok, other=0).to(tl.int64)
    if HAS_BIAS or HAS_DROP or HAS_EK or HAS_EV or NEED_SCORES:
        edge = tl.load(eid + pos, mask=e_ok, other=0).to(tl.int64)
    else:  # nothing reads the edge ids: no load of them
        edge = src
    b = 0.0
    if HAS_BIAS:
        b = _edge_values(bias, edge, offs_h, ok2, H)
    k_e = _with_edge_term(_score_operand(k, src, offs_h, hck, ok2, ok3k, H, CK, SCORE),
                          edge_key, edge, hck, ok3k, H, CK, HAS_EK)  # key of the edge
    s = tl.where(ok2, _scores(q_i, k_e, b, att_h, scale, slope, cap, SCORE, HAS_CAP), float("-inf"))
    if NEED_SCORES:
        tl.store(scores + edge[:, None] * H + offs_h[None, :], s, mask=ok2)
    d = 1.0
    if HAS_DROP:
        d = _dropout_multipliers(drop, edge[:, None] * H + offs_h[None, :], ok2)
    v_e = _with_edge_term(_rows(v, src, hc, ok3, H, C), edge_value, edge, hc, ok3, H, C,
                          HAS_EV)  # (BL, BH, BC): value of the edge
    return s, d, v_e


@triton.jit
def _weights_and_stats(l_sum, m):
    """From the running sum ``l_sum`` and maximum ``m`` of a row's online softmax (any shape):
    the divisor of its accumulator (1 where the row has no weight) and the statistics written
    to ``lse``, m and log l. l = 0 (no weight): m = +inf, log l = 0. l NaN (a NaN or +inf
    score): m NaN, every weight NaN as in torch.softmax, whatever the maximum kept of a NaN."""
    has_weight = l_sum > 0.0
    l_safe = tl.where(has_weight, l_sum, 1.0)
    m_out = tl.where(has_weight, m, tl.where(l_sum == 0.0, float("inf"), l_sum))
    return l_safe, m_out, tl.where(has_weight, tl.log(l_safe), 0.0)


@triton.jit
def _softmax_start(sinks, offs_h, h_ok, HAS_SINKS: tl.constexpr):
    """A row's online softmax before its first edge ``(BH)``: the running maximum and sum,
    -inf and 0, or with ``HAS_SINKS`` the sink's score ``sinks[h]`` and its term e^0 = 1 (0
    for a sink of -inf, which then weighs nothing, as no sink)."""
    if HAS_SINKS:
        m = tl.load(sinks + offs_h, mask=h_ok, other=float("-inf")).to(tl.float32)
        l_sum = tl.where(m == float("-inf"), 0.0, 1.0)
    else:
        m = tl.where(h_ok, float("-inf"), float("-inf"))
        l_sum = tl.where(h_ok, 0.0, 0.0)
    return m, l_sum


@triton.jit
def _forward_steps(lo, hi, m, l_sum, acc, q_i, k, v, bias, att_h, drop, edge_key, edge_value,
                   col, eid, scores, offs_h, hc, hck, h_ok, hc_ok, hck_ok, scale, slope, cap,
                   H: tl.constexpr, C: tl.constexpr, CK: tl.constexpr, SCORE: tl.constexpr,
                   HAS_CAP: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_DROP: tl.constexpr, HAS_EK: tl.constexpr,
                   HAS_EV: tl.constexpr, NEED_SCORES: tl.constexpr, BLOCK_E: tl.constexpr):
    """The online softmax of the forward over the CSR positions ``[lo, hi)``, ``BLOCK_E`` at a
    time, from the running maximum ``m``, sum ``l_sum`` ``(BH)`` and accumulator ``acc``
    ``(BH, BC)`` (fp32, taken at m); returns them updated."""
    for e0 in range(lo, hi, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)  # (BE)
        s, d, v_e = _forward_tile(q_i, k, v, bias, att_h, drop, edge_key, edge_value, col,
                                  eid, scores, offs_e, offs_e < hi, offs_h, hc, hck, h_ok,
                                  hc_ok, hck_ok, scale, slope, cap, H, C, CK, SCORE, HAS_CAP,
                                  HAS_BIAS,
                                  HAS_DROP, HAS_EK, HAS_EV, NEED_SCORES)
        m_new = tl.maximum(m, _max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no shift
        rescale = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[None, :])  # (BE, BH)
        l_sum = l_sum * rescale + _sum(p, axis=0)
        if HAS_DROP:
            p = p * d
        acc = acc * rescale[:, None] + _sum(p[:, :, None] * v_e, axis=0)
        m = m_new
    return m, l_sum, acc


@triton.jit
def forward_kernel(q, k, v, bias, att, drop, edge_key, edge_value, rowptr, col, eid, order,
                   num_rows, max_degree, out, lse, scores, scale, slope, cap, sinks,
                   H: tl.constexpr, C: tl.constexpr, CK: tl.constexpr,
                   SCORE: tl.constexpr, HAS_CAP: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_DROP: tl.constexpr, HAS_EK: tl.constexpr,
                   HAS_EV: tl.constexpr, NEED_SCORES: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_CK: tl.constexpr, SUM_STEPS: tl.constexpr,
                   HEAVY_ONLY: tl.constexpr = False,
                   LIGHT_ONLY: tl.constexpr = False, HAS_SINKS: tl.constexpr = False):
    """Grid (N_dst, head blocks), or with ``HEAVY_ONLY`` (rows of the degree ``order`` above
    ``max_degree``; see :func:`_one_row`), head blocks). Online softmax over the incoming edges
    of one target (CSR ``rowptr``, ``col`` = sources, ``eid`` = edge ids), ``BLOCK_E`` at a
    time (with ``SUM_STEPS > 0``, the sums in float64 every ``SUM_STEPS`` tiles, shifted to
    the row's maximum so far; ``LIGHT_ONLY``: see :func:`_one_row`), with the key k_j + ek_e
    and the value v_j + ev_e of each edge when ``HAS_EK``, ``HAS_EV``; writes ``out``
    ``[N_dst, H, C]``, the softmax statistics ``lse``
    ``[N_dst, H, 2]`` (fp32: the row maximum m, +inf on a row without weight and NaN on a row
    with a NaN or +inf score, and log l, 0 on a row without weight), and the scores ``[E, H]``
    when ``NEED_SCORES``. ``num_rows`` is read by the row-block kernel only. With
    ``HAS_SINKS``, each row's softmax starts at the sink of its head, ``sinks`` ``[H]``
    (fp32): maximum ``sinks[h]``, sum 1, accumulator 0 (:mod:`graphattn.functional.sinks`)."""
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH)
    row, start, end, h_ok = _one_row(order, rowptr, max_degree, offs_h, H, HEAVY_ONLY,
                                     LIGHT_ONLY)
    hc, hc_ok, hck, hck_ok = _head_channels(offs_h, h_ok, C, CK, BLOCK_C, BLOCK_CK)
    this_row = tl.full([1], 0, tl.int64) + row  # (1)
    q_i = _score_operand(q, this_row, offs_h, hck, h_ok[None, :], hck_ok[None, :, :], H,
                         CK, SCORE)  # (1, BH) or (1, BH, BCK)
    att_h = _attention_vector(att, hck, hck_ok, SCORE)  # (BH, BCK)

    m, l_start = _softmax_start(sinks, offs_h, h_ok, HAS_SINKS)  # (BH): the sink, or nothing
    if SUM_STEPS > 0:  # rows of many blocks: the block sums in float64
        m_sums = m  # the maximum of the block sums
        l_sums = l_start.to(tl.float64)
        acc_sums = tl.full([BLOCK_H, BLOCK_C], 0, tl.float64)
        for b0 in range(start, end, SUM_STEPS * BLOCK_E):
            m, l_sum, acc = _forward_steps(
                b0, tl.minimum(b0 + SUM_STEPS * BLOCK_E, end), m,
                tl.full([BLOCK_H], 0, tl.float32), tl.full([BLOCK_H, BLOCK_C], 0, tl.float32),
                q_i, k, v, bias, att_h, drop, edge_key, edge_value, col, eid, scores, offs_h,
                hc, hck, h_ok, hc_ok, hck_ok, scale, slope, cap, H, C, CK, SCORE, HAS_CAP, HAS_BIAS,
                HAS_DROP, HAS_EK, HAS_EV, NEED_SCORES, BLOCK_E)
            # the float64 sums, taken at the maximum m_sums <= m: shifted to m, the block added
            shift = tl.exp(m_sums - tl.where(m == float("-inf"), 0.0, m)).to(tl.float64)
            l_sums = l_sums * shift + l_sum.to(tl.float64)
            acc_sums = acc_sums * shift[:, None] + acc.to(tl.float64)
            m_sums = m
        l_safe, m_out, log_l = _weights_and_stats(l_sums, m_sums)
        out_i = (acc_sums / l_safe[:, None]).to(tl.float32)
        m_out = m_out.to(tl.float32)
        log_l = log_l.to(tl.float32)
    else:
        m, l_sum, acc = _forward_steps(
            start, end, m, l_start,
            tl.full([BLOCK_H, BLOCK_C], 0, tl.float32), q_i, k, v, bias, att_h, drop,
            edge_key, edge_value, col, eid, scores, offs_h, hc, hck, h_ok, hc_ok, hck_ok, scale,
            slope, cap, H, C, CK, SCORE, HAS_CAP, HAS_BIAS, HAS_DROP, HAS_EK, HAS_EV, NEED_SCORES,
            BLOCK_E)
        l_safe, m_out, log_l = _weights_and_stats(l_sum, m)
        out_i = acc / l_safe[:, None]

    tl.store(out + row * (H * C) + hc, out_i.to(out.dtype.element_ty), mask=hc_ok)
    at = row * H + offs_h  # (BH): the (target, head) pairs of lse
    tl.store(lse + at * 2, m_out, mask=h_ok)
    tl.store(lse + at * 2 + 1, log_l, mask=h_ok)


@triton.jit
def forward_rows_kernel(q, k, v, bias, att, drop, edge_key, edge_value, rowptr, col, eid,
                        order, num_rows, max_degree, out, lse, scores, scale, slope, cap, sinks,
                        H: tl.constexpr, C: tl.constexpr, CK: tl.constexpr,
                        SCORE: tl.constexpr, HAS_CAP: tl.constexpr,
                        HAS_BIAS: tl.constexpr, HAS_DROP: tl.constexpr,
                        HAS_EK: tl.constexpr, HAS_EV: tl.constexpr, NEED_SCORES: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_CK: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    """Grid (row blocks, head blocks): what :func:`forward_kernel` computes, for ``BLOCK_N``
    targets of at most ``max_degree`` edges per program (:func:`_row_block`), one edge of each
    per step: the lanes of a tile are targets, not edges, and each keeps its own online
    softmax, elementwise, with no reduction across lanes."""
    row, start, degree, mine = _row_block(order, rowptr, num_rows, max_degree, BLOCK_N)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH)
    h_ok = offs_h < H
    hc, hc_ok, hck, hck_ok = _head_channels(offs_h, h_ok, C, CK, BLOCK_C, BLOCK_CK)
    row_ok2 = mine[:, None] & h_ok[None, :]  # (BN, BH)
    q_i = _score_operand(q, row, offs_h, hck, row_ok2, mine[:, None, None] & hck_ok[None, :, :],
                         H, CK, SCORE)  # (BN, BH) or (BN, BH, BCK)
    att_h = _attention_vector(att, hck, hck_ok, SCORE)  # (BH, BCK)

    m, l_sum = _softmax_start(sinks, offs_h, h_ok, HAS_SINKS)  # (BH)
    m = tl.full([BLOCK_N, BLOCK_H], 0, tl.float32) + m[None, :]  # (BN, BH)
    l_sum = tl.full([BLOCK_N, BLOCK_H], 0, tl.float32) + l_sum[None, :]
    acc = tl.full([BLOCK_N, BLOCK_H, BLOCK_C], 0, tl.float32)
    for t in range(0, _max(degree, axis=0)):
        s, d, v_e = _forward_tile(q_i, k, v, bias, att_h, drop, edge_key, edge_value, col,
                                  eid, scores, start + t, t < degree, offs_h, hc, hck, h_ok,
                                  hc_ok, hck_ok, scale, slope, cap, H, C, CK, SCORE, HAS_CAP,
                                  HAS_BIAS,
                                  HAS_DROP, HAS_EK, HAS_EV, NEED_SCORES)  # (BN, BH), ...
        m_new = tl.maximum(m, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no shift
        rescale = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe)  # (BN, BH)
        l_sum = l_sum * rescale + p
        if HAS_DROP:
            p = p * d
        acc = acc * rescale[:, :, None] + p[:, :, None] * v_e
        m = m_new

    l_safe, m_out, log_l = _weights_and_stats(l_sum, m)
    tl.store(out + row[:, None, None] * (H * C) + hc[None, :, :],
             (acc / l_safe[:, :, None]).to(out.dtype.element_ty),
             mask=mine[:, None, None] & hc_ok[None, :, :])
    at = row[:, None] * H + offs_h[None, :]  # (BN, BH): the (target, head) pairs of lse
    tl.store(lse + at * 2, m_out, mask=row_ok2)
    tl.store(lse + at * 2 + 1, log_l, mask=row_ok2)


@triton.jit
def _target_scores(q_i, k, bias, att_h, edge_key, col, eid, pos, e_ok, offs_h, hck, h_ok,
                   hck_ok, scale, slope, cap, H: tl.constexpr, CK: tl.constexpr,
                   SCORE: tl.constexpr, HAS_CAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_EK: tl.constexpr):
    """The edges at CSR positions ``pos`` (``e_ok``) of the target pass, recomputed: their
    sources and ids ``(BL)``, the masks ``(BL, BH)`` and ``(BL, BH, BCK)``, bias, key
    ``(BL, BH, BCK)`` and score ``(BL, BH)`` (-inf where masked)."""
    ok2 = e_ok[:, None] & h_ok[None, :]
    ok3k = e_ok[:, None, None] & hck_ok[None, :, :]
    src = tl.load(col + pos, mask=e_ok, other=0).to(tl.int64)
    edge = tl.load(eid + pos, mask=e_ok, other=0).to(tl.int64)
    b = 0.0
    if HAS_BIAS:
        b = _edge_values(bias, edge, offs_h, ok2, H)
    k_e = _with_edge_term(_score_operand(k, src, offs_h, hck, ok2, ok3k, H, CK, SCORE),
                          edge_key, edge, hck, ok3k, H, CK, HAS_EK)  # key of the edge
    s = tl.where(ok2, _scores(q_i, k_e, b, att_h, scale, slope, cap, SCORE, HAS_CAP), float("-inf"))
    return src, edge, ok2, ok3k, b, k_e, s


@triton.jit
def _alpha_dalpha(q_i, m_i, log_l_i, k, bias, att_h, edge_key, dalpha, col, eid, pos, e_ok,
                  offs_h, hck, h_ok, hck_ok, scale, slope, cap, H: tl.constexpr, CK: tl.constexpr,
                  SCORE: tl.constexpr, HAS_CAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_EK: tl.constexpr):
    """``alpha_e * dalpha_e`` ``(BL, BH)`` of the edges at CSR positions ``pos``: their terms
    of the target's delta when the returned attention weights carry a gradient."""
    _, edge, ok2, _, _, _, s = _target_scores(q_i, k, bias, att_h, edge_key, col, eid, pos,
                                              e_ok, offs_h, hck, h_ok, hck_ok, scale, slope, cap,
                                              H, CK, SCORE, HAS_CAP, HAS_BIAS, HAS_EK)
    return _softmax_weights(s, m_i, log_l_i) * _edge_values(dalpha, edge, offs_h, ok2, H)


@triton.jit
def _target_tile(q_i, do_i, delta_i, m_i, log_l_i, k, v, bias, att_h, drop, edge_key,
                 edge_value, dalpha, dbias, dedge_key, dedge_value, col, eid, pos, e_ok,
                 offs_h, hc, hck, h_ok, hc_ok, hck_ok, scale, slope, cap,
                 H: tl.constexpr, C: tl.constexpr, CK: tl.constexpr, SCORE: tl.constexpr,
                 HAS_CAP: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_DROP: tl.constexpr, HAS_EK: tl.constexpr,
                 HAS_EV: tl.constexpr, HAS_DALPHA: tl.constexpr, NEED_DBIAS: tl.constexpr,
                 NEED_DATT: tl.constexpr, NEED_DEK: tl.constexpr, NEED_DEV: tl.constexpr,
                 EV_IS_EK: tl.constexpr):
    """The edges at CSR positions ``pos`` (``e_ok``) in the target pass, with their target's
    q, dout, delta and statistics (one row broadcast, or one per lane): writes the gradients
    of their per-edge inputs asked for (bias, key and value terms) and returns each edge's
    terms of dq (see :func:`_operand_terms`) and, when ``NEED_DATT``, of the target's share of
    d att, ``(BL, BH, BCK)`` (0.0 otherwise)."""
    src, edge, ok2, ok3k, b, k_e, s = _target_scores(q_i, k, bias, att_h, edge_key, col, eid,
                                                     pos, e_ok, offs_h, hck, h_ok, hck_ok,
                                                     scale, slope, cap, H, CK, SCORE, HAS_CAP,
                                                     HAS_BIAS,
                                                     HAS_EK)
    ok3 = e_ok[:, None, None] & hc_ok[None, :, :]  # (BL, BH, BC)
    a = _softmax_weights(s, m_i, log_l_i)  # (BL, BH)
    v_e = _with_edge_term(_rows(v, src, hc, ok3, H, C), edge_value, edge, hc, ok3, H, C,
                          HAS_EV)  # (BL, BH, BC): value of the edge
    dp = _sum(do_i * v_e, axis=2)  # (BL, BH)
    w = a  # (BL, BH): weight of the edge's value in out_i
    if HAS_DROP:
        d = _dropout_multipliers(drop, edge[:, None] * H + offs_h[None, :], ok2)
        dp = dp * d
        w = a * d
    if HAS_DALPHA:
        dp = dp + _edge_values(dalpha, edge, offs_h, ok2, H)
    ds = a * (dp - delta_i)  # (BL, BH)
    dz = _pre_activation_grad(ds, q_i, k_e, b, att_h, scale, slope, cap, SCORE,
                              HAS_CAP)  # (BL, BH)
    if NEED_DBIAS:  # (the bias of dot and gatv2 is added after the cap)
        db = dz if SCORE == ADDITIVE else ds
        tl.store(dbias + edge[:, None] * H + offs_h[None, :], db.to(dbias.dtype.element_ty),
                 mask=ok2)
    if NEED_DEK:
        dek = _edge_key_grad(dz, q_i, k_e, att_h, scale, slope, SCORE)  # (BL, BH, BCK)
        if EV_IS_EK:  # the value term's gradient too: the same tensor, BCK == BC
            dek += w[:, :, None] * do_i
        tl.store(dedge_key + edge[:, None, None] * (H * CK) + hck[None, :, :],
                 dek.to(dedge_key.dtype.element_ty), mask=ok3k)
    if NEED_DEV:
        dev = w[:, :, None] * do_i  # (BL, BH, BC)
        tl.store(dedge_value + edge[:, None, None] * (H * C) + hc[None, :, :],
                 dev.to(dedge_value.dtype.element_ty), mask=ok3)
    datt = 0.0
    if NEED_DATT:
        datt = dz[:, :, None] * _leaky_relu(q_i + k_e, slope)
    return _operand_terms(dz, q_i, k_e, k_e, slope, SCORE), datt


@triton.jit
def _delta_steps(lo, hi, delta_i, q_i, m_i, log_l_i, k, bias, att_h, edge_key, dalpha, col,
                 eid, offs_h, hck, h_ok, hck_ok, scale, slope, cap, H: tl.constexpr,
                 CK: tl.constexpr, SCORE: tl.constexpr, HAS_CAP: tl.constexpr,
                 HAS_BIAS: tl.constexpr,
                 HAS_EK: tl.constexpr, BLOCK_E: tl.constexpr):
    """``delta_i`` ``(1, BH)`` plus the weights' terms ``alpha_e * dalpha_e`` of the edges at
    the CSR positions ``[lo, hi)``, ``BLOCK_E`` at a time."""
    for e0 in range(lo, hi, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)  # (BE)
        delta_i += _sum(_alpha_dalpha(q_i, m_i, log_l_i, k, bias, att_h, edge_key, dalpha, col,
                                      eid, offs_e, offs_e < hi, offs_h, hck, h_ok, hck_ok,
                                      scale, slope, cap, H, CK, SCORE, HAS_CAP, HAS_BIAS, HAS_EK),
                        axis=0)[None, :]
    return delta_i


@triton.jit
def _target_steps(lo, hi, dq_i, datt_i, q_i, do_i, delta_i, m_i, log_l_i, k, v, bias, att_h,
                  drop, edge_key, edge_value, dalpha, dbias, dedge_key, dedge_value, col, eid,
                  offs_h, hc, hck, h_ok, hc_ok, hck_ok, scale, slope, cap, H: tl.constexpr,
                  C: tl.constexpr, CK: tl.constexpr, SCORE: tl.constexpr, HAS_CAP: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_DROP: tl.constexpr, HAS_EK: tl.constexpr,
                  HAS_EV: tl.constexpr, HAS_DALPHA: tl.constexpr, NEED_DBIAS: tl.constexpr,
                  NEED_DATT: tl.constexpr, NEED_DEK: tl.constexpr, NEED_DEV: tl.constexpr,
                  EV_IS_EK: tl.constexpr, BLOCK_E: tl.constexpr):
    """The target pass over the CSR positions ``[lo, hi)``, ``BLOCK_E`` at a time: writes the
    per-edge gradients asked for and returns ``dq_i`` and ``datt_i`` with the edges' terms
    added."""
    for e0 in range(lo, hi, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)  # (BE)
        dq_terms, datt_terms = _target_tile(
            q_i, do_i, delta_i, m_i, log_l_i, k, v, bias, att_h, drop, edge_key, edge_value,
            dalpha, dbias, dedge_key, dedge_value, col, eid, offs_e, offs_e < hi, offs_h, hc,
            hck, h_ok, hc_ok, hck_ok, scale, slope, cap, H, C, CK, SCORE, HAS_CAP, HAS_BIAS,
            HAS_DROP,
            HAS_EK, HAS_EV, HAS_DALPHA, NEED_DBIAS, NEED_DATT, NEED_DEK, NEED_DEV, EV_IS_EK)
        dq_i += _sum(dq_terms, axis=0)
        if NEED_DATT:
            datt_i += _sum(datt_terms, axis=0)
    return dq_i, datt_i


@triton.jit
def backward_target_kernel(q, k, v, bias, att, drop, edge_key, edge_value, out, dout, lse,
                           dalpha, rowptr, col, eid, order, num_rows, max_degree, dq, dbias,
                           datt_rows, dedge_key, dedge_value, delta, scale, slope, cap,
                           H: tl.constexpr, C: tl.constexpr, CK: tl.constexpr,
                           SCORE: tl.constexpr, HAS_CAP: tl.constexpr,
                           HAS_BIAS: tl.constexpr, HAS_DROP: tl.constexpr,
                           HAS_EK: tl.constexpr, HAS_EV: tl.constexpr,
                           HAS_DALPHA: tl.constexpr, NEED_DBIAS: tl.constexpr,
                           NEED_DATT: tl.constexpr, NEED_DEK: tl.constexpr,
                           NEED_DEV: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                           BLOCK_CK: tl.constexpr, SUM_STEPS: tl.constexpr,
                           EV_IS_EK: tl.constexpr = False,
                           HEAVY_ONLY: tl.constexpr = False,
                           LIGHT_ONLY: tl.constexpr = False):
    """Grid (N_dst, head blocks), or with ``HEAVY_ONLY`` as :func:`forward_kernel`. Over the
    incoming edges of one target: writes ``delta`` ``[N_dst, H]`` (dout . out, plus sum
    alpha * dalpha), ``dq``, when ``NEED_DATT`` (gatv2) the target's share ``datt_rows[i]``
    ``[N_dst, H, C]`` (fp32) of the gradient of att, and for each of its edges, once, the
    gradients of the per-edge inputs asked for: bias (``NEED_DBIAS``), key term ``dedge_key``
    (``NEED_DEK``) and value term ``dedge_value`` (``NEED_DEV``). ``EV_IS_EK``: one tensor is
    both terms (``CK == C``), and ``dedge_key`` gets the sum of both gradients (``NEED_DEV``
    off)."""
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH)
    row, start, end, h_ok = _one_row(order, rowptr, max_degree, offs_h, H, HEAVY_ONLY,
                                     LIGHT_ONLY)
    hc, hc_ok, hck, hck_ok = _head_channels(offs_h, h_ok, C, CK, BLOCK_C, BLOCK_CK)
    this_row = tl.full([1], 0, tl.int64) + row  # (1)
    q_i = _score_operand(q, this_row, offs_h, hck, h_ok[None, :], hck_ok[None, :, :], H,
                         CK, SCORE)  # (1, BH) or (1, BH, BCK)
    att_h = _attention_vector(att, hck, hck_ok, SCORE)  # (BH, BCK)
    do_i = _rows(dout, this_row, hc, hc_ok[None, :, :], H, C)  # (1, BH, BC)
    o_i = _rows(out, this_row, hc, hc_ok[None, :, :], H, C)
    m_i, log_l_i = _softmax_stats(lse, row * H + offs_h[None, :], h_ok[None, :])  # (1, BH)
    delta_i = _sum(do_i * o_i, axis=2)  # (1, BH)
    if HAS_DALPHA:
        if SUM_STEPS > 0:  # rows of many blocks: the block sums in float64
            delta_sums = delta_i.to(tl.float64)
            for b0 in range(start, end, SUM_STEPS * BLOCK_E):
                delta_sums += _delta_steps(
                    b0, tl.minimum(b0 + SUM_STEPS * BLOCK_E, end),
                    tl.full([1, BLOCK_H], 0, tl.float32), q_i, m_i, log_l_i, k, bias, att_h,
                    edge_key, dalpha, col, eid, offs_h, hck, h_ok, hck_ok, scale, slope, cap, H,
                    CK, SCORE, HAS_CAP, HAS_BIAS, HAS_EK, BLOCK_E).to(tl.float64)
            delta_i = delta_sums.to(tl.float32)
        else:
            delta_i = _delta_steps(start, end, delta_i, q_i, m_i, log_l_i, k, bias, att_h,
                                   edge_key, dalpha, col, eid, offs_h, hck, h_ok, hck_ok, scale,
                                   slope, cap, H, CK, SCORE, HAS_CAP, HAS_BIAS, HAS_EK, BLOCK_E)
    tl.store(delta + row * H + offs_h[None, :], delta_i, mask=h_ok[None, :])

    if SCORE == ADDITIVE:
        dq_i = tl.full([BLOCK_H], 0, tl.float32)
    else:
        dq_i = tl.full([BLOCK_H, BLOCK_CK], 0, tl.float32)
    datt_i = tl.full([BLOCK_H, BLOCK_CK], 0, tl.float32)
    if SUM_STEPS > 0:  # rows of many blocks: the block sums in float64
        dq_sums = dq_i.to(tl.float64)
        datt_sums = datt_i.to(tl.float64)
        for b0 in range(start, end, SUM_STEPS * BLOCK_E):
            dq_block, datt_block = _target_steps(
                b0, tl.minimum(b0 + SUM_STEPS * BLOCK_E, end), dq_i * 0.0, datt_i * 0.0, q_i,
                do_i, delta_i, m_i, log_l_i, k, v, bias, att_h, drop, edge_key, edge_value,
                dalpha, dbias, dedge_key, dedge_value, col, eid, offs_h, hc, hck, h_ok, hc_ok,
                hck_ok, scale, slope, cap, H, C, CK, SCORE, HAS_CAP, HAS_BIAS, HAS_DROP, HAS_EK,
                HAS_EV,
                HAS_DALPHA, NEED_DBIAS, NEED_DATT, NEED_DEK, NEED_DEV, EV_IS_EK, BLOCK_E)
            dq_sums += dq_block.to(tl.float64)
            if NEED_DATT:
                datt_sums += datt_block.to(tl.float64)
        dq_i = dq_sums.to(tl.float32)
        datt_i = datt_sums.to(tl.float32)
    else:
        dq_i, datt_i = _target_steps(
            start, end, dq_i, datt_i, q_i, do_i, delta_i, m_i, log_l_i, k, v, bias, att_h,
            drop, edge_key, edge_value, dalpha, dbias, dedge_key, dedge_value, col, eid, offs_h,
            hc, hck, h_ok, hc_ok, hck_ok, scale, slope, cap, H, C, CK, SCORE, HAS_CAP, HAS_BIAS,
            HAS_DROP,
            HAS_EK, HAS_EV, HAS_DALPHA, NEED_DBIAS, NEED_DATT, NEED_DEK, NEED_DEV, EV_IS_EK,
            BLOCK_E)
    if SCORE == ADDITIVE:
        tl.store(dq + row * H + offs_h, dq_i.to(dq.dtype.element_ty), mask=h_ok)
    else:
        tl.store(dq + row * (H * CK) + hck, (dq_i * scale * att_h).to(dq.dtype.element_ty),
                 mask=hck_ok)
    if NEED_DATT:
        tl.store(datt_rows + row * (H * CK) + hck, datt_i * scale, mask=hck_ok)


@triton.jit
def backward_target_rows_kernel(q, k, v, bias, att, drop, edge_key, edge_value, out, dout,
                                lse, dalpha, rowptr, col, eid, order, num_rows, max_degree,
                                dq, dbias, datt_rows, dedge_key, dedge_value, delta, scale,
                                slope, cap, H: tl.constexpr, C: tl.constexpr, CK: tl.constexpr,
                                SCORE: tl.constexpr, HAS_CAP: tl.constexpr,
                                HAS_BIAS: tl.constexpr, HAS_DROP: tl.constexpr,
                                HAS_EK: tl.constexpr, HAS_EV: tl.constexpr,
                                HAS_DALPHA: tl.constexpr, NEED_DBIAS: tl.constexpr,
                                NEED_DATT: tl.constexpr, NEED_DEK: tl.constexpr,
                                NEED_DEV: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                                BLOCK_CK: tl.constexpr, EV_IS_EK: tl.constexpr = False):
    """Grid (row blocks, head blocks): what :func:`backward_target_kernel` computes, for
    ``BLOCK_N`` targets of at most ``max_degree`` edges per program, one edge of each per step
    (as :func:`forward_rows_kernel`)."""
    row, start, degree, mine = _row_block(order, rowptr, num_rows, max_degree, BLOCK_N)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH)
    h_ok = offs_h < H
    hc, hc_ok, hck, hck_ok = _head_channels(offs_h, h_ok, C, CK, BLOCK_C, BLOCK_CK)
    row_ok2 = mine[:, None] & h_ok[None, :]  # (BN, BH)
    row_ok3 = mine[:, None, None] & hc_ok[None, :, :]  # (BN, BH, BC)
    row_ok3k = mine[:, None, None] & hck_ok[None, :, :]  # (BN, BH, BCK)
    q_i = _score_operand(q, row, offs_h, hck, row_ok2, row_ok3k, H, CK,
                         SCORE)  # (BN, BH) or (BN, BH, BCK)
    att_h = _attention_vector(att, hck, hck_ok, SCORE)  # (BH, BCK)
    do_i = _rows(dout, row, hc, row_ok3, H, C)  # (BN, BH, BC)
    o_i = _rows(out, row, hc, row_ok3, H, C)
    at = row[:, None] * H + offs_h[None, :]  # (BN, BH)
    m_i, log_l_i = _softmax_stats(lse, at, row_ok2)  # (BN, BH)
    delta_i = _sum(do_i * o_i, axis=2)  # (BN, BH)
    steps = _max(degree, axis=0)
    if HAS_DALPHA:
        for t in range(0, steps):
            delta_i += _alpha_dalpha(q_i, m_i, log_l_i, k, bias, att_h, edge_key, dalpha, col,
                                     eid, start + t, t < degree, offs_h, hck, h_ok, hck_ok,
                                     scale, slope, cap, H, CK, SCORE, HAS_CAP, HAS_BIAS, HAS_EK)
    tl.store(delta + at, delta_i, mask=row_ok2)

    if SCORE == ADDITIVE:
        dq_i = tl.full([BLOCK_N, BLOCK_H], 0, tl.float32)
    else:
        dq_i = tl.full([BLOCK_N, BLOCK_H, BLOCK_CK], 0, tl.float32)
    datt_i = tl.full([BLOCK_N, BLOCK_H, BLOCK_CK], 0, tl.float32)
    for t in range(0, steps):
        dq_terms, datt_terms = _target_tile(
            q_i, do_i, delta_i, m_i, log_l_i, k, v, bias, att_h, drop, edge_key, edge_value,
            dalpha, dbias, dedge_key, dedge_value, col, eid, start + t, t < degree, offs_h, hc,
            hck, h_ok, hc_ok, hck_ok, scale, slope, cap, H, C, CK, SCORE, HAS_CAP, HAS_BIAS,
            HAS_DROP,
            HAS_EK, HAS_EV, HAS_DALPHA, NEED_DBIAS, NEED_DATT, NEED_DEK, NEED_DEV, EV_IS_EK)
        dq_i += dq_terms
        if NEED_DATT:
            datt_i += datt_terms
    if SCORE == ADDITIVE:
        tl.store(dq + at, dq_i.to(dq.dtype.element_ty), mask=row_ok2)
    else:
        tl.store(dq + row[:, None, None] * (H * CK) + hck[None, :, :],
                 (dq_i * scale * att_h).to(dq.dtype.element_ty), mask=row_ok3k)
    if NEED_DATT:
        tl.store(datt_rows + row[:, None, None] * (H * CK) + hck[None, :, :], datt_i * scale,
                 mask=row_ok3k)


@triton.jit
def _source_tile(k_j, v_j, q, bias, att_h, drop, edge_key, edge_value, dout, lse, delta,
                 dalpha, row_t, eid_t, pos, e_ok, offs_h, hc, hck, h_ok, hc_ok, hck_ok, scale,
                 slope, cap, H: tl.constexpr, C: tl.constexpr, CK: tl.constexpr,
                 SCORE: tl.constexpr, HAS_CAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_DROP: tl.constexpr,
                 HAS_EK: tl.constexpr, HAS_EV: tl.constexpr, HAS_DALPHA: tl.constexpr):
    """The edges at transposed-CSR positions ``pos`` (``e_ok``) out of their sources, with the
    source's k and v (one row broadcast, or one per lane): each edge's terms of dk (see
    :func:`_operand_terms`) and of dv, ``(BL, BH, BC)``."""
    ok2 = e_ok[:, None] & h_ok[None, :]  # (BL, BH)
    ok3 = e_ok[:, None, None] & hc_ok[None, :, :]  # (BL, BH, BC)
    ok3k = e_ok[:, None, None] & hck_ok[None, :, :]  # (BL, BH, BCK)
    dst = tl.load(row_t + pos, mask=e_ok, other=0).to(tl.int64)
    edge = tl.load(eid_t + pos, mask=e_ok, other=0).to(tl.int64)
    b = 0.0
    if HAS_BIAS:
        b = _edge_values(bias, edge, offs_h, ok2, H)
    q_i = _score_operand(q, dst, offs_h, hck, ok2, ok3k, H, CK, SCORE)
    k_e = _with_edge_term(k_j, edge_key, edge, hck, ok3k, H, CK, HAS_EK)  # key of the edge
    s = tl.where(ok2, _scores(q_i, k_e, b, att_h, scale, slope, cap, SCORE, HAS_CAP), float("-inf"))
    m_i, log_l_i = _softmax_stats(lse, dst[:, None] * H + offs_h[None, :], ok2)
    a = _softmax_weights(s, m_i, log_l_i)  # (BL, BH)
    do_i = _rows(dout, dst, hc, ok3, H, C)  # (BL, BH, BC)
    v_e = _with_edge_term(v_j, edge_value, edge, hc, ok3, H, C,
                          HAS_EV)  # (1 or BL, BH, BC): value of the edge
    dp = _sum(do_i * v_e, axis=2)  # (BL, BH)
    w = a
    if HAS_DROP:
        d = _dropout_multipliers(drop, edge[:, None] * H + offs_h[None, :], ok2)
        dp = dp * d
        w = a * d
    if HAS_DALPHA:
        dp = dp + _edge_values(dalpha, edge, offs_h, ok2, H)
    delta_i = _edge_values(delta, dst, offs_h, ok2, H)
    dz = _pre_activation_grad(a * (dp - delta_i), q_i, k_e, b, att_h, scale, slope, cap,
                              SCORE, HAS_CAP)  # (BL, BH)
    return _operand_terms(dz, q_i, k_e, q_i, slope, SCORE), w[:, :, None] * do_i


@triton.jit
def _source_steps(lo, hi, dk_j, dv_j, k_j, v_j, q, bias, att_h, drop, edge_key, edge_value,
                  dout, lse, delta, dalpha, row_t, eid_t, offs_h, hc, hck, h_ok, hc_ok, hck_ok,
                  scale, slope, cap, H: tl.constexpr, C: tl.constexpr, CK: tl.constexpr,
                  SCORE: tl.constexpr, HAS_CAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_DROP: tl.constexpr,
                  HAS_EK: tl.constexpr, HAS_EV: tl.constexpr, HAS_DALPHA: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    """The source pass over the transposed-CSR positions ``[lo, hi)``, ``BLOCK_E`` at a time:
    ``dk_j`` and ``dv_j`` with the edges' terms added."""
    for e0 in range(lo, hi, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)  # (BE)
        dk_terms, dv_terms = _source_tile(
            k_j, v_j, q, bias, att_h, drop, edge_key, edge_value, dout, lse, delta, dalpha,
            row_t, eid_t, offs_e, offs_e < hi, offs_h, hc, hck, h_ok, hc_ok, hck_ok, scale,
            slope, cap, H, C, CK, SCORE, HAS_CAP, HAS_BIAS, HAS_DROP, HAS_EK, HAS_EV, HAS_DALPHA)
        dk_j += _sum(dk_terms, axis=0)
        dv_j += _sum(dv_terms, axis=0)
    return dk_j, dv_j


@triton.jit
def backward_source_kernel(q, k, v, bias, att, drop, edge_key, edge_value, dout, lse, delta,
                           dalpha, colptr, row_t, eid_t, order, num_rows, max_degree, dk, dv,
                           scale, slope, cap,
                           H: tl.constexpr, C: tl.constexpr, CK: tl.constexpr,
                           SCORE: tl.constexpr, HAS_CAP: tl.constexpr,
                           HAS_BIAS: tl.constexpr, HAS_DROP: tl.constexpr,
                           HAS_EK: tl.constexpr, HAS_EV: tl.constexpr,
                           HAS_DALPHA: tl.constexpr,
                           BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_C: tl.constexpr, BLOCK_CK: tl.constexpr,
                           SUM_STEPS: tl.constexpr,
                           HEAVY_ONLY: tl.constexpr = False,
                           LIGHT_ONLY: tl.constexpr = False):
    """Grid (N_src, head blocks), or with ``HEAVY_ONLY`` as :func:`forward_kernel` over the
    source ``order``. Over the outgoing edges of one source (transposed CSR ``colptr``,
    ``row_t`` = targets, ``eid_t`` = edge ids): writes ``dk`` and ``dv``. The per-edge terms
    enter the recomputed scores and softmax gradients only: dv_j sums w_e dout_i whatever the
    value of the edge, and ek_e changes dk_j only through LeakyReLU'(q_i + k_j + ek_e) of
    gatv2."""
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH)
    node, start, end, h_ok = _one_row(order, colptr, max_degree, offs_h, H, HEAVY_ONLY,
                                      LIGHT_ONLY)
    hc, hc_ok, hck, hck_ok = _head_channels(offs_h, h_ok, C, CK, BLOCK_C, BLOCK_CK)
    this_node = tl.full([1], 0, tl.int64) + node  # (1)
    k_j = _score_operand(k, this_node, offs_h, hck, h_ok[None, :], hck_ok[None, :, :], H,
                         CK, SCORE)  # (1, BH) or (1, BH, BCK)
    att_h = _attention_vector(att, hck, hck_ok, SCORE)  # (BH, BCK)
    v_j = _rows(v, this_node, hc, hc_ok[None, :, :], H, C)  # (1, BH, BC)

    if SCORE == ADDITIVE:
        dk_j = tl.full([BLOCK_H], 0, tl.float32)
    else:
        dk_j = tl.full([BLOCK_H, BLOCK_CK], 0, tl.float32)
    dv_j = tl.full([BLOCK_H, BLOCK_C], 0, tl.float32)
    if SUM_STEPS > 0:  # rows of many blocks: the block sums in float64
        dk_sums = dk_j.to(tl.float64)
        dv_sums = dv_j.to(tl.float64)
        for b0 in range(start, end, SUM_STEPS * BLOCK_E):
            dk_block, dv_block = _source_steps(
                b0, tl.minimum(b0 + SUM_STEPS * BLOCK_E, end), dk_j * 0.0, dv_j * 0.0, k_j,
                v_j, q, bias, att_h, drop, edge_key, edge_value, dout, lse, delta, dalpha,
                row_t, eid_t, offs_h, hc, hck, h_ok, hc_ok, hck_ok, scale, slope, cap, H, C, CK,
                SCORE, HAS_CAP, HAS_BIAS, HAS_DROP, HAS_EK, HAS_EV, HAS_DALPHA, BLOCK_E)
            dk_sums += dk_block.to(tl.float64)
            dv_sums += dv_block.to(tl.float64)
        dk_j = dk_sums.to(tl.float32)
        dv_j = dv_sums.to(tl.float32)
    else:
        dk_j, dv_j = _source_steps(start, end, dk_j, dv_j, k_j, v_j, q, bias, att_h, drop,
                                   edge_key, edge_value, dout, lse, delta, dalpha, row_t, eid_t,
                                   offs_h, hc, hck, h_ok, hc_ok, hck_ok, scale, slope, cap, H, C,
                                   CK,
                                   SCORE, HAS_CAP, HAS_BIAS, HAS_DROP, HAS_EK, HAS_EV, HAS_DALPHA,
                                   BLOCK_E)
    if SCORE == ADDITIVE:
        tl.store(dk + node * H + offs_h, dk_j.to(dk.dtype.element_ty), mask=h_ok)
    else:
        tl.store(dk + node * (H * CK) + hck, (dk_j * scale * att_h).to(dk.dtype.element_ty),
                 mask=hck_ok)
    tl.store(dv + node * (H * C) + hc, dv_j.to(dv.dtype.element_ty), mask=hc_ok)


@triton.jit
def backward_source_rows_kernel(q, k, v, bias, att, drop, edge_key, edge_value, dout, lse,
                                delta, dalpha, colptr, row_t, eid_t, order, num_rows,
                                max_degree, dk, dv, scale, slope, cap,
                                H: tl.constexpr, C: tl.constexpr, CK: tl.constexpr,
                                SCORE: tl.constexpr, HAS_CAP: tl.constexpr,
                                HAS_BIAS: tl.constexpr, HAS_DROP: tl.constexpr,
                                HAS_EK: tl.constexpr, HAS_EV: tl.constexpr,
                                HAS_DALPHA: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                                BLOCK_C: tl.constexpr, BLOCK_CK: tl.constexpr):
    """Grid (row blocks, head blocks): what :func:`backward_source_kernel` computes, for
    ``BLOCK_N`` sources of at most ``max_degree`` edges per program, one edge of each per step
    (as :func:`forward_rows_kernel`)."""
    node, start, degree, mine = _row_block(order, colptr, num_rows, max_degree, BLOCK_N)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH)
    h_ok = offs_h < H
    hc, hc_ok, hck, hck_ok = _head_channels(offs_h, h_ok, C, CK, BLOCK_C, BLOCK_CK)
    row_ok2 = mine[:, None] & h_ok[None, :]  # (BN, BH)
    row_ok3 = mine[:, None, None] & hc_ok[None, :, :]  # (BN, BH, BC)
    row_ok3k = mine[:, None, None] & hck_ok[None, :, :]  # (BN, BH, BCK)
    k_j = _score_operand(k, node, offs_h, hck, row_ok2, row_ok3k, H, CK,
                         SCORE)  # (BN, BH) or (BN, BH, BCK)
    att_h = _attention_vector(att, hck, hck_ok, SCORE)  # (BH, BCK)
    v_j = _rows(v, node, hc, row_ok3, H, C)  # (BN, BH, BC)

    if SCORE == ADDITIVE:
        dk_j = tl.full([BLOCK_N, BLOCK_H], 0, tl.float32)
    else:
        dk_j = tl.full([BLOCK_N, BLOCK_H, BLOCK_CK], 0, tl.float32)
    dv_j = tl.full([BLOCK_N, BLOCK_H, BLOCK_C], 0, tl.float32)
    for t in range(0, _max(degree, axis=0)):
        dk_terms, dv_terms = _source_tile(
            k_j, v_j, q, bias, att_h, drop, edge_key, edge_value, dout, lse, delta, dalpha,
            row_t, eid_t, start + t, t < degree, offs_h, hc, hck, h_ok, hc_ok, hck_ok, scale,
            slope, cap, H, C, CK, SCORE, HAS_CAP, HAS_BIAS, HAS_DROP, HAS_EK, HAS_EV, HAS_DALPHA)
        dk_j += dk_terms
        dv_j += dv_terms
    if SCORE == ADDITIVE:
        tl.store(dk + node[:, None] * H + offs_h[None, :], dk_j.to(dk.dtype.element_ty),
                 mask=row_ok2)
    else:
        tl.store(dk + node[:, None, None] * (H * CK) + hck[None, :, :],
                 (dk_j * scale * att_h).to(dk.dtype.element_ty), mask=row_ok3k)
    tl.store(dv + node[:, None, None] * (H * C) + hc[None, :, :], dv_j.to(dv.dtype.element_ty),
             mask=row_ok3)


# Block-sparse kernels (``graphattn.functional.triton_blocks``). The graph is cut into
# B x B tiles of (targets, sources); a program owns one block of B targets (the forward and
# dq) or of B sources (dk and dv) and one head, and walks the tiles of its block that hold an
# edge, whose edges are bits of ``bits`` ``[P, B, B // 32]`` (bit j % 32 of word j // 32 of
# row i: the edge from source j to target i of the tile). Scores are B x B matrix products.
# The grid is one axis, heads fastest: the H programs of a block run side by side, so each
# cache line of its rows (which holds several heads' channels) is fetched once for all of them.


@triton.jit
def _block_and_head(H: tl.constexpr):
    """The block and the head of this program, in a grid of (blocks x H), heads fastest."""
    pid = tl.program_id(0)
    return (pid // H).to(tl.int64), pid % H


@triton.jit
def _tile_bits(bits, pair, TRANSPOSED: tl.constexpr, BLOCK: tl.constexpr):
    """The edges of tile ``pair`` as a bool ``(B, B)``, (targets, sources), or (sources,
    targets) when ``TRANSPOSED``: B // 32 loads of B words each, one word per target row and
    32 sources, each spread over the 32 sources it covers."""
    r = tl.arange(0, BLOCK)
    edges = tl.full([BLOCK, BLOCK], 0, tl.int32)
    for w in tl.static_range(BLOCK // 32):
        word = tl.load(bits + pair * (BLOCK * BLOCK // 32) + r * (BLOCK // 32) + w)  # (B)
        if TRANSPOSED:  # word of target column i, source rows j
            covered = (r[:, None] // 32) == w
            bit = (word[None, :] >> (r[:, None] % 32)) & 1
        else:  # word of target row i, source columns j
            covered = (r[None, :] // 32) == w
            bit = (word[:, None] >> (r[None, :] % 32)) & 1
        edges = tl.where(covered, bit, edges)
    return edges != 0


@triton.jit
def _block_rows(ptr, block, head, n, H: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr,
                BLOCK_C: tl.constexpr, dtype: tl.constexpr):
    """Rows ``block * B ...`` of head ``head`` of an ``[n, H, C]`` tensor as ``(B, BC)`` in
    ``dtype`` (0 beyond n and C), their offsets and mask."""
    rows = block * BLOCK + tl.arange(0, BLOCK)
    offs_c = tl.arange(0, BLOCK_C)
    at = rows[:, None] * (H * C) + head * C + offs_c[None, :]
    ok = (rows < n)[:, None] & (offs_c < C)[None, :]
    return tl.load(ptr + at, mask=ok, other=0.0).to(dtype), at, ok


@triton.jit
def _tile_ids(ids, pair, TRANSPOSED: tl.constexpr, HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    """The edge id of each entry of tile ``pair`` (``ids`` ``[P, B, B]``, -1 off the edges) as
    int32 ``(B, B)`` (widened where an address is made: E H may pass 2^31), transposed as
    :func:`_tile_bits`; zeros, nothing read, unless ``HAS_IDS`` (a bias or a dropout mask,
    read at these ids)."""
    if HAS_IDS:
        r = tl.arange(0, BLOCK)
        if TRANSPOSED:
            at = r[None, :] * BLOCK + r[:, None]
        else:
            at = r[:, None] * BLOCK + r[None, :]
        edge = tl.load(ids + pair * (BLOCK * BLOCK) + at)
    else:
        edge = tl.full([BLOCK, BLOCK], 0, tl.int32)
    return edge


@triton.jit
def _tile_scores(a, b, bias, edge, edges, head, scale, H: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """``scale * a b^T`` plus the bias of each edge (``edge``: the tile's edge ids), -inf off
    the edges ``edges``: the scores of a tile, ``(B, B)`` fp32 (a = q, b = k; or a = k,
    b = q for a transposed tile)."""
    s = tl.dot(a, tl.trans(b), input_precision=PRECISION) * scale
    if HAS_BIAS:
        s += tl.load(bias + edge.to(tl.int64) * H + head, mask=edges, other=0.0).to(tl.float32)
    return tl.where(edges, s, float("-inf"))


@triton.jit
def _dropped(x, drop, edge, edges, head, H: tl.constexpr, HAS_DROP: tl.constexpr):
    """``x`` ``(B, B)`` times each edge's dropout multiplier (``drop``: a mask ``[E, H]`` read
    at the tile's edge ids, or a seeded mask's parameters, see :func:`_dropout_multipliers`; 0
    off the edges), or ``x`` itself without dropout."""
    if HAS_DROP:
        x = x * _dropout_multipliers(drop, edge.to(tl.int64) * H + head, edges)
    return x


@triton.jit
def _target_block_tile(q_i, k, v, bias, col, bits, ids, pair, head, n_src, scale,
                       H: tl.constexpr, C: tl.constexpr, CV: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_IDS: tl.constexpr, BLOCK: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_CV: tl.constexpr, PRECISION: tl.constexpr,
                       dtype: tl.constexpr):
    """Tile ``pair`` seen from its target block (queries ``q_i``): the keys and values of its
    source block, its edges, their ids and its scores ``(B targets, B sources)``."""
    source_block = tl.load(col + pair).to(tl.int64)
    k_j, _, _ = _block_rows(k, source_block, head, n_src, H, C, BLOCK, BLOCK_C, dtype)
    v_j, _, _ = _block_rows(v, source_block, head, n_src, H, CV, BLOCK, BLOCK_CV, dtype)
    edges = _tile_bits(bits, pair, False, BLOCK)
    edge = _tile_ids(ids, pair, False, HAS_IDS, BLOCK)
    s = _tile_scores(q_i, k_j, bias, edge, edges, head, scale, H, HAS_BIAS, PRECISION)
    return k_j, v_j, edges, edge, s


@triton.jit
def block_forward_kernel(q, k, v, bias, drop, ptr, col, bits, ids, out, lse, scores, n_dst,
                         n_src, scale, sinks, H: tl.constexpr, C: tl.constexpr,
                         CV: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROP: tl.constexpr,
                         NEED_SCORES: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_CV: tl.constexpr, PRECISION: tl.constexpr,
                         HAS_SINKS: tl.constexpr = False):
    """Grid (target blocks x H). Online softmax over the tiles ``ptr[b]:ptr[b + 1]`` of target
    block b (``col``: their source blocks), as :func:`forward_kernel` over edges: writes
    ``out`` ``[N_dst, H, C_v]`` (fp32 for backward; in inference, the dtype of v) and ``lse``
    ``[N_dst, H, 2]`` in its conventions, and with ``NEED_SCORES`` each edge's score at its id
    in ``scores`` ``[E, H]`` (fp32); the weights multiply the values after their dropout
    (``HAS_DROP``), not in the sum. With ``HAS_SINKS``, each row's softmax starts at its head's
    sink, ``sinks`` ``[H]`` (fp32), as in :func:`forward_kernel`."""
    block, head = _block_and_head(H)
    dtype = q.dtype.element_ty
    q_i, _, _ = _block_rows(q, block, head, n_dst, H, C, BLOCK, BLOCK_C, dtype)
    heads = tl.full([BLOCK], 0, tl.int32) + head  # (BLOCK): every row's head
    m, l_sum = _softmax_start(sinks, heads, heads >= 0, HAS_SINKS)
    acc = tl.full([BLOCK, BLOCK_CV], 0, tl.float32)
    # int64: the tile's edge ids start at pair * B^2, past 2^31 from 2^21 tiles of 32 x 32
    for pair in range(tl.load(ptr + block).to(tl.int64), tl.load(ptr + block + 1).to(tl.int64)):
        # the keys are in the scores already (the compiler drops them)
        k_j, v_j, edges, edge, s = _target_block_tile(
            q_i, k, v, bias, col, bits, ids, pair, head, n_src, scale, H, C, CV, HAS_BIAS,
            HAS_BIAS or HAS_DROP or NEED_SCORES, BLOCK, BLOCK_C, BLOCK_CV, PRECISION, dtype)
        if NEED_SCORES:
            tl.store(scores + edge.to(tl.int64) * H + head, s, mask=edges)
        m_new = tl.maximum(m, _max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no shift
        rescale = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * rescale + _sum(p, axis=1)
        p = _dropped(p, drop, edge, edges, head, H, HAS_DROP)
        acc = acc * rescale[:, None] + tl.dot(p.to(dtype), v_j, input_precision=PRECISION)
        m = m_new
    l_safe, m_out, log_l = _weights_and_stats(l_sum, m)
    rows = block * BLOCK + tl.arange(0, BLOCK)
    offs_cv = tl.arange(0, BLOCK_CV)
    tl.store(out + rows[:, None] * (H * CV) + head * CV + offs_cv[None, :],
             (acc / l_safe[:, None]).to(out.dtype.element_ty),
             mask=(rows < n_dst)[:, None] & (offs_cv < CV)[None, :])
    at = rows * H + head
    tl.store(lse + at * 2, m_out, mask=rows < n_dst)
    tl.store(lse + at * 2 + 1, log_l, mask=rows < n_dst)


@triton.jit
def block_backward_target_kernel(q, k, v, bias, drop, ptr, col, bits, ids, dout, lse, delta,
                                 dq, dbias, n_dst, n_src, scale, H: tl.constexpr,
                                 C: tl.constexpr, CV: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 HAS_DROP: tl.constexpr, NEED_DBIAS: tl.constexpr,
                                 BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                                 BLOCK_CV: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (target blocks x H): dq of the block, ``scale * sum_j ds_ij k_j`` with
    ``ds = alpha (d dout_i . v_j - delta_i)`` (d the dropout multiplier, 1 without), over the
    tiles of the block; and d bias, ds at each edge's id, written once, by the program of its
    target."""
    block, head = _block_and_head(H)
    dtype = q.dtype.element_ty
    q_i, at_q, ok_q = _block_rows(q, block, head, n_dst, H, C, BLOCK, BLOCK_C, dtype)
    do_i, _, _ = _block_rows(dout, block, head, n_dst, H, CV, BLOCK, BLOCK_CV, dtype)
    rows = block * BLOCK + tl.arange(0, BLOCK)
    m, log_l = _softmax_stats(lse, rows * H + head, rows < n_dst)
    delta_i = tl.load(delta + rows * H + head, mask=rows < n_dst, other=0.0)
    acc = tl.full([BLOCK, BLOCK_C], 0, tl.float32)
    # int64: the tile's edge ids start at pair * B^2, past 2^31 from 2^21 tiles of 32 x 32
    for pair in range(tl.load(ptr + block).to(tl.int64), tl.load(ptr + block + 1).to(tl.int64)):
        k_j, v_j, edges, edge, s = _target_block_tile(
            q_i, k, v, bias, col, bits, ids, pair, head, n_src, scale, H, C, CV, HAS_BIAS,
            HAS_BIAS or HAS_DROP, BLOCK, BLOCK_C, BLOCK_CV, PRECISION, dtype)
        # 0 off the edges, also in a row whose m is NaN (a NaN score on one of its edges)
        alpha = tl.where(edges, _softmax_weights(s, m[:, None], log_l[:, None]), 0.0)
        dp = tl.dot(do_i, tl.trans(v_j), input_precision=PRECISION)
        dp = _dropped(dp, drop, edge, edges, head, H, HAS_DROP)
        ds = tl.where(edges, alpha * (dp - delta_i[:, None]), 0.0)  # (B targets, B sources)
        if NEED_DBIAS:
            tl.store(dbias + edge.to(tl.int64) * H + head, ds.to(dbias.dtype.element_ty),
                     mask=edges)
        acc += tl.dot(ds.to(dtype), k_j, input_precision=PRECISION)
    tl.store(dq + at_q, (acc * scale).to(dq.dtype.element_ty), mask=ok_q)


@triton.jit
def block_backward_source_kernel(q, k, v, bias, drop, tptr, tpair, row, bits, ids, dout, lse,
                                 delta, dk, dv, n_dst, n_src, scale, H: tl.constexpr,
                                 C: tl.constexpr, CV: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 HAS_DROP: tl.constexpr, BLOCK: tl.constexpr,
                                 BLOCK_C: tl.constexpr, BLOCK_CV: tl.constexpr,
                                 PRECISION: tl.constexpr):
    """Grid (source blocks x H): dk and dv of the block over its tiles
    (``tpair[tptr[b]:tptr[b + 1]]``, whose target blocks are ``row``), in tiles of (sources,
    targets): ``dv_j = sum_i d_ij alpha_ij dout_i``, ``dk_j = scale * sum_i ds_ij q_i`` (d the
    dropout multiplier, 1 without)."""
    block, head = _block_and_head(H)
    dtype = q.dtype.element_ty
    k_j, at_k, ok_k = _block_rows(k, block, head, n_src, H, C, BLOCK, BLOCK_C, dtype)
    v_j, at_v, ok_v = _block_rows(v, block, head, n_src, H, CV, BLOCK, BLOCK_CV, dtype)
    acc_k = tl.full([BLOCK, BLOCK_C], 0, tl.float32)
    acc_v = tl.full([BLOCK, BLOCK_CV], 0, tl.float32)
    for t in range(tl.load(tptr + block), tl.load(tptr + block + 1)):
        pair = tl.load(tpair + t).to(tl.int64)
        target_block = tl.load(row + pair).to(tl.int64)
        q_i, _, _ = _block_rows(q, target_block, head, n_dst, H, C, BLOCK, BLOCK_C, dtype)
        do_i, _, _ = _block_rows(dout, target_block, head, n_dst, H, CV, BLOCK, BLOCK_CV,
                                 dtype)
        rows = target_block * BLOCK + tl.arange(0, BLOCK)
        m, log_l = _softmax_stats(lse, rows * H + head, rows < n_dst)
        delta_i = tl.load(delta + rows * H + head, mask=rows < n_dst, other=0.0)
        edges = _tile_bits(bits, pair, True, BLOCK)
        edge = _tile_ids(ids, pair, True, HAS_BIAS or HAS_DROP, BLOCK)
        s = _tile_scores(k_j, q_i, bias, edge, edges, head, scale, H, HAS_BIAS,
                         PRECISION)  # (B sources, B targets)
        alpha = tl.where(edges, _softmax_weights(s, m[None, :], log_l[None, :]), 0.0)
        alpha_d = _dropped(alpha, drop, edge, edges, head, H, HAS_DROP)
        acc_v += tl.dot(alpha_d.to(dtype), do_i, input_precision=PRECISION)
        dp = tl.dot(v_j, tl.trans(do_i), input_precision=PRECISION)
        ds = tl.where(edges, alpha_d * dp - alpha * delta_i[None, :], 0.0)
        acc_k += tl.dot(ds.to(dtype), q_i, input_precision=PRECISION)
    tl.store(dk + at_k, (acc_k * scale).to(dk.dtype.element_ty), mask=ok_k)
    tl.store(dv + at_v, acc_v.to(dv.dtype.element_ty), mask=ok_v)
