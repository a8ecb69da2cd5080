"""A deterministic, resumable stream of prompt batches over epochs.

Epoch `e` visits every prompt once, in an order that depends only on (seed, e). A batch that
reaches the end of an epoch is completed from the start of the next one, so every batch has
exactly `k` prompts (a batch may then hold the same prompt twice, as may any batch with `k`
larger than the dataset). The state is (epoch, position), normalised so that a finished epoch
reads as (e + 1, 0): resuming at an epoch boundary starts the next epoch instead of skipping
it or ending the run.
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence

from rollover.types import Prompt


class PromptIterator:
    def __init__(self, prompts: Sequence[Prompt], seed: int = 0, shuffle: bool = True):
        if not prompts:
            raise ValueError("PromptIterator needs at least one prompt")
        self.prompts = list(prompts)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into the current epoch's order
        self.prompts_served = 0
        self._fingerprint = _fingerprint(self.prompts)
        self._order = self._epoch_order(0)

    @property
    def epochs_drawn(self) -> float:
        """Prompts drawn so far over the prompts: passes over the data (the metric `data/epochs`)."""
        return self.prompts_served / len(self.prompts)

    def next_batch(self, k: int) -> list[Prompt]:
        """The next `k` prompts, crossing into the next epoch when this one runs out."""
        if k < 1:
            raise ValueError(f"batch size must be >= 1, got {k}")
        batch = []
        while len(batch) < k:
            take = min(k - len(batch), len(self.prompts) - self.position)
            batch += [self.prompts[i] for i in self._order[self.position : self.position + take]]
            self.position += take
            if self.position == len(self.prompts):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        self.prompts_served += k
        return batch

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
            "prompts_served": self.prompts_served,
            "num_prompts": len(self.prompts),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; refuses a state saved over other data or another seed, and is
        then left as it was."""
        self.check_state(state)
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.prompts_served = state["prompts_served"]
        self._order = self._epoch_order(self.epoch)

    def check_state(self, state: dict) -> None:
        """Raise ValueError saying why `state` was saved over other data, order or seed."""
        if state.get("mixed"):
            raise ValueError("iterator state was saved by a run mixing several sources (data.train_weights); "
                             "this run draws from one")
        if state["fingerprint"] != self._fingerprint or state["num_prompts"] != len(self.prompts):
            raise ValueError(
                f"iterator state was saved over different prompts ({state['num_prompts']} "
                f"prompts, fingerprint {state['fingerprint'][:12]}); this iterator has "
                f"{len(self.prompts)} prompts, fingerprint {self._fingerprint[:12]}"
            )
        if (state["seed"], state["shuffle"]) != (self.seed, self.shuffle):
            raise ValueError(
                f"iterator state has seed={state['seed']} shuffle={state['shuffle']}, this "
                f"iterator seed={self.seed} shuffle={self.shuffle}"
            )
        if not 0 <= state["position"] < len(self.prompts):
            raise ValueError(f"iterator state position {state['position']} out of range")

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(f"prompt-order:{self.seed}:{epoch}").shuffle(order)
        return order


def _fingerprint(prompts: list[Prompt]) -> str:
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(repr((p.id, p.text, p.messages, p.answer)).encode())
    return digest.hexdigest()


class MixedIterator:
    """Prompts from several sources at set weights (`data.train: {name: source}` with
    `data.train_weights`): each prompt of a batch comes from a source drawn at random in
    proportion to its weight (the draw depends only on the seed and how many prompts were drawn
    before it), then is the next of that source's own `PromptIterator` (its own epochs). The
    state is the draw count and every source's iterator state, so a resumed run draws on as if
    never stopped. A source's share of the prompts is its weight over the sum, whatever its size."""

    def __init__(self, sources: dict[str, Sequence[Prompt]], weights: dict[str, float], seed: int = 0,
                 shuffle: bool = True):
        if set(sources) != set(weights):
            raise ValueError(f"weights for {sorted(weights)}, sources {sorted(sources)}: name the same sources")
        self.names = sorted(sources)  # the order a config lists them in changes nothing
        self.iters = {n: PromptIterator(sources[n], seed=_seed_of(seed, n), shuffle=shuffle) for n in self.names}
        self.weights = [float(weights[n]) for n in self.names]
        self.seed = seed
        self.prompts_served = 0

    @property
    def prompts(self) -> list[Prompt]:
        """Every source's prompts, the sources in name order."""
        return [p for name in self.names for p in self.iters[name].prompts]

    @property
    def epochs_drawn(self) -> float:
        """Prompts drawn so far over every source's prompts."""
        return self.prompts_served / sum(len(it.prompts) for it in self.iters.values())

    def next_batch(self, k: int) -> list[Prompt]:
        if k < 1:
            raise ValueError(f"batch size must be >= 1, got {k}")
        out = []
        for _ in range(k):
            rng = random.Random(f"mix:{self.seed}:{self.prompts_served}")
            name = rng.choices(self.names, weights=self.weights)[0]
            out += self.iters[name].next_batch(1)
            self.prompts_served += 1
        return out

    def state_dict(self) -> dict:
        return {"mixed": True, "seed": self.seed, "weights": dict(zip(self.names, self.weights)),
                "prompts_served": self.prompts_served, "sources": {n: it.state_dict() for n, it in self.iters.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; refuses one saved over other sources, weights or seed, and is
        then left as it was."""
        self.check_state(state)  # every source checked before any moves
        for name, it in self.iters.items():
            it.load_state_dict(state["sources"][name])
        self.prompts_served = state["prompts_served"]

    def check_state(self, state: dict) -> None:
        """Raise ValueError saying why `state` was saved over other sources, weights or seed."""
        if not state.get("mixed"):
            raise ValueError("iterator state was saved by a single source; this run mixes several (data.train_weights)")
        mine = dict(zip(self.names, self.weights))
        if (state["seed"], state["weights"]) != (self.seed, mine):
            raise ValueError(f"iterator state has seed={state['seed']} weights={state['weights']}, this iterator "
                             f"seed={self.seed} weights={mine}")
        for name, it in self.iters.items():
            try:
                it.check_state(state["sources"][name])
            except ValueError as e:
                raise ValueError(f"source {name!r}: {e}") from None


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")
