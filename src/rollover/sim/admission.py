"""Which waiting requests a fast-path worker admits at a step boundary (`rollover.sim.fleet`),
with `SimCore`'s prefill rule: the queue is taken in order into free rows while the prefill
budget lasts. A prefill key is a fresh sample's prompt (a group's samples prefill it once) or
a resumed sample's own tokens; the keys already entering at this boundary are paid for; the
first candidate whose prefill would overrun what is left stops admission, unless nothing
has been admitted (the first always goes in). Before that, with a K/V-cache capacity, the first
candidate that leaves no room for its tokens and one more token of every row stops it.

`plan_py` evaluates the rule on numpy arrays for all planned workers at once; `plan_nb` is a
numba-compiled loop over workers and candidates (no per-worker sorts or key matrices). Both
return, per worker, (distinct keys, their prefill tokens, the longest key, how many are
admitted); tests/test_sim_fast.py checks that they agree, and `simulate.router` picks one as
it picks the router (`rollover.sim.route`).
"""

from __future__ import annotations

import numpy as np

from rollover.sim.route import _jit


def _keys(fleet, sids: np.ndarray, carried: np.ndarray) -> np.ndarray:
    return np.where(carried == 0, fleet.s_prompt[np.maximum(sids, 0)], -10 - sids)


