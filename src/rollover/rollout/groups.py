"""From prompts to scored groups: requests, rewards, shaping, advantages, filters.

These are the data-manager steps shared by every loop (sync, APRIL, async): they take typed
messages (`Completion`, `Group`, `Rollout`) and return typed messages.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from rollover.algos import compute_advantages, overlong_penalty
from rollover.algos.advantages import gdpo
from rollover.config import Config
from rollover.data.render import opens_reasoning
from rollover.envs.base import INSERTED_VERSION
from rollover.rewards import BatchRewards, RewardRunner
from rollover.rewards.registry import reward_weights
from rollover.types import Completion, Group, Prompt, Request, Rollout, SamplingParams


def sample_seed(run_seed: int, serial: int, j: int) -> int:
    """Seed of sample j of the serial-th prompt drawn in a run (reproducible across resume)."""
    return ((run_seed * 1_000_003 + serial) * 1_009 + j) % (2**62)


@dataclass
class PendingGroup:
    """A prompt's n samples while they are being generated (possibly over several steps)."""

    id: str
    prompt: Prompt
    prompt_ids: list[int]
    serial: int  # order in which the run drew this prompt
    n: int
    start_version: int
    done: dict[int, Completion] = field(default_factory=dict)  # finished samples
    partial: dict[int, Completion] = field(default_factory=dict)  # aborted, to be resumed
    budgets: list[int] | None = None  # per-sample max_new_tokens (benchmark workloads); None: config's
    episodes: dict | None = None  # multi-turn: sample j's LiveEpisode (made when first sent)
    max_turns: int | None = None  # multi-turn: this task's turn limit (dynamic length); None: env.max_turns
    resampled: int = 0  # multi-turn: failed episodes run again (env.resample_failed)
    media: object = None  # the prompt's images as the model takes them (`Media`); None: text only
    greedy_first: bool = False  # ReMax: sample 0 is the greedy answer whose reward is the baseline (not trained)

    def request_id(self, j: int) -> str:
        return f"{self.id}/{j}"

    def request(self, j: int, sampling: SamplingParams, run_seed: int) -> Request:
        from dataclasses import replace

        sp = replace(sampling, seed=sample_seed(run_seed, self.serial, j))
        if self.greedy_first and j == 0:
            sp = replace(sp, temperature=0.0)
        if self.budgets is not None:
            sp = replace(sp, max_new_tokens=self.budgets[j])
        if j in self.partial:
            return replace(self.partial[j].resume(sp), media=self.media)
        return Request(id=self.request_id(j), prompt_ids=list(self.prompt_ids), sampling=sp, media=self.media)

    @property
    def complete(self) -> bool:
        return len(self.done) == self.n


def sampling_from(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
                          repetition_penalty=r.repetition_penalty, max_new_tokens=r.max_new_tokens,
                          ignore_eos=r.ignore_eos, stop=tuple(r.stop))


def to_rollouts(group: PendingGroup, cfg: Config, tokenizer) -> Group:
    """A complete pending group as a `Group` of unscored rollouts (loss mask all ones, or off
    for truncated completions when `algorithm.mask_truncated`). The rollouts take over the
    completions' token lists and share one copy of the prompt's: a completion is a message its
    engine no longer holds, and nothing downstream changes these lists in place."""
    rollouts = []
    prompt_ids = list(group.prompt_ids)
    off = cfg.algorithm.mask_truncated
    for j in range(group.n):
        c = group.done[j]
        mask = [0 if off and c.finish == "length" else 1] * len(c.response_ids)
        rollouts.append(Rollout(
            group_id=group.id, prompt_ids=prompt_ids, response_ids=c.response_ids, logprobs=c.logprobs,
            versions=c.versions, loss_mask=mask, finish=c.finish,
            text=tokenizer.decode(c.response_ids, skip_special_tokens=True), media=group.media,
        ))
    return Group(id=group.id, prompt=group.prompt, prompt_ids=prompt_ids, rollouts=rollouts,
                 start_version=group.start_version, serial=group.serial,
                 opened_reasoning=opens_reasoning(tokenizer, prompt_ids))


