"""Triton kernels for fused tree verification, and their launchers.

Imported only through `draftsmith.runtime.kernels` (lazily, because it needs triton). In tests set
`TRITON_INTERPRET=1` before the first import: `triton.jit` decides at decoration time whether a
kernel is compiled or interpreted.

Shapes: B trees, N node slots per tree (node 0 = root, `parents[i] < i`), V vocabulary, S V-splits.

One verification step is two launches:

1. `_node_partials_kernel`, grid (B*N, S). Each program reduces one V-slice of one node's target
   logits to a partial: (max, lowest argmax) for greedy, (max, sum of exp) of the temperature-scaled
   logits for sampling. Splitting V keeps every SM busy when B*N is small (B=1 with a 10-node tree
   would otherwise read 152k logits per node on ~10 SMs); the partials are tiny ([B*N, S] floats).
2. `_greedy_tree_kernel` or `_sample_tree_kernel`, grid (B,). One program per tree combines the S
   partials of every node and writes every output at once: best node, accepted length, path
   (KV-cache indices to keep), accepted tokens and the bonus token. Greedy acceptance is
   data-parallel over the nodes (pointer jumping up the parent links, O(log N) steps on
   [N, N] one-hot tiles). Sampling is a walk by nature (each decision depends on the previous
   residual): the program walks the tree with scalar state, streams a V-long row only when a draft
   token is rejected (the residual distribution) and once for the bonus draw (inverse CDF).

Nothing here synchronises across programs, so the interpreter (which runs programs one after
another) exercises the same logic the GPU runs. Within the sampling program, V-long scratch rows
written by one thread and read by another are separated by a barrier.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from draftsmith.runtime.kernels import VerifyWorkspace

# Whether the kernels below were decorated in interpreter mode (TRITON_INTERPRET=1 at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# triton.jit decides at decoration time, and triton's own library (tl.max, tl.sum, ...) is decorated
# when triton is first imported - which torch and transformers do early. Interpreted kernels can
# only call an interpreted library, and compiled kernels a compiled one.
LIBRARY_INTERPRETED = type(tl.max).__name__ == "InterpretedFunction"
CONSISTENT = INTERPRETED == LIBRARY_INTERPRETED

# Partial kinds written by `_node_partials_kernel`.
_GREEDY = 0
_SAMPLE = 1


# --------------------------------------------------------------------------------------------
# Small helpers (inlined into the kernels).
# --------------------------------------------------------------------------------------------


@triton.jit
def _combine_partials(
    part_a_ptr, part_b_ptr, row0, offs, valid, SPLITS, V, KIND: tl.constexpr, BLOCK_S: tl.constexpr
):
    """Combine the S partials of every node of one tree.

    part_a/part_b are [B*N, SPLITS]; rows row0 + offs. Returns two [BLOCK_N] vectors:
    greedy: (max logit, lowest argmax); sample: (max scaled logit, sum of exp(x - max)).
    """
    s = tl.arange(0, BLOCK_S)
    ptrs = (row0 + offs)[:, None] * SPLITS + s[None, :]
    mask = valid[:, None] & (s < SPLITS)[None, :]
    a = tl.load(part_a_ptr + ptrs, mask=mask, other=float("-inf"))
    m = tl.max(a, axis=1)
    if KIND == 0:
        idx = tl.load(part_b_ptr + ptrs, mask=mask, other=V)
        # Splits are ordered by vocabulary position, so the lowest index among the maxima is
        # torch.argmax's "first occurrence".
        best = tl.min(tl.where(a == m[:, None], idx, V), axis=1)
        return m, best
    else:
        ssum = tl.load(part_b_ptr + ptrs, mask=mask, other=0.0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(ssum * tl.exp(a - m_safe[:, None]), axis=1)
        return m, total


@triton.jit
def _write_outputs(
    b,
    offs,
    on_path,
    depth,
    tok,
    best,
    accept_len,
    bonus,
    accept_len_ptr,
    best_ptr,
    bonus_ptr,
    path_ptr,
    acc_tok_ptr,
    PATH_LEN,
    TOKEN_PAD,
    BLOCK_D: tl.constexpr,
):
    """Write one tree's results.

    on_path [BLOCK_N] (1 for root..best), depth [BLOCK_N] (depth of each on-path node), tok
    [BLOCK_N]. path[b, d] = node at depth d on the path (-1 past the end); accepted_tokens[b, d-1]
    = its token (TOKEN_PAD past the end). Path nodes have distinct depths, so a [BLOCK_D, BLOCK_N]
    match matrix turns the node set into an ordered row without a serial scatter.
    """
    d = tl.arange(0, BLOCK_D)
    hit = (on_path[None, :] != 0) & (depth[None, :] == d[:, None])
    path_row = tl.max(tl.where(hit, offs[None, :], -1), axis=1)
    tok_row = tl.sum(tl.where(hit, tok[None, :], 0), axis=1)
    tok_row = tl.where(path_row >= 0, tok_row, TOKEN_PAD)
    tl.store(path_ptr + b * PATH_LEN + d, path_row.to(tl.int64), mask=d < PATH_LEN)
    tl.store(
        acc_tok_ptr + b * (PATH_LEN - 1) + (d - 1),
        tok_row.to(tl.int64),
        mask=(d >= 1) & (d < PATH_LEN),
    )
    tl.store(accept_len_ptr + b, accept_len.to(tl.int64))
    tl.store(best_ptr + b, best.to(tl.int64))
    tl.store(bonus_ptr + b, bonus.to(tl.int64))


# --------------------------------------------------------------------------------------------
# Pass 1: per-node partial reductions over V.
# --------------------------------------------------------------------------------------------


@triton.jit
def _argmax_step(x, idx, run_val, run_idx):
    """Fold one block into per-lane running (max, index). A lane sees increasing indices, so the
    strict '>' keeps the first occurrence; the equality clause lets an all -inf row still report
    its first index, like torch.argmax."""
    take = (x > run_val) | ((x == run_val) & (idx < run_idx))
    return tl.where(take, x, run_val), tl.where(take, idx, run_idx)


@triton.jit
def _softmax_step(x, m, ssum):
    """Fold one block of scaled logits into a running (max, sum of exp(x - max))."""
    new_m = tl.maximum(m, tl.max(x, axis=0))
    # A block of only -inf leaves new_m at -inf; shifting by 0 then keeps exp() at 0 instead of
    # exp(-inf - -inf) = nan.
    shift = tl.where(new_m == float("-inf"), 0.0, new_m)
    return new_m, ssum * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)


@triton.jit
def _node_partials_kernel(
    logits_ptr,
    num_nodes_ptr,
    part_a_ptr,
    part_b_ptr,
    N,
    V,
    stride_lb,
    stride_ln,
    stride_lv,
    split_len,
    temperature,
    SPLITS,
    KIND: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One V-slice of one node. grid (B*N, SPLITS).

    KIND 0 (greedy): part_a = max logit, part_b = lowest index attaining it (V if none).
    KIND 1 (sample): part_a = max of logits / temperature, part_b = sum exp(x - part_a);
    -inf logits (filtered out by top-k / top-p) contribute nothing.
    Padding nodes (i >= num_nodes[b]) read nothing.
    """
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // N
    i = row - b * N
    n_b = tl.load(num_nodes_ptr + b).to(tl.int32)
    start = split * split_len
    stop = tl.minimum(start + split_len, V)
    stop = tl.where(i < n_b, stop, start)
    base = logits_ptr + b.to(tl.int64) * stride_lb + i.to(tl.int64) * stride_ln
    lanes = tl.arange(0, BLOCK_V)
    # Whole blocks load unmasked from block-aligned offsets (vector loads when the row stride is
    # aligned); the ragged end of the slice, at most one block, loads masked.
    full_stop = start + (stop - start) // BLOCK_V * BLOCK_V
    tail = full_stop + lanes
    in_tail = tail < stop
    if KIND == 0:
        # Per-lane running (max, index): one cross-lane reduction at the end instead of per block.
        # Compare in fp32, or fp64 for fp64 logits (part_a's dtype): narrowing fp64 could turn
        # two distinct maxima into a tie and change the argmax.
        cmp_dtype = part_a_ptr.dtype.element_ty
        run_val = tl.full([BLOCK_V], float("-inf"), cmp_dtype)
        run_idx = tl.full([BLOCK_V], V, tl.int32)
        for off in range(start, full_stop, BLOCK_V):
            idx = tl.max_contiguous(tl.multiple_of(off + lanes, BLOCK_V), BLOCK_V)
            x = tl.load(base + idx.to(tl.int64) * stride_lv).to(cmp_dtype)
            run_val, run_idx = _argmax_step(x, idx, run_val, run_idx)
        # Masked lanes carry index V, so they never win.
        x = tl.load(base + tail.to(tl.int64) * stride_lv, mask=in_tail, other=float("-inf"))
        run_val, run_idx = _argmax_step(x.to(cmp_dtype), tl.where(in_tail, tail, V), run_val, run_idx)
        m = tl.max(run_val, axis=0)
        am = tl.min(tl.where(run_val == m, run_idx, V), axis=0)
        tl.store(part_a_ptr + row * SPLITS + split, m)
        tl.store(part_b_ptr + row * SPLITS + split, am)
    else:
        m = tl.full([], float("-inf"), tl.float32)
        ssum = tl.zeros([], dtype=tl.float32)
        for off in range(start, full_stop, BLOCK_V):
            idx = tl.max_contiguous(tl.multiple_of(off + lanes, BLOCK_V), BLOCK_V)
            x = tl.load(base + idx.to(tl.int64) * stride_lv)
            m, ssum = _softmax_step(x.to(tl.float32) / temperature, m, ssum)
        x = tl.load(base + tail.to(tl.int64) * stride_lv, mask=in_tail, other=float("-inf"))
        m, ssum = _softmax_step(x.to(tl.float32) / temperature, m, ssum)
        tl.store(part_a_ptr + row * SPLITS + split, m)
        tl.store(part_b_ptr + row * SPLITS + split, ssum)