def plan_py(fleet, idx: np.ndarray):
    """The rule on arrays; also the candidates (m x F: the first F waiting of each worker)."""
    f, P = fleet, fleet.prompt_tokens
    m = len(idx)
    n_keys = np.zeros(m, dtype=np.int64)
    key_tokens = np.zeros(m, dtype=np.int64)
    longest = np.zeros(m, dtype=np.int64)
    # the prompts entering at this boundary already (admitted since the last step): their keys
    rows_ent = np.nonzero(f.n_ent[idx])[0]
    if len(rows_ent):
        w = idx[rows_ent]
        sid = f.sid[w]
        ent = (f.entered[w] == f.wstep[w][:, None]) & (sid >= 0)
        ent_carried = np.where(ent, f.entered[w] - f.born[w], 0)
        ent_keys = np.where(ent, _keys(f, sid, ent_carried), -1)
        order = np.argsort(ent_keys, axis=1, kind="stable")
        srt = np.take_along_axis(ent_keys, order, axis=1)
        tok = np.take_along_axis(np.where(ent, P + ent_carried, 0), order, axis=1)
        first = (srt != -1) & np.concatenate([np.ones((len(w), 1), bool), srt[:, 1:] != srt[:, :-1]], axis=1)
        n_keys[rows_ent] = first.sum(axis=1)
        key_tokens[rows_ent] = (first * tok).sum(axis=1)
        longest[rows_ent] = (first * tok).max(axis=1)
    budget = f.max_prefill - key_tokens - f.pre_recompute[idx]
    take = np.minimum(f.max_rows[idx] - f.rows[idx], f.qn[idx])
    F = int(take.max()) if m else 0
    admit = np.zeros(m, dtype=np.int64)
    if F == 0:
        return n_keys, key_tokens, longest, admit, None
    cols = np.arange(F)
    pos = (f.qh[idx][:, None] + cols[None, :]) % f.qcap
    cand = f.qs[idx[:, None], pos]
    valid = cols[None, :] < take[:, None]
    carried = np.where(valid, f.s_tok[cand], 0)
    keys = np.where(valid, _keys(f, cand, carried), -2 - cols[None, :])
    need = P + carried
    # a key's first candidate in each row (by a stable sort: the earliest among equals)
    order = np.argsort(keys, axis=1, kind="stable")
    srt = np.take_along_axis(keys, order, axis=1)
    first = np.ones((m, F), dtype=bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    new_key = np.empty((m, F), dtype=bool)
    np.put_along_axis(new_key, order, first, axis=1)
    new_key &= valid
    if len(rows_ent):  # not a key already entering
        new_key[rows_ent] &= ~(keys[rows_ent, :, None] == ent_keys[:, None, :]).any(axis=2)
    spent = np.cumsum(new_key * need, axis=1) - new_key * need  # budget used before each candidate
    keys_before = (n_keys[:, None] > 0) | (cols[None, :] > 0)
    stop = valid & keys_before & (need > budget[:, None] - spent)
    if f.has_kv:  # each row holds its own tokens: the K/V taken by the candidates before each
        held = np.cumsum(valid * need, axis=1) - valid * need
        stop |= valid & (f.ctx[idx][:, None] + held + need + f.rows[idx][:, None] + cols[None, :] + 1
                         > f.kv[idx][:, None])
    admit = np.where(stop.any(axis=1), stop.argmax(axis=1), take)
    got = new_key & (cols[None, :] < admit[:, None])
    n_keys = n_keys + got.sum(axis=1)
    key_tokens = key_tokens + (got * need).sum(axis=1)
    longest = np.maximum(longest, (got * need).max(axis=1))
    return n_keys, key_tokens, longest, admit, cand


@_jit
def _plan_nb(idx, sid, entered, born, wstep, n_ent, s_prompt, s_tok, qs, qh, qn, max_rows, rows, pre_recompute,
             max_prefill, P, seen, ctx, kv):
    m, R, qcap = idx.shape[0], sid.shape[1], qs.shape[1]
    n_keys = np.zeros(m, np.int64)
    key_tokens = np.zeros(m, np.int64)
    longest = np.zeros(m, np.int64)
    admit = np.zeros(m, np.int64)
    for i in range(m):
        w = idx[i]
        nk = 0
        kt = 0
        lg = 0
        if n_ent[w] > 0:
            for c in range(R):
                s = sid[w, c]
                if s < 0 or entered[w, c] != wstep[w]:
                    continue
                car = entered[w, c] - born[w, c]
                if car == 0:  # a fresh sample: its prompt's key, once
                    p = s_prompt[s]
                    if seen[p]:
                        continue
                    seen[p] = True
                nk += 1
                kt += P + car
                lg = max(lg, P + car)
        budget = max_prefill - kt - pre_recompute[w]
        take = min(max_rows[w] - rows[w], qn[w])
        a = take
        spent = 0
        held = 0
        any_before = nk > 0
        for j in range(take):
            s = qs[w, (qh[w] + j) % qcap]
            need = P + s_tok[s]
            if ctx[w] + held + need + rows[w] + j + 1 > kv[w]:  # no K/V room (kv: BIG without a capacity)
                a = j
                break
            held += need
            if (any_before or j > 0) and need > budget - spent:
                a = j
                break
            new = True
            if s_tok[s] == 0:
                p = s_prompt[s]
                new = not seen[p]
                seen[p] = True
            if new:
                spent += need
                nk += 1
                kt += need
                lg = max(lg, need)
        n_keys[i] = nk
        key_tokens[i] = kt
        longest[i] = lg
        admit[i] = a
        # clear the marks for the next worker
        if n_ent[w] > 0:
            for c in range(R):
                s = sid[w, c]
                if s >= 0 and entered[w, c] == wstep[w]:
                    seen[s_prompt[s]] = False
        for j in range(a):
            seen[s_prompt[qs[w, (qh[w] + j) % qcap]]] = False
    return n_keys, key_tokens, longest, admit


def plan_nb(fleet, idx: np.ndarray):
    """`plan_py`'s rule compiled; the candidates only as far as the most admitted."""
    f = fleet
    if f.seen is None:  # one mark per prompt, all clear between calls
        f.seen = np.zeros(len(f.home), dtype=np.bool_)
    n_keys, key_tokens, longest, admit = _plan_nb(
        idx, f.sid, f.entered, f.born, f.wstep, f.n_ent, f.s_prompt, f.s_tok, f.qs, f.qh, f.qn, f.max_rows, f.rows,
        f.pre_recompute, np.int64(f.max_prefill), np.int64(f.prompt_tokens), f.seen, f.ctx, f.kv)
    F = int(admit.max()) if len(admit) else 0
    if F == 0:
        return n_keys, key_tokens, longest, admit, None
    pos = (f.qh[idx][:, None] + np.arange(F)[None, :]) % f.qcap
    return n_keys, key_tokens, longest, admit, f.qs[idx[:, None], pos]


def wait_for_batch(fleet, idx: np.ndarray, admit: np.ndarray, cand) -> np.ndarray:
    """SimCore._plan's wait for a batch: with rows decoding and none entering, fewer than
    admit_batch admissible requests wait, at most admit_max_wait steps from the boundary
    where the wait began, unless the prefill budget is what holds the rest back. Returns
    the steps each worker still waits (0: it admits now)."""
    rows, qn = fleet.rows[idx], fleet.qn[idx]
    free = np.minimum(fleet.max_rows[idx] - rows, qn)
    budget_held = (admit > 0) & (admit < free)
    if budget_held.any() and fleet.has_kv:  # stopped by the K/V room, not by the budget
        r = np.nonzero(budget_held)[0]
        got = np.arange(cand.shape[1])[None, :] < admit[r, None]
        taken = (got * (fleet.prompt_tokens + fleet.s_tok[cand[r]])).sum(axis=1)
        nxt = fleet.qs[idx[r], (fleet.qh[idx[r]] + admit[r]) % fleet.qcap]
        need = fleet.prompt_tokens + fleet.s_tok[nxt]
        budget_held[r] = fleet.ctx[idx[r]] + taken + need + rows[r] + admit[r] + 1 <= fleet.kv[idx[r]]
    wait = (admit > 0) & (fleet.n_ent[idx] == 0) & (rows > 0) & (admit < fleet.admit_batch[idx]) & ~budget_held
    began = fleet.deferred_from[idx]
    began = np.where(wait & (began < 0), fleet.wstep[idx], began)
    left = np.where(wait, np.maximum(0, fleet.admit_max_wait - (fleet.wstep[idx] - began)), 0)
    admits = (left == 0) & (admit > 0)
    fleet.deferred_from[idx] = np.where(admits | (qn == 0) | (rows == fleet.max_rows[idx]), -1, began)
    return left


# ---------------------------------------------------------------------------- admitting
def admit_py(fleet, idx: np.ndarray, cand: np.ndarray, admit: np.ndarray) -> None:
    """Put each worker's first `admit` candidates into its free rows, in queue order."""
    f = fleet
    free = (f.sid[idx] < 0) & f.usable[idx]
    rank = np.cumsum(free, axis=1) - 1
    put = free & (rank < admit[:, None])
    r, c = np.nonzero(put)
    w = idx[r]
    s = cand[r, rank[r, c]]
    carried = f.s_tok[s]
    f.sid[w, c] = s
    f.born[w, c] = f.wstep[w] - carried
    f.entered[w, c] = f.wstep[w]
    order = np.lexsort((c, r))  # rows fill in queue order
    f.seq[w[order], c[order]] = f.admitted[0] + np.arange(len(order))
    f.admitted[0] += len(order)
    f.fin[w, c] = f.born[w, c] + f.s_target[s]
    np.minimum.at(f.next_fin, w, f.fin[w, c])
    f.n_ent[idx] += admit
    first = carried == 0
    f.s_v0[s[first]] = f.version  # a resumed sample's first token is older
    f.rows[idx] += admit
    tokens = np.bincount(w, weights=f.prompt_tokens + carried, minlength=f.W).astype(np.int64)
    f.ctx += tokens
    f.ent_ctx += tokens
    f.qh[idx] = (f.qh[idx] + admit) % f.qcap
    f.qn[idx] -= admit


@_jit
def _admit_nb(idx, cand, admit, sid, usable, s_tok, wstep, born, entered, seq, admitted, fin, s_target, next_fin,
              n_ent, s_v0, version, rows, ctx, ent_ctx, qh, qn, qcap, P):
    R = sid.shape[1]
    for i in range(idx.shape[0]):
        w, a = idx[i], admit[i]
        k = 0
        tokens = 0
        for c in range(R):  # free rows in order take the candidates in queue order
            if k == a:
                break
            if sid[w, c] >= 0 or not usable[w, c]:
                continue
            s = cand[i, k]
            car = s_tok[s]
            sid[w, c] = s
            born[w, c] = wstep[w] - car
            entered[w, c] = wstep[w]
            seq[w, c] = admitted[0]
            admitted[0] += 1
            fin[w, c] = born[w, c] + s_target[s]
            next_fin[w] = min(next_fin[w], fin[w, c])
            if car == 0:
                s_v0[s] = version  # a resumed sample's first token is older
            tokens += P + car
            k += 1
        n_ent[w] += a
        rows[w] += a
        ctx[w] += tokens
        ent_ctx[w] += tokens
        qh[w] = (qh[w] + a) % qcap
        qn[w] -= a


def admit(fleet, idx: np.ndarray, cand: np.ndarray, n: np.ndarray) -> None:
    """`admit_py`, compiled where the fleet compiles its loops."""
    f = fleet
    if not f.compiled:
        return admit_py(f, idx, cand, n)
    _admit_nb(idx, cand, n, f.sid, f.usable, f.s_tok, f.wstep, f.born, f.entered, f.seq, f.admitted, f.fin,
              f.s_target, f.next_fin, f.n_ent, f.s_v0, np.int64(f.version), f.rows, f.ctx, f.ent_ctx, f.qh, f.qn,
              np.int64(f.qcap), np.int64(f.prompt_tokens))