def scored_groups(pending: list[PendingGroup], run, m) -> list[Group]:
    """Complete pending groups as scored `Group`s: single-turn samples by the reward functions
    (in one batch), episodes by their environment. A sample without a reward (a reward error
    under on_error=skip, a failed episode) keeps reward None, is counted in
    `m["reward_errors"]` (and per function) and leaves its group in `keep_group`;
    `m["reward_s"]` gets the scoring time."""
    from rollover.rollout.episodes import to_group

    if run.env_builder is not None:
        groups = []
        for pg in pending:
            trajectories = [pg.done[j] for j in range(pg.n)]
            m["reward_errors"] += sum(not t.ok for t in trajectories)
            groups.append(to_group(pg, trajectories))
        return _set_greedy_apart(pending, groups)
    groups = [to_rollouts(pg, run.cfg, run.tokenizer) for pg in pending]
    t0 = time.perf_counter()
    result = score_groups(groups, run.rewards, run.cfg)
    m["reward_s"] += time.perf_counter() - t0
    for fn, count in result.error_counts.items():
        m[f"rewards/{fn}/errors"] += count
        m[f"rewards/{fn}/timeouts"] += result.timeout_counts[fn]  # (a part of its errors)
        m["reward_errors"] += count
    return _set_greedy_apart(pending, groups)


def _set_greedy_apart(pending: list[PendingGroup], groups: list[Group]) -> list[Group]:
    """ReMax: each group's greedy answer (sample 0), scored with the others, leaves the samples
    for `Group.greedy`, so nothing downstream trains on it, counts it or learns from it."""
    for pg, g in zip(pending, groups):
        if pg.greedy_first:
            g.greedy = g.rollouts.pop(0)
    return groups


def observe_groups(run, pending: list[PendingGroup], groups: list[Group]) -> None:
    """What the run learns from scored groups for the prompts it draws next: the per-prompt
    history of `selection.policy` and the turn budgets of `env.dynamic_turns`. Schedules call
    it where their decisions are a function of the seeds (APRIL: when a score is taken in, not
    when the scoring thread finishes), so the prompts drawn next are too."""
    for pg, g in zip(pending, groups):
        if run.selection is not None:
            run.selection.observe(g, run.primary_reward, version=g.start_version)
        if run.turn_budget is not None and pg.episodes is not None:  # the samples' episodes, not ReMax's greedy one
            run.turn_budget.observe(pg.prompt.id, [pg.done[j] for j in range(int(pg.greedy_first), pg.n)])


MIN_SAMPLES = 2  # a group's baseline compares its samples: fewer survivors leave nothing to compare


# What `keep_group` counts of a step's output that does not train (per step, in every mode).
DROP_COUNTS = ("skipped_groups", "dropped_samples", "filtered_groups", "filtered_tokens", "reward_errors")


def keep_group(group: Group, cfg: Config, m, curate=None, primary: str | None = None) -> bool:
    """The group filters every schedule applies, in order: its failed samples (unscored) leave
    it (`dropped_samples`) and it trains on the rest, its baseline over them; a group left with
    fewer than two samples (or a group of one without its sample) is skipped
    (`skipped_groups`), as is a ReMax group whose greedy answer failed (no baseline); `curate(group)` may change it (the experience pool); with DAPO dynamic
    sampling a group whose rewards are all equal (with GDPO: each function's scores; with
    `dynamic_sampling_metric: accuracy`, whether each is right by `primary`) is filtered
    (`filtered_groups`, `filtered_tokens`)."""
    if cfg.algorithm.advantage == "remax" and (group.greedy is None or group.greedy.reward is None):
        m["skipped_groups"] += 1  # ReMax without a baseline: its greedy answer failed (or a group from before remax)
        return False
    failed = sum(r.reward is None for r in group.rollouts)
    if failed:
        group.rollouts = [r for r in group.rollouts if r.reward is not None]
        group.dropped += failed
        m["dropped_samples"] += failed
    if not trainable(group):
        m["skipped_groups"] += 1
        return False
    if curate is not None:
        curate(group)
    a = cfg.algorithm
    if a.dynamic_sampling and not (
            has_accuracy_variance(group, primary, cfg.reward.correct_threshold) if a.dynamic_sampling_metric == "accuracy"
            else has_variance(group, by_function=a.advantage == "gdpo")):
        m["filtered_groups"] += 1
        m["filtered_tokens"] += sum(len(r.response_ids) for r in group.rollouts)
        return False
    return True


