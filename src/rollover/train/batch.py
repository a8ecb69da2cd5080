"""TrainBatch: a step's rollouts as tensors, and their packing into micro-batches.

Sequences (prompt + response) are packed first-fit-decreasing into rows of at most
`pack_length` tokens; rows go into micro-batches of at most `micro_batch_tokens` slots
(rows x the longest row). Inside a row every sequence restarts its position ids at 0, which
transformers turns into a block-diagonal causal mask, so packed sequences never attend to
each other. Padding is what remains in a micro-batch after its rows: `padding_fraction`
reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rollover.types import Rollout


@dataclass
class TrainBatch:
    """Per-sequence tensors of one step, padded to the longest response `[B, T]`."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    behav_logp_BT: Tensor  # engine logprobs (0 on padding)
    versions_BT: Tensor  # policy version of each token (-1 on padding)
    mask_BT: Tensor  # bool: token is trained
    adv_B: Tensor
    group_index_B: Tensor  # which group each sequence belongs to (0..G-1)

    @classmethod
    def from_rollouts(cls, rollouts: list[Rollout], advantages) -> "TrainBatch":
        """The batch of `rollouts`, with `advantages[i]` (a sequence or tensor of floats) as
        rollout i's advantage."""
        B = len(rollouts)
        if len(advantages) != B:
            raise ValueError(f"{len(advantages)} advantages for {B} rollouts")
        T = max((len(r.response_ids) for r in rollouts), default=0)
        behav = torch.zeros(B, T)
        versions = torch.full((B, T), -1, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.bool)
        groups: dict[str, int] = {}
        for i, r in enumerate(rollouts):
            n = len(r.response_ids)
            if not (n == len(r.logprobs) == len(r.versions) == len(r.loss_mask)):
                raise ValueError(f"rollout {i} of group {r.group_id!r}: per-token lists differ in length")
            behav[i, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
            versions[i, :n] = torch.tensor(r.versions, dtype=torch.long)
            mask[i, :n] = torch.tensor(r.loss_mask, dtype=torch.bool)
            groups.setdefault(r.group_id, len(groups))
        return cls(
            prompt_ids=[list(r.prompt_ids) for r in rollouts],
            response_ids=[list(r.response_ids) for r in rollouts],
            behav_logp_BT=behav,
            versions_BT=versions,
            mask_BT=mask,
            adv_B=torch.as_tensor(advantages, dtype=torch.float32).reshape(len(rollouts)),
            group_index_B=torch.tensor([groups[r.group_id] for r in rollouts], dtype=torch.long),
        )

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.mask_BT.sum())

    def select(self, idx: list[int]) -> "TrainBatch":
        """A sub-batch of sequences (e.g. a PPO mini-batch)."""
        t = torch.tensor(idx, dtype=torch.long)
        return TrainBatch(
            prompt_ids=[self.prompt_ids[i] for i in idx],
            response_ids=[self.response_ids[i] for i in idx],
            behav_logp_BT=self.behav_logp_BT[t],
            versions_BT=self.versions_BT[t],
            mask_BT=self.mask_BT[t],
            adv_B=self.adv_B[t],
            group_index_B=self.group_index_B[t],
        )


@dataclass
class MicroBatch:
    """One forward/backward: packed rows and where each response token sits in them."""

    seq_index: list[int]  # which sequences of the TrainBatch, in order 0..S-1 here
    input_ids: Tensor  # [R, L]
    position_ids: Tensor  # [R, L]
    sel_row: Tensor  # [N] row of the position whose logits predict a response token
    sel_col: Tensor  # [N]
    targets: Tensor  # [N] the response tokens
    tok_seq: Tensor  # [N] sequence (0..S-1) of each selected token
    tok_pos: Tensor  # [N] index in that sequence's response
    pad_tokens: int
    slots: int

    def to(self, device) -> "MicroBatch":
        return MicroBatch(
            self.seq_index, *(t.to(device) for t in (self.input_ids, self.position_ids, self.sel_row,
                                                     self.sel_col, self.targets, self.tok_seq, self.tok_pos)),
            self.pad_tokens, self.slots,
        )


def pack(batch: TrainBatch, *, pack_length: int, micro_batch_tokens: int, pad_id: int = 0) -> list[MicroBatch]:
    """First-fit-decreasing packing of sequences into rows, rows into micro-batches."""
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    for i, n in enumerate(lengths):
        if n > pack_length:
            raise ValueError(f"sequence {i} has {n} tokens, more than pack_length={pack_length}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(pack_length - lengths[i])
    # rows are in decreasing fill order; group consecutive rows into micro-batches
    micro: list[list[list[int]]] = []
    for row in rows:
        row_len = sum(lengths[i] for i in row)
        if micro:
            cur = micro[-1]
            longest = max(sum(lengths[i] for i in r) for r in cur)
            if (len(cur) + 1) * max(longest, row_len) <= micro_batch_tokens:
                cur.append(row)
                continue
        micro.append([row])
    return [_build(batch, mb, lengths, pad_id) for mb in micro]


def _build(batch: TrainBatch, rows: list[list[int]], lengths: list[int], pad_id: int) -> MicroBatch:
    L = max(sum(lengths[i] for i in row) for row in rows)
    R = len(rows)
    ids = torch.full((R, L), pad_id, dtype=torch.long)
    pos = torch.zeros((R, L), dtype=torch.long)
    seq_index: list[int] = []
    sel_row, sel_col, targets, tok_seq, tok_pos = [], [], [], [], []
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            s = len(seq_index)
            seq_index.append(i)
            p, resp = batch.prompt_ids[i], batch.response_ids[i]
            n = len(p) + len(resp)
            ids[r, col : col + n] = torch.tensor(p + resp, dtype=torch.long)
            pos[r, col : col + n] = torch.arange(n)
            for j in range(len(resp)):
                sel_row.append(r)
                sel_col.append(col + len(p) - 1 + j)
                targets.append(resp[j])
                tok_seq.append(s)
                tok_pos.append(j)
            col += n
        if col < L:  # padding: its own position run, so it forms a separate (ignored) segment
            pos[r, col:] = torch.arange(L - col)
    used = sum(lengths[i] for row in rows for i in row)
    as_t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return MicroBatch(
        seq_index, ids, pos, as_t(sel_row), as_t(sel_col), as_t(targets), as_t(tok_seq), as_t(tok_pos),
        pad_tokens=R * L - used, slots=R * L,
    )
