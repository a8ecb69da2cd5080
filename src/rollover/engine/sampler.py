"""Token sampling and the logprob each token is reported with.

The reported logprob is the log-probability of the token under the distribution it was
actually drawn from:

- temperature T > 0: `log_softmax(logits / T)`, restricted to the top-k / top-p set and
  renormalised over it when either is active. With `top_k=0, top_p=1` (the RL default) this is
  exactly `log_softmax(logits / T)[token]`, which is what a trainer computes when it divides its
  logits by the same temperature.
- greedy (T = 0): the distribution is a point mass, so its logprob would be 0 for every token
  and useless as a behaviour logprob; greedy tokens report `log_softmax(logits)[token]`
  (temperature 1) instead.

Sampling is inverse-CDF with one uniform number per token. For a seeded request that number
comes from a CPU generator seeded by `(seed, response position)` (on every device), so a sequence's tokens do not
depend on which other sequences share its batch, nor on how often it was aborted and resumed.
"""

from __future__ import annotations

import torch

from rollover.types import SamplingParams

_MIX = 0x9E3779B97F4A7C15


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the noise of the token at `position` of a seeded sequence."""
    x = (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEEB86659FD9) & (2**64 - 1)
    x ^= x >> 29
    return x & (2**63 - 1)


def _truncate(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus set of one row [V] to -inf."""
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
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        # seeded rows draw on the CPU whatever the device: one draw per row costs a few kernel
        # launches on a GPU, and a CPU draw is the same number on every machine
        self.row_gen = torch.Generator()

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] float32 -> (tokens [B], logprobs [B]).

        `positions[b]` is the response index of the token being sampled (for seeded noise).
        """
        B, V = logits.shape
        temps = [p.temperature for p in params]
        if all(t == 1.0 for t in temps):
            z = logits
        else:  # greedy rows keep temperature-1 logits (see the module docstring)
            t = torch.tensor([x if x > 0 else 1.0 for x in temps], device=logits.device, dtype=logits.dtype)
            z = logits / t[:, None]
        for b, p in enumerate(params):
            if p.temperature > 0 and (p.top_k or p.top_p < 1.0):
                if z is logits:
                    z = logits.clone()
                z[b] = _truncate(z[b], p.top_k, p.top_p)
        greedy = [p.temperature == 0 for p in params]
        if all(greedy):
            tokens = z.argmax(-1)
            return tokens, torch.log_softmax(z, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        # Inverse-CDF sampling over exp(z - max): one uniform per row (cheap, and seedable per row).
        zmax = z.max(-1, keepdim=True).values
        cdf = (z - zmax).exp_().cumsum_(-1)  # [B, V]; ATen accumulates a float cumsum in double on CPU
        total = cdf[:, -1]
        u = torch.empty(B, dtype=torch.float64, device=logits.device)
        unseeded = [b for b, p in enumerate(params) if p.temperature > 0 and p.seed is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self.gen, dtype=torch.float64, device=logits.device)
        seeded = [b for b, p in enumerate(params) if p.temperature > 0 and p.seed is not None]
        if seeded:
            draws = []
            for b in seeded:
                self.row_gen.manual_seed(position_seed(params[b].seed, positions[b]))
                draws.append(torch.rand(1, generator=self.row_gen, dtype=torch.float64))
            u[seeded] = torch.cat(draws).to(logits.device)
        # right=True: the first index whose cdf exceeds u*total, never a zero-probability token
        target = (u * total.double()).to(cdf.dtype)
        tokens = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=V - 1)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy, device=logits.device), z.argmax(-1), tokens)
        # log_softmax(z)[token] = z[token] - max - log(sum exp(z - max))
        logprobs = z.gather(1, tokens[:, None]).squeeze(1) - zmax.squeeze(1) - total.log()
        return tokens, logprobs