def score_groups(groups: list[Group], runner: RewardRunner, cfg: Config) -> BatchRewards:
    """Fill in each rollout's reward and per-function scores (with overlong shaping)."""
    prompts = [g.prompt for g in groups for _ in g.rollouts]
    texts = [r.text for g in groups for r in g.rollouts]
    ids = [f"{g.id}/{j}" for g in groups for j in range(len(g.rollouts))]
    tokens = [r.response_ids for g in groups for r in g.rollouts]
    opened = [g.opened_reasoning for g in groups for _ in g.rollouts]
    result = runner.score(prompts, texts, sample_ids=ids, completion_ids=tokens, opened_reasoning=opened)
    flat = [r for g in groups for r in g.rollouts]
    a = cfg.algorithm
    for r, s in zip(flat, result.samples):
        r.scores = {k: v for k, v in s.scores.items() if v is not None}
        r.extras = dict(s.extras)
        r.reward = s.total
        if r.reward is not None and a.overlong_buffer:
            r.unshaped = r.reward  # what dynamic sampling compares: DAPO's filter is on the answers, not their lengths
            r.reward += float(overlong_penalty(torch.tensor([len(r.response_ids)]), max_len=cfg.rollout.max_new_tokens,
                                               buffer_len=a.overlong_buffer, penalty=a.overlong_penalty)[0])
    return result


def trainable(group: Group) -> bool:
    """Whether enough of the group's samples are scored to train on: two, or all of a group of
    one (its estimator needs no baseline). Failed samples (unscored) do not count."""
    scored = sum(r.reward is not None for r in group.rollouts)
    return scored >= min(MIN_SAMPLES, len(group.rollouts) + group.dropped)


def has_variance(group: Group, by_function: bool = False) -> bool:
    """DAPO dynamic sampling keeps groups whose rewards are not all equal, the greedy answer's among
    them under ReMax (`by_function`, for GDPO, which normalises each reward function in the group:
    where some function's scores differ). The rewards before overlong shaping, as DAPO filters on
    the answers' accuracy: a group all right (or all wrong) of different lengths is filtered too."""
    if by_function:
        names = {k for r in group.rollouts for k in r.scores}
        return any(len({r.scores[k] for r in group.rollouts if k in r.scores}) > 1 for k in names)
    samples = [*group.rollouts, *([group.greedy] if group.greedy is not None else [])]  # ReMax: against the greedy
    return len({r.reward if r.unshaped is None else r.unshaped for r in samples}) > 1


def has_accuracy_variance(group: Group, primary: str | None, threshold: float) -> bool:
    """Some of the group's samples (and a ReMax group's greedy answer) are right by reward
    function `primary` and `threshold`, and some are not (DAPO's filter)."""
    if primary is None:
        raise ValueError("dynamic_sampling_metric=accuracy needs the primary reward's name")
    samples = [*group.rollouts, *([group.greedy] if group.greedy is not None else [])]
    return len({(r.scores.get(primary) or 0.0) >= threshold for r in samples}) > 1


def group_advantages(groups: list[Group], cfg: Config) -> tuple[torch.Tensor, dict]:
    """Each rollout's advantage (flattened in group order) from its group's rewards, and the
    estimator's info."""
    flat = [r for g in groups for r in g.rollouts]
    if not flat:
        return torch.zeros(0), {}
    gid = torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts], dtype=torch.long)
    if cfg.algorithm.advantage == "gdpo":  # each function's scores, not their total
        weights = reward_weights(cfg.reward.functions)
        scores = torch.tensor([[r.scores.get(name, math.nan) for name in weights] for r in flat], dtype=torch.float32)
        return gdpo(scores, torch.tensor(list(weights.values()), dtype=torch.float32), gid)
    rewards = torch.tensor([r.reward for r in flat], dtype=torch.float32)
    return compute_advantages(cfg.algorithm.advantage, rewards, gid, **advantage_inputs(groups, cfg))


def advantage_inputs(groups: list[Group], cfg: Config) -> dict:
    """What an estimator takes besides the rewards: OPO each sample's trained tokens, ReMax each
    sample's baseline (its group's greedy reward)."""
    name = cfg.algorithm.advantage
    if name == "opo":
        return {"lengths_B": torch.tensor([sum(r.loss_mask) for g in groups for r in g.rollouts], dtype=torch.float32)}
    if name == "remax":
        return {"baselines_B": torch.tensor([g.greedy.reward for g in groups for _ in g.rollouts], dtype=torch.float32)}
    return {}


