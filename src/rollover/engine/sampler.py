"""Token sampling and the logprob each token is reported with.

The reported logprob is the log-probability of the token under the distribution it was
actually drawn from:

- temperature T > 0: `log_softmax(logits / T)`, restricted to the min-p / top-k / top-p set and
  renormalised over it when one is active, after the repetition penalty when one is set. With
  none of them (the RL default) this is exactly `log_softmax(logits / T)[token]`, which is what
  a trainer computes when it divides its logits by the same temperature; with them the trainer's
  logprob differs from the behaviour logprob, and `actor/rollout_kl` shows by how much.
- greedy (T = 0): the distribution is a point mass, so its logprob would be 0 for every token
  and useless as a behaviour logprob; greedy tokens report `log_softmax(logits)[token]`
  (temperature 1) instead.

Sampling is inverse-CDF with one uniform number per token. For a seeded request that number
is a hash of `(seed, response position)` (`position_uniforms`, the same on every device and
computed for the whole batch at once), so a sequence's tokens do not depend on which other
sequences share its batch, nor on how often it was aborted and resumed.
"""

from __future__ import annotations

import numpy as np
import torch

from rollover.engine.transfer import to_device
from rollover.types import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MIX_POS, _MIX_ADD, _MIX_MUL = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEEB86659FD9
_MASK64 = 2**64 - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the noise of the token at `position` of a seeded sequence (vLLM's
    per-request seed; TorchEngine uses the same mix through `position_uniforms`)."""
    x = (seed * _MIX + position * _MIX_POS + _MIX_ADD) & _MASK64
    x ^= x >> 31
    x = (x * _MIX_MUL) & _MASK64
    x ^= x >> 29
    return x & (2**63 - 1)


def position_uniforms(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """The uniform number in [0, 1) of each seeded token (float64, on the CPU): the top 53 bits
    of `position_seed`'s 64-bit mix of (seed, position), computed for all rows at once."""
    s = np.array([x & _MASK64 for x in seeds], dtype=np.uint64)
    p = np.array([x & _MASK64 for x in positions], dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64, as in position_seed
        x = s * np.uint64(_MIX) + p * np.uint64(_MIX_POS) + np.uint64(_MIX_ADD)
        x ^= x >> np.uint64(31)
        x *= np.uint64(_MIX_MUL)
        x ^= x >> np.uint64(29)
    return torch.from_numpy((x >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def penalise(z_RV: torch.Tensor, seen: list[list[int]], penalties: list[float]) -> torch.Tensor:
    """Rows' logits [R, V] with the repetition penalty on the tokens each has seen (HF's and
    vLLM's rule: a positive logit divided by the row's penalty, any other multiplied by it); a
    new tensor. One scatter over all the rows' tokens, repeats and all."""
    rows = torch.tensor([r for r, ids in enumerate(seen) for _ in ids], dtype=torch.long)
    cols = torch.tensor([t for ids in seen for t in ids], dtype=torch.long)
    hit_RV = torch.zeros(z_RV.shape, dtype=torch.bool, device=z_RV.device)
    hit_RV[rows.to(z_RV.device), cols.to(z_RV.device)] = True
    p_R1 = torch.tensor(penalties, dtype=z_RV.dtype, device=z_RV.device)[:, None]
    return torch.where(hit_RV, torch.where(z_RV > 0, z_RV / p_R1, z_RV * p_R1), z_RV)


def _truncate(z: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Set logits outside the min-p, top-k and nucleus sets of one row [V] to -inf (min-p
    first, as vLLM: it keeps the tokens at least `min_p` times as likely as the likeliest)."""
    if min_p > 0.0:
        probs = torch.softmax(z, -1)
        z = z.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, descending=True)
        probs = torch.softmax(sorted_z, -1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (probs.cumsum(-1) - probs) >= top_p
        z = z.clone()
        z[order[drop]] = float("-inf")
    return z


class Sampler:
    """`kernels`: the runner's native kernels (`rollover.engine.cpu.native`) or None. With them, a
    batch without greedy or top-k / top-p rows (the RL rollout's) is drawn by a C loop with the
    same uniforms and the same method. Its exp and its sums round differently from torch's, so
    where a uniform falls within rounding of a token boundary the two pick neighbouring tokens
    (a review counted 5 of 2,048 draws at temperature 0.7 over 49,152 tokens before the kernel
    kept its exponentials; since then 0 of 2,048 at 0.7 and at 1 on random logits); each draw is
    from the same distribution, reported with its own logprob, and independent of the batch."""

    def __init__(self, device: torch.device, seed: int = 0, kernels=None):
        self.device = device
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.kernels = kernels

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int], tokens_of=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] float32 -> (tokens [B], logprobs [B]).

        `positions[b]` is the response index of the token being sampled (for seeded noise).
        `tokens_of(b)`: row b's prompt and response so far, asked for rows with a repetition penalty.
        """
        B, V = logits.shape
        penalised = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0]
        if penalised:
            if tokens_of is None:
                raise ValueError("a repetition penalty needs the rows' tokens (tokens_of)")
            logits = logits.clone()
            index = torch.tensor(penalised, dtype=torch.long, device=logits.device)
            logits[index] = penalise(logits[index], [tokens_of(b) for b in penalised],
                                     [params[b].repetition_penalty for b in penalised])
        # one pass over the rows (the per-step host cost matters on a GPU, where the rest is fast)
        temps, greedy, truncated, seeded, seeds, seed_pos, unseeded = [], [], [], [], [], [], []
        for b, p in enumerate(params):
            t = p.temperature
            temps.append(t if t > 0 else 1.0)  # greedy rows keep temperature-1 logits (module docstring)
            greedy.append(t == 0)
            if t > 0:
                if p.top_k or p.top_p < 1.0 or p.min_p > 0.0:
                    truncated.append(b)
                if p.seed is None:
                    unseeded.append(b)
                else:
                    seeded.append(b)
                    seeds.append(p.seed)
                    seed_pos.append(positions[b])
        if self.kernels is not None and not truncated and len(seeded) + len(unseeded) == B and logits.is_contiguous():
            temps_t = None if all(t == 1.0 for t in temps) else torch.tensor(temps, dtype=torch.float32)
            return self.kernels.sample(logits, temps_t, self._uniforms(B, seeded, seeds, seed_pos, unseeded))
        if all(t == 1.0 for t in temps):
            z = logits
        else:
            z = logits / to_device(temps, logits.dtype, logits.device)[:, None]
        for b in truncated:
            if z is logits:
                z = logits.clone()
            z[b] = _truncate(z[b], params[b].top_k, params[b].top_p, params[b].min_p)
        if not seeded and not unseeded:  # every row greedy
            tokens = z.argmax(-1)
            return tokens, torch.log_softmax(z, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        # Inverse-CDF sampling over exp(z - max): one uniform per row (cheap, and seedable per row).
        zmax = z.amax(-1, keepdim=True)  # not max(): that also finds the indices, 7x the time here
        cdf = (z - zmax).exp_().cumsum_(-1)  # [B, V]; ATen accumulates a float cumsum in double on CPU
        total = cdf[:, -1]
        u = self._uniforms(B, seeded, seeds, seed_pos, unseeded)
        # right=True: the first index whose cdf exceeds u*total; the target held below the total
        # (u near 1 can round up to it), so the token found is one where the cdf rises: never a
        # zero-probability token
        target = torch.minimum((u * total.double()).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
        tokens = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=V - 1)
        if len(seeded) + len(unseeded) < B:
            tokens = torch.where(to_device(greedy, torch.bool, logits.device), z.argmax(-1), tokens)
        # log_softmax(z)[token] = z[token] - max - log(sum exp(z - max))
        logprobs = z.gather(1, tokens[:, None]).squeeze(1) - zmax.squeeze(1) - total.log()
        return tokens, logprobs

    def _uniforms(self, B: int, seeded: list[int], seeds: list[int], seed_pos: list[int], unseeded: list[int]) -> torch.Tensor:
        """One uniform in [0, 1) per row [B] float64: seeded rows' from (seed, position), the
        others' from the sampler's generator (greedy rows' are not used)."""
        dev = self.device
        u_seeded = to_device(position_uniforms(seeds, seed_pos), torch.float64, dev) if seeded else None
        if seeded and len(seeded) == B:  # the RL rollout's case: every row seeded, no placing by index
            return u_seeded
        u = torch.empty(B, dtype=torch.float64, device=dev)
        if unseeded:
            u[to_device(unseeded, torch.long, dev)] = torch.rand(len(unseeded), generator=self.gen, dtype=torch.float64, device=dev)
        if seeded:
            u[to_device(seeded, torch.long, dev)] = u_seeded
        return u
