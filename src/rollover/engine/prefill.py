"""The model runner's passes over prompts: `prefill` (whole sequences into cache rows) and
`mixed` (a decode step and new sequences' prefills in one forward pass). They share the padded
[N, T] attention layout; `ModelRunner.prefill` and `ModelRunner.mixed` call them.

Prefill runs sequences of one length as an [N, T] batch; where padding them to the longest would
waste more than `PACK_PREFILL_ABOVE - 1` of the work (APRIL's resumed prefixes, say), the
token-wise layers run on the tokens alone, packed, and only attention sees the padded layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rollover.engine.transfer import to_device

if TYPE_CHECKING:
    from rollover.engine.model_runner import ModelRunner

PACK_PREFILL_ABOVE = 1.1  # `prefill` packs its tokens when padding would make the batch this much larger


@torch.inference_mode()
def prefill(r: ModelRunner, rows: list[int], token_ids: list[list[int]]) -> torch.Tensor:
    """Run full sequences into cache rows (positions 0..len-1); logits of each last token [N, V].

    Sequences of one length run as an [N, T] batch. Where padding them to the longest would
    waste more than a tenth of the work (APRIL's resumed prefixes, say: prompt plus any part
    of a response), every token-wise layer runs on the tokens alone, packed, and only
    attention sees the padded [N, T] layout (the linear layers are most of a prefill)."""
    n = len(rows)
    lens_l = [len(t) for t in token_ids]
    lens = to_device(lens_l, torch.long, r.device)
    T, total = max(lens_l), sum(lens_l)
    packed = n * T > PACK_PREFILL_ABOVE * total
    pos = torch.arange(T, device=r.device)
    valid = pos[None, :] < lens[:, None]  # [N, T]
    # mask[b, 1, q, k]: causal and key not padding
    mask = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]
    mask = mask[:, None]
    rows_t = to_device(rows, torch.long, r.device)
    contiguous = rows == list(range(rows[0], rows[0] + n))
    if packed:
        ids = to_device([t for seq in token_ids for t in seq], torch.long, r.device)
        slot = to_device([i * T + j for i, n_i in enumerate(lens_l) for j in range(n_i)],
                         torch.long, r.device)  # each token's place in the padded [N * T]
        tok_pos = slot % T
        cos, sin = r.cos[tok_pos], r.sin_signed[tok_pos]
    else:
        ids = to_device([[*t, *[0] * (T - len(t))] for t in token_ids], torch.long, r.device)
        cos, sin = r.cos[:T], r.sin_signed[:T]

    def padded(t: torch.Tensor) -> torch.Tensor:  # [S, heads, D] -> [N, T, heads, D]
        return t if not packed else t.new_zeros((n * T, *t.shape[1:])).index_copy_(0, slot, t).unflatten(0, (n, T))

    x = F.embedding(ids, r.embed)
    g = r.n_heads // r.n_kv
    for li, L in enumerate(r.layers):
        h = r._norm(x, L["in_norm"])
        q, k, v = (padded(t) for t in r._qkv(L, h, cos, sin))  # [N, T, H|KV, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [N, KV, T, D]
        if contiguous:
            r.k_cache[li][rows[0] : rows[0] + n, :, :T] = k
            r.v_cache[li][rows[0] : rows[0] + n, :, :T] = v
        else:
            r.k_cache[li][rows_t, :, :T] = k
            r.v_cache[li][rows_t, :, :T] = v
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=g > 1
        )  # [N, H, T, D]
        o = o.transpose(1, 2).flatten(-2)
        if packed:
            o = o.flatten(0, 1)[slot]
        x = x + r._linear(o, L["o"])
        x = r._mlp(L, x)
    if packed:
        return r.logits(x[torch.cumsum(lens, 0) - 1])
    last = x[torch.arange(n, device=r.device), lens - 1]
    return r.logits(last)


@torch.inference_mode()
def mixed(r: ModelRunner, tokens: torch.Tensor, positions: torch.Tensor, rows: list[int],
          token_ids: list[list[int]]) -> torch.Tensor:
    """Decode rows 0..B-1 and prefill new sequences into `rows` in one forward pass.

    Every linear layer runs once over the decode tokens and all prefill tokens together, so
    the weights are read from memory once per step instead of twice — on a CPU, where a
    small-batch pass costs about as much as a full one, admitting a sequence this way is
    nearly free. Returns logits [B + len(rows), V]: the decode rows, then the last token of
    each prefilled sequence.
    """
    B = tokens.shape[0]
    dev = r.device
    lens = [len(t) for t in token_ids]
    ids_p = to_device([t for seq in token_ids for t in seq], torch.long, dev)
    pos_p = torch.cat([torch.arange(n, device=dev) for n in lens])
    x = torch.cat([F.embedding(tokens, r.embed), F.embedding(ids_p, r.embed)])  # [B + Np, hidden]
    all_pos = torch.cat([positions, pos_p])
    cos, sin = r.cos[all_pos], r.sin_signed[all_pos]
    setup = r.attention.setup(positions)
    g = r.n_heads // r.n_kv
    starts = [B + sum(lens[:i]) for i in range(len(lens))]
    for li, L in enumerate(r.layers):
        h = r._norm(x, L["in_norm"])
        q, k, v = r._qkv(L, h, cos, sin)  # [B + Np, H|KV, D]
        kc, vc = r.k_cache[li], r.v_cache[li]
        outs = [r.attention(kc, vc, q[:B], k[:B], v[:B], setup)]
        for row, st, n in zip(rows, starts, lens):
            kp, vp = k[st : st + n].transpose(0, 1), v[st : st + n].transpose(0, 1)  # [KV, n, D]
            kc[row, :, :n] = kp
            vc[row, :, :n] = vp
            o = F.scaled_dot_product_attention(q[st : st + n].transpose(0, 1)[None], kp[None], vp[None],
                                               is_causal=True, enable_gqa=g > 1)  # [1, H, n, D]
            outs.append(o[0].transpose(0, 1).reshape(n, -1))
        x = x + r._linear(torch.cat(outs), L["o"])
        x = r._mlp(L, x)
    last = to_device([st + n - 1 for st, n in zip(starts, lens)], torch.long, dev)
    return r.logits(torch.cat([x[:B], x[last]]))