def rollout_metrics(groups: list[Group], cfg: Config, primary: str) -> dict:
    """Reward, accuracy and length statistics of the groups that will train."""
    flat = [r for g in groups for r in g.rollouts]
    if not flat:
        return {}
    lengths = torch.tensor([len(r.response_ids) for r in flat], dtype=torch.float32)
    rewards = torch.tensor([r.reward for r in flat], dtype=torch.float32)
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": sum(r.finish == "length" for r in flat) / len(flat),
        "rollout/repetition_frac": sum(last_turn_loops(r.response_ids, r.versions) for r in flat) / len(flat),
        "samples": len(flat),
        "groups": len(groups),
    }
    fns = sorted({k for r in flat for k in r.scores})
    for fn in fns:
        vals = [r.scores[fn] for r in flat if fn in r.scores]
        t = torch.tensor(vals, dtype=torch.float32)
        out[f"rewards/{fn}/mean"] = float(t.mean())
        out[f"rewards/{fn}/std"] = float(t.std(unbiased=False))
    for key in sorted({k for r in flat for k in r.extras}):  # verl's convention for a reward's extra numbers
        vals = [r.extras[key] for r in flat if key in r.extras]
        out[f"rewards/{key}/mean"] = sum(vals) / len(vals)
    out["accuracy"] = accuracy(flat, cfg, primary)
    greedy = [g.greedy for g in groups if g.greedy is not None]
    if greedy:  # ReMax's baselines
        out["reward/greedy_mean"] = sum(r.reward for r in greedy) / len(greedy)
        out["greedy_accuracy"] = accuracy(greedy, cfg, primary)
    if isinstance(cfg.data.train, dict):  # named sources: what each gave this step (its name leads the prompt ids)
        for name in cfg.data.train:
            mine = [r for g in groups if g.prompt.id.startswith(name + "/") for r in g.rollouts]
            if mine:
                out[f"source/{name}/reward_mean"] = sum(r.reward for r in mine) / len(mine)
                out[f"source/{name}/accuracy"] = accuracy(mine, cfg, primary)
                out[f"source/{name}/samples"] = len(mine)
    return out


def last_turn_loops(ids: list[int], versions: list[int]) -> bool:
    """Whether the text the model sampled last in a response (`ids`, with each token's version;
    an episode's last turn: the tokens after the environment's last insertion) ends in a loop,
    its closing token, if any, aside."""
    start = len(versions)
    while start > 0 and versions[start - 1] != INSERTED_VERSION:
        start -= 1
    return ends_in_loop(ids[start:], closing=True)


def ends_in_loop(ids, max_period: int = 512, min_tokens: int = 32, min_repeats: int = 3, closing: bool = False) -> bool:
    """Whether `ids` end in a repetition loop: one block of at most `max_period` tokens written back
    to back at least `min_repeats` times, over at least `min_tokens` tokens, up to the end (a model
    that degenerates repeats until its budget runs out) or, with `closing`, up to its last token (a
    closing token the model sampled after the loop). Walks back from the end once per period and
    end, stopping where the run breaks or is long enough."""
    n = len(ids)
    ends = (n, n - 1) if closing else (n,)
    for period in range(1, max_period + 1):
        need = max(min_repeats * period, min_tokens)
        if need > n:
            return False
        for end in ends:
            if need > end:
                continue
            j = end - 1
            while j >= end - need + period and ids[j] == ids[j - period]:
                j -= 1
            if j < end - need + period:  # the `need` tokens before `end` repeat with this period
                return True
    return False


def eval_metrics(pending: list[PendingGroup], run, sources: dict[str, str] | None = None,
                 least: int = 2) -> tuple[dict, list[Group]]:
    """Held-out metrics of complete single-turn groups: accuracy, mean reward, length; and per
    held-out source (`sources`: prompt id -> its source) `eval/<source>/...` where there are at
    least `least`. Also returns the scored groups (the eval samples log)."""
    groups = [to_rollouts(g, run.cfg, run.tokenizer) for g in pending]
    scored = score_groups(groups, run.rewards, run.cfg)
    out = _eval_summary(groups, run)
    # failed reward calls: scored 0 under on_error=zero, left out under skip; counted either way
    out["eval/reward_errors"] = sum(scored.error_counts.values())
    out.update({f"eval/rewards/{fn}/errors": n for fn, n in scored.error_counts.items()})
    out.update({f"eval/rewards/{fn}/timeouts": n for fn, n in scored.timeout_counts.items()})
    for name, part in by_source(groups, sources, least):
        out.update(per_source(name, _eval_summary(part, run)))
    return out, groups