# --------------------------------------------------------------------------------------------
# Pass 2 (greedy): acceptance, best path, bonus.
# --------------------------------------------------------------------------------------------


@triton.jit
def _greedy_tree_kernel(
    tokens_ptr,
    parents_ptr,
    num_nodes_ptr,
    part_a_ptr,
    part_b_ptr,
    accept_len_ptr,
    best_ptr,
    bonus_ptr,
    path_ptr,
    acc_tok_ptr,
    N,
    V,
    stride_tb,
    stride_tn,
    stride_pb,
    stride_pn,
    PATH_LEN,
    TOKEN_PAD,
    SPLITS,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LOG_N: tl.constexpr,
):
    """One tree per program. grid (B,). LOG_N = log2(BLOCK_N).

    Node i >= 1 is accepted iff tokens[i] == argmax(target_logits[parents[i]]) and its parent is
    accepted. best = deepest accepted node (lowest index on ties), bonus = argmax at best.
    """
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    n_b = tl.load(num_nodes_ptr + b).to(tl.int32)
    valid = offs < n_b
    tok = tl.load(tokens_ptr + b * stride_tb + offs * stride_tn, mask=valid, other=0)
    par = tl.load(parents_ptr + b * stride_pb + offs * stride_pn, mask=valid, other=-1).to(tl.int32)
    _, amax = _combine_partials(part_a_ptr, part_b_ptr, b * N, offs, valid, SPLITS, V, 0, BLOCK_S)

    # Node i's own test: its token against the argmax at its parent (a one-hot gather).
    at_parent = par[:, None] == offs[None, :]  # [BLOCK_N, BLOCK_N], row i hot at parents[i]
    pred = tl.sum(tl.where(at_parent, amax[None, :], 0), axis=1)
    accepted = ((offs == 0) | (valid & (par >= 0) & (tok == pred))).to(tl.int32)
    # Pointer jumping: after k rounds `accepted` ANDs the tests of 2^k nearest ancestors-or-self
    # and `depth` counts the edges jumped, so LOG_N rounds settle every node in O(log N)
    # data-parallel steps instead of a serial walk over N nodes.
    depth = (par >= 0).to(tl.int32)
    jump = par
    for _ in tl.static_range(LOG_N):
        hot = jump[:, None] == offs[None, :]
        has = jump >= 0
        accepted = tl.where(has, accepted * tl.sum(tl.where(hot, accepted[None, :], 0), axis=1), accepted)
        depth = tl.where(has, depth + tl.sum(tl.where(hot, depth[None, :], 0), axis=1), depth)
        jump = tl.where(has, tl.sum(tl.where(hot, jump[None, :], 0), axis=1), jump)

    best_depth = tl.max(tl.where(accepted != 0, depth, -1), axis=0)
    best = tl.min(tl.where((accepted != 0) & (depth == best_depth), offs, BLOCK_N), axis=0)

    # Mark root..best by walking up from best.
    on_path = (offs == best).to(tl.int32)
    cur = best
    for _ in range(best_depth):
        cur = tl.sum(tl.where(offs == cur, par, 0), axis=0)
        on_path = tl.where(offs == cur, 1, on_path)

    bonus = tl.sum(tl.where(offs == best, amax, 0), axis=0)
    _write_outputs(
        b, offs, on_path, depth, tok, best, best_depth, bonus,
        accept_len_ptr, best_ptr, bonus_ptr, path_ptr, acc_tok_ptr, PATH_LEN, TOKEN_PAD, BLOCK_D,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Pass 2 (sampling): recursive rejection sampling along the tree, bonus draw.
# --------------------------------------------------------------------------------------------


@triton.jit
def _sample_tree_kernel(
    tokens_ptr,
    parents_ptr,
    num_nodes_ptr,
    logits_ptr,
    draft_ptr,
    part_a_ptr,
    part_b_ptr,
    uniforms_ptr,
    stats_ptr,
    ws_p_ptr,
    ws_q_ptr,
    accept_len_ptr,
    best_ptr,
    bonus_ptr,
    path_ptr,
    acc_tok_ptr,
    temperature,
    B,
    N,
    V,
    stride_tb,
    stride_tn,
    stride_pb,
    stride_pn,
    stride_lb,
    stride_ln,
    stride_lv,
    stride_db,
    stride_dn,
    stride_dv,
    stride_ub,
    stride_un,
    PATH_LEN,
    TOKEN_PAD,
    SPLITS,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
):
    """One tree per program. grid (B,). The rules are verify.py's (multi-candidate recursive
    rejection sampling without replacement):

    At node `cur`, p starts as softmax(logits[cur] / T) (logits already at -inf where top-k / top-p
    removed a token) and q = draft_probs[cur]. Children are tried in index order: child c with
    token x is accepted iff u[c] * q(x) < p(x) and q(x) > 0, and the walk moves to c. On rejection
    p <- norm(max(p - q, 0)) (unless that is all zero: p stays) and q <- norm(q with q(x) = 0).
    When no child is left, the bonus is drawn from p by inverse CDF with u[N].
    DETERMINISTIC (fixed candidates): q is the point mass at the child being tested, so q(x) = 1,
    the residual is p without x, and draft_probs is never read.

    uniforms [B, N+1]. Scratch, all fp32: stats [2, B*N] (per-node softmax max and sum);
    ws_p [2, B, V] (the unnormalised residual p, ping-pong so that an all-zero residual can fall
    back to the previous p) and ws_q [B, V] (the sibling-free q), only touched after a rejection;
    their sums are carried in zp / zq.
    """
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, BLOCK_V)
    # Scalar flags enter lane masks as `lane0 + flag == k`: the interpreter mis-types a scalar
    # bool broadcast into `vector & scalar` (the compiled kernel folds the add away).
    lane0 = tl.zeros([BLOCK_V], dtype=tl.int32)
    n_b = tl.load(num_nodes_ptr + b).to(tl.int32)
    valid = offs < n_b
    tok = tl.load(tokens_ptr + b * stride_tb + offs * stride_tn, mask=valid, other=0)
    par = tl.load(parents_ptr + b * stride_pb + offs * stride_pn, mask=valid, other=-1).to(tl.int32)
    row_max, row_sum = _combine_partials(
        part_a_ptr, part_b_ptr, b * N, offs, valid, SPLITS, V, 1, BLOCK_S
    )
    # Park the per-node softmax stats in scratch: the walk reads one node's pair with two scalar
    # loads when it moves, instead of a cross-lane reduction to pick it out of registers.
    tl.store(stats_ptr + b * N + offs, row_max, mask=valid)
    tl.store(stats_ptr + B * N + b * N + offs, row_sum, mask=valid)
    tl.debug_barrier()
    m_cur = tl.load(stats_ptr + b * N)
    s_cur = tl.load(stats_ptr + B * N + b * N)
    ws_q_row = ws_q_ptr + b.to(tl.int64) * V
    plane = B * V.to(tl.int64)  # distance between the two ws_p buffers

    # Flags and sums are assigned typed scalars, never Python literals: the interpreter would keep a
    # literal as a Python bool/int, and masks built from it would not be tensors.
    zero = tl.zeros([], dtype=tl.int32)
    one = zero + 1
    one_f = tl.full([], 1.0, tl.float32)
    cur = tl.zeros([], dtype=tl.int32)
    last = tl.zeros([], dtype=tl.int32)  # children already tried have index <= last
    depth = tl.zeros([], dtype=tl.int32)
    resid = tl.zeros([], dtype=tl.int32)  # 1: p lives in ws_p[pbuf] (a rejection happened at cur)
    pbuf = tl.zeros([], dtype=tl.int32)
    qmod = tl.zeros([], dtype=tl.int32)  # 1: q lives in ws_q (a sibling was removed)
    zp = tl.full([], 1.0, tl.float32)
    zq = tl.full([], 1.0, tl.float32)
    done = tl.zeros([], dtype=tl.int32)
    steps = tl.zeros([], dtype=tl.int32)
    on_path = (offs == 0).to(tl.int32)
    path_depth = tl.zeros([BLOCK_N], dtype=tl.int32)

    # Every iteration accepts or rejects one node, or stops: at most n_b iterations.
    while (done == 0) & (steps <= n_b):
        steps += 1
        c = tl.min(tl.where(valid & (par == cur) & (offs > last), offs, BLOCK_N), axis=0)
        if c == BLOCK_N:
            done = 1
        else:
            x = tl.load(tokens_ptr + b * stride_tb + c * stride_tn).to(tl.int64)
            logit_row = logits_ptr + b.to(tl.int64) * stride_lb + cur.to(tl.int64) * stride_ln
            draft_row = draft_ptr + b.to(tl.int64) * stride_db + cur.to(tl.int64) * stride_dn
            p_row = ws_p_ptr + pbuf.to(tl.int64) * plane + b.to(tl.int64) * V
            # The division guard mirrors verify.py: an all-zero q stays all zero.
            zq_div = tl.where(zq > 0, zq, 1.0)
            lx = tl.load(logit_row + x * stride_lv, mask=resid == 0, other=float("-inf"))
            p_x = tl.where(
                resid == 1,
                tl.load(p_row + x, mask=resid == 1, other=0.0) / zp,
                tl.exp(lx.to(tl.float32) / temperature - m_cur) / s_cur,
            )
            if DETERMINISTIC:
                q_x = one_f
            else:
                q_x = tl.where(
                    qmod == 1,
                    tl.load(ws_q_row + x, mask=qmod == 1, other=0.0) / zq_div,
                    tl.load(draft_row + x * stride_dv, mask=qmod == 0, other=0.0).to(tl.float32),
                )
            u = tl.load(uniforms_ptr + b * stride_ub + c * stride_un).to(tl.float32)
            # Multiplied out like verify.py, so nothing divides; a child of q(x) = 0 (past q's
            # support) is never accepted, and its rejection leaves p as it is.
            if (u * q_x < p_x) & (q_x > 0):
                cur = c
                last = c
                m_cur = tl.load(stats_ptr + b * N + c)
                s_cur = tl.load(stats_ptr + B * N + b * N + c)
                depth += 1
                resid = zero
                qmod = zero
                zp = one_f
                zq = one_f
                on_path = tl.where(offs == c, 1, on_path)
                path_depth = tl.where(offs == c, depth, path_depth)
            else:
                # Rejected: one pass over V writes the residual into the other p buffer and the
                # sibling-free q in place (each lane rewrites only what it read).
                r_row = ws_p_ptr + (1 - pbuf).to(tl.int64) * plane + b.to(tl.int64) * V
                new_zp = 0.0
                new_zq = 0.0
                for off in range(0, V, BLOCK_V):
                    v = off + lanes
                    inb = v < V
                    lv = tl.load(
                        logit_row + v.to(tl.int64) * stride_lv,
                        mask=inb & (lane0 + resid == 0),
                        other=float("-inf"),
                    )
                    p = tl.where(
                        resid == 1,
                        tl.load(p_row + v, mask=inb & (lane0 + resid == 1), other=0.0) / zp,
                        tl.exp(lv.to(tl.float32) / temperature - m_cur) / s_cur,
                    )
                    if DETERMINISTIC:
                        q = tl.where(v == x, 1.0, 0.0)
                    else:
                        q = tl.where(
                            qmod == 1,
                            tl.load(ws_q_row + v, mask=inb & (lane0 + qmod == 1), other=0.0) / zq_div,
                            tl.load(
                                draft_row + v.to(tl.int64) * stride_dv, mask=inb & (lane0 + qmod == 0), other=0.0
                            ).to(tl.float32),
                        )
                    r = tl.where(inb, tl.maximum(p - q, 0.0), 0.0)
                    tl.store(r_row + v, r, mask=inb)
                    new_zp += tl.sum(r, axis=0)
                    qn = tl.where(inb & (v != x), q, 0.0)
                    tl.store(ws_q_row + v, qn, mask=inb)
                    new_zq += tl.sum(qn, axis=0)
                # Later passes read what this one wrote, possibly from other threads.
                tl.debug_barrier()
                if new_zp > 0:
                    pbuf = 1 - pbuf
                    zp = new_zp
                    resid = one
                zq = new_zq
                qmod = one
                last = c

    # Bonus: inverse CDF over the current p (residual or the target at cur), unnormalised.
    logit_row = logits_ptr + b.to(tl.int64) * stride_lb + cur.to(tl.int64) * stride_ln
    p_row = ws_p_ptr + pbuf.to(tl.int64) * plane + b.to(tl.int64) * V
    total = tl.where(resid == 1, zp, s_cur)
    target = tl.load(uniforms_ptr + b * stride_ub + N * stride_un).to(tl.float32) * total
    running = 0.0
    found = V
    off = 0
    while (off < V) & (found == V):
        v = off + lanes
        inb = v < V
        lv = tl.load(
            logit_row + v.to(tl.int64) * stride_lv, mask=inb & (lane0 + resid == 0), other=float("-inf")
        )
        w = tl.where(
            resid == 1,
            tl.load(p_row + v, mask=inb & (lane0 + resid == 1), other=0.0),
            tl.exp(lv.to(tl.float32) / temperature - m_cur),
        )
        w = tl.where(inb, w, 0.0)
        cdf = tl.cumsum(w, axis=0) + running
        # The first token whose CDF passes the target; a token of mass zero never does.
        found = tl.min(tl.where((cdf > target) & (w > 0), v, V), axis=0)
        running += tl.sum(w, axis=0)
        off += BLOCK_V
    # Rounding can leave the summed CDF just below the target: take the last live token, as
    # verify.py does. Rare, so it gets its own backward scan.
    off = (V + BLOCK_V - 1) // BLOCK_V * BLOCK_V
    while (found == V) & (off > 0):
        off -= BLOCK_V
        v = off + lanes
        inb = v < V
        lv = tl.load(
            logit_row + v.to(tl.int64) * stride_lv, mask=inb & (lane0 + resid == 0), other=float("-inf")
        )
        w = tl.where(
            resid == 1,
            tl.load(p_row + v, mask=inb & (lane0 + resid == 1), other=0.0),
            tl.exp(lv.to(tl.float32) / temperature - m_cur),
        )
        last_live = tl.max(tl.where(inb & (w > 0), v, -1), axis=0)
        found = tl.where(last_live >= 0, last_live, V)
    bonus = found

    _write_outputs(
        b, offs, on_path, path_depth, tok, cur, depth, bonus,
        accept_len_ptr, best_ptr, bonus_ptr, path_ptr, acc_tok_ptr, PATH_LEN, TOKEN_PAD, BLOCK_D,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launchers.
# --------------------------------------------------------------------------------------------


# Compiled launch configuration (tests/unit/test_kernel_compile.py builds the same ones).
# Pass 1 streams 4096 logits per block with 8 warps: 16 per thread, two 16-byte loads in bf16.
PARTIALS_BLOCK_V = 4096
PARTIALS_WARPS = 8
# The sampling walk streams V only on a rejection and for the bonus draw.
WALK_BLOCK_V = 2048
SAMPLE_WARPS = 8


def tree_meta(N: int, path_len: int, splits: int) -> dict:
    """Compile-time sizes of the per-tree kernels for N node slots, D+1 = path_len, S splits."""
    block_n = max(16, triton.next_power_of_2(N))
    return dict(
        BLOCK_N=block_n,
        BLOCK_S=max(2, triton.next_power_of_2(splits)),
        BLOCK_D=max(16, triton.next_power_of_2(path_len)),
    )


def greedy_warps(block_n: int) -> int:
    """The greedy tree kernel holds a few [BLOCK_N, BLOCK_N] tiles: more warps for big trees."""
    return 4 if block_n <= 64 else 8 if block_n <= 128 else 16


def _block_sizes() -> tuple[int, int]:
    """(BLOCK_V for pass 1, BLOCK_V for the sampling walk)."""
    if INTERPRETED:
        # Small blocks make the tiny test vocabularies span several blocks and splits.
        return 16, 16
    return PARTIALS_BLOCK_V, WALK_BLOCK_V


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(device: torch.device, rows: int, V: int, block_v: int) -> int:
    """How many V-slices pass 1 uses: enough programs to fill the GPU (4 per SM), each slice at
    least 4 blocks long so the partials stay negligible."""
    if INTERPRETED:
        # Interpreted programs run one after another; tests ask for splits explicitly.
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    want = triton.cdiv(4 * _sm_count(index), max(rows, 1))
    most = max(1, triton.cdiv(V, 4 * block_v))
    return max(1, min(want, most, 64))


def _empty(workspace: VerifyWorkspace | None, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device) if workspace is None else workspace.take(name, shape, dtype, device)


def _outputs(B: int, path_len: int, device: torch.device, workspace: VerifyWorkspace | None = None):
    def out(name: str, *shape: int) -> torch.Tensor:
        return _empty(workspace, name, shape, torch.long, device)

    return (
        out("accept_len", B),
        out("best", B),
        out("bonus", B),
        out("path", B, path_len),
        out("accepted_tokens", B, max(path_len - 1, 0)),
    )


def _partials(logits: torch.Tensor, num_nodes: torch.Tensor, kind: int, temperature: float, splits=None, workspace: VerifyWorkspace | None = None):
    B, N, V = logits.shape
    block_v, _ = _block_sizes()
    if splits is None:
        splits = _num_splits(logits.device, B * N, V, block_v)
    # Each split covers whole blocks so only the last one has a ragged end.
    split_len = triton.cdiv(triton.cdiv(V, splits), block_v) * block_v
    splits = triton.cdiv(V, split_len)
    a_dtype = torch.float64 if (kind == _GREEDY and logits.dtype == torch.float64) else torch.float32
    part_a = _empty(workspace, "part_a", (B * N, splits), a_dtype, logits.device)
    b_dtype = torch.int32 if kind == _GREEDY else torch.float32
    part_b = _empty(workspace, "part_b", (B * N, splits), b_dtype, logits.device)
    _node_partials_kernel[(B * N, splits)](
        logits, num_nodes, part_a, part_b, N, V,
        logits.stride(0), logits.stride(1), logits.stride(2),
        split_len, float(temperature), splits,
        KIND=kind, BLOCK_V=block_v, num_warps=PARTIALS_WARPS,
    )  # fmt: skip
    return part_a, part_b, splits


def greedy(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    target_logits: torch.Tensor,
    path_len: int,
    token_pad: int,
    splits: int | None = None,
    workspace: VerifyWorkspace | None = None,
):
    """Fused greedy verification.

    tokens, parents [B,N] (long), num_nodes [B] (any integer dtype: the kernels read it as int32),
    target_logits [B,N,V] (any float dtype, any strides). Returns (accept_len [B], best [B], bonus
    [B], path [B,path_len], accepted_tokens [B,path_len-1]), all long; with a `workspace`, its
    buffers (nothing allocated when the shapes repeat).
    """
    B, N, V = target_logits.shape
    part_a, part_b, splits = _partials(target_logits, num_nodes, _GREEDY, 1.0, splits, workspace)
    outs = _outputs(B, path_len, target_logits.device, workspace)
    meta = tree_meta(N, path_len, splits)
    _greedy_tree_kernel[(B,)](
        tokens, parents, num_nodes, part_a, part_b, *outs[:3], outs[3], outs[4],
        N, V, tokens.stride(0), tokens.stride(1), parents.stride(0), parents.stride(1),
        path_len, token_pad, splits, **meta,
        LOG_N=meta["BLOCK_N"].bit_length() - 1,
        num_warps=greedy_warps(meta["BLOCK_N"]),
    )  # fmt: skip
    return outs


def sample(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    logits: torch.Tensor,
    temperature: float,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    path_len: int,
    token_pad: int,
    splits: int | None = None,
    workspace: VerifyWorkspace | None = None,
):
    """Fused speculative-sampling verification.

    logits [B,N,V]: target logits with filtered-out tokens already at -inf; the kernel divides by
    `temperature` (> 0). draft_probs [B,N,V], or None for fixed candidates (each child tested as
    a point mass); uniforms [B,N+1] (verify.py's layout: column c tests node c, column N draws the
    bonus). Returns the same tuple as `greedy` (with a `workspace`, its buffers).
    """
    deterministic = draft_probs is None
    if deterministic:
        # Never read (DETERMINISTIC is a compile-time branch); any tensor serves as the pointer.
        draft_probs = logits
    B, N, V = logits.shape
    part_a, part_b, splits = _partials(logits, num_nodes, _SAMPLE, temperature, splits, workspace)
    outs = _outputs(B, path_len, logits.device, workspace)
    stats = _empty(workspace, "stats", (2, B * N), torch.float32, logits.device)
    ws_p = _empty(workspace, "ws_p", (2, B, V), torch.float32, logits.device)
    ws_q = _empty(workspace, "ws_q", (B, V), torch.float32, logits.device)
    _, block_v = _block_sizes()
    _sample_tree_kernel[(B,)](
        tokens, parents, num_nodes, logits, draft_probs, part_a, part_b, uniforms, stats, ws_p, ws_q,
        *outs[:3], outs[3], outs[4], float(temperature), B, N, V,
        tokens.stride(0), tokens.stride(1), parents.stride(0), parents.stride(1),
        logits.stride(0), logits.stride(1), logits.stride(2),
        draft_probs.stride(0), draft_probs.stride(1), draft_probs.stride(2),
        uniforms.stride(0), uniforms.stride(1),
        path_len, token_pad, splits, **tree_meta(N, path_len, splits),
        BLOCK_V=block_v,
        DETERMINISTIC=deterministic,
        num_warps=SAMPLE_WARPS,
    )  # fmt: skip
    return outs