PER_SOURCE = ("accuracy", "pass_at_k", "maj_at_k", "reward_mean", "samples")


def by_source(groups: list, sources: dict[str, str] | None, least: int = 2) -> list[tuple[str, list]]:
    """The groups split by their prompt's held-out source, in order of first appearance; none
    unless there are `least` sources or more."""
    parts: dict[str, list] = {}
    for g in groups:
        name = (sources or {}).get(g.prompt.id)
        if name is not None:
            parts.setdefault(name, []).append(g)
    return list(parts.items()) if len(parts) >= least else []


def per_source(name: str, metrics: dict) -> dict:
    """`eval/<name>/<metric>` for the metrics worth a curve per source."""
    return {f"eval/{name}/{k}": metrics[f"eval/{k}"] for k in PER_SOURCE if f"eval/{k}" in metrics}


def _eval_summary(groups: list[Group], run) -> dict:
    flat = [r for g in groups for r in g.rollouts if r.reward is not None]
    rewards = [r.reward for r in flat]
    return {
        "eval/accuracy": accuracy(flat, run.cfg, run.primary_reward),
        "eval/pass_at_k": pass_at_k([[correct(r, run.cfg, run.primary_reward) for r in g.rollouts] for g in groups]),
        "eval/maj_at_k": maj_at_k([[(r.text, correct(r, run.cfg, run.primary_reward)) for r in g.rollouts
                                    if r.reward is not None] for g in groups]),
        "eval/reward_mean": sum(rewards) / max(len(rewards), 1),
        "eval/response_length": sum(len(r.response_ids) for r in flat) / max(len(flat), 1),
        "eval/repetition_frac": sum(last_turn_loops(r.response_ids, r.versions) for r in flat) / max(len(flat), 1),
        "eval/samples": len(flat),
    }


def pass_at_k(correct_per_prompt: list[list[bool]]) -> float:
    """The fraction of prompts with at least one correct sample among their k
    (`eval.samples_per_prompt`); a failed sample counts as wrong."""
    return sum(any(c) for c in correct_per_prompt) / max(len(correct_per_prompt), 1)


def maj_at_k(samples_per_prompt: list[list[tuple[str, bool]]]) -> float:
    """The fraction of prompts whose most common answer (`vote`; a tie goes to the answer seen
    first) is correct, among their scored samples that give one: majority voting, `maj@k`. A
    prompt none of whose samples gives an answer counts as wrong."""
    from collections import Counter

    right = 0
    for samples in samples_per_prompt:
        votes = [(key, ok) for key, ok in ((vote(text), ok) for text, ok in samples) if key is not None]
        if votes:
            top = Counter(key for key, _ in votes).most_common(1)[0][0]
            right += next(ok for key, ok in votes if key == top)
    return right / max(len(samples_per_prompt), 1)


def vote(completion: str) -> str | None:
    """The answer a completion votes for: the last number of its final answer (its last
    `\\boxed{}` or `<answer>`, else the whole text) as a number, so 7, 7.0 and 1,000 vote with
    their equals; else a boxed or tagged answer's text (after `normalize_text`); else none."""
    from rollover.rewards.builtins import final_number, normalize_text
    from rollover.rewards.extract import extract_boxed, extract_tagged, final_answer

    number = final_number(completion)
    if number is not None:
        return repr(number)
    tagged = extract_boxed(completion) is not None or extract_tagged(completion) is not None
    return normalize_text(final_answer(completion)) if tagged else None


def accuracy(rollouts: list[Rollout], cfg: Config, primary: str) -> float:
    """Fraction of samples whose primary (first configured) reward function scores at least
    `reward.correct_threshold`; a sample where it abstained or failed counts as wrong."""
    if not rollouts:
        return 0.0
    return sum(correct(r, cfg, primary) for r in rollouts) / len(rollouts)


def correct(r: Rollout, cfg: Config, primary: str) -> bool:
    """Whether the primary reward function scored the sample at least `reward.correct_threshold`."""
    return (r.scores.get(primary) or 0.0) >= cfg.reward.correct_threshold
