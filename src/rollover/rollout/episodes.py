"""Multi-turn episodes as training groups and as held-out evaluation.

A group is n episodes of one task (`env.name` makes their environments); the rollout core
(`core.py`) runs them in every schedule. A trajectory becomes a `Rollout` whose response holds
the sampled turns and the tokens the environment inserted between them (loss mask 0, so only
sampled tokens train); its reward is the environment's (the sum of its step rewards), recorded
as the score `env`.

An episode whose environment raised or timed out has no reward: it is reported with the
episode and the exception here, counted (`env/failed`, `env/timed_out`, `reward_errors`) and
dropped from its group, which trains on the other episodes (`keep_group`), as an unscored
sample is in single-turn mode: never a silent 0.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math

import torch

from rollover.algos.advantages import compute_advantages, turn_advantages
from rollover.data.media import without_images
from rollover.envs.base import Trajectory, Turn, info_means
from rollover.rollout.groups import PendingGroup, by_source, last_turn_loops, pass_at_k, per_source
from rollover.types import Group, Rollout

log = logging.getLogger("rollover")
_SHOWN: set[str] = set()  # the exception types whose traceback this process has logged


def to_group(pg, trajectories: list[Trajectory]) -> Group:
    """The group's rollouts; a failed episode's has reward None (reported here, never scored 0)."""
    rollouts: list[Rollout] = []
    for t in trajectories:
        if not t.ok:
            e = t.error
            if e.traceback and e.type not in _SHOWN:  # the first of its kind with its traceback, later ones a line
                _SHOWN.add(e.type)
                log.warning("env: episode %s failed: %s\n%s(later %s failures: one line each)", t.request_id,
                            e.describe(), e.traceback, e.type)
            else:
                log.warning("env: episode %s failed: %s", t.request_id, e.describe())
        r = t.to_rollout(pg.id, failed_ok=True)
        r.scores = {} if r.reward is None else {"env": t.reward}
        r.text = _text(t)
        r.turns = [turn_record(turn, t.prompt_len, _state(t, k)) for k, turn in enumerate(t.turns)]
        rollouts.append(r)
    return Group(id=pg.id, prompt=pg.prompt, prompt_ids=trajectories[0].tokens_T[: trajectories[0].prompt_len],
                 rollouts=rollouts, start_version=pg.start_version, serial=pg.serial)


def turn_credit(groups: list[Group], cfg) -> tuple[torch.Tensor, list[list[float]], dict]:
    """`env.credit: reward_to_go`: each episode's advantage (the estimator, Dr.GRPO or RLOO, over
    its discounted return `G_0`), and per response token the advantage of its turn
    (`turn_advantages`; the environment's inserted tokens, never trained, carry the episode's).
    Each turn record gets its `advantage` (the samples log shows it)."""
    flat = [r for g in groups for r in g.rollouts]
    gamma = cfg.env.gamma
    turn_rewards = [[t["reward"] for t in r.turns] for r in flat]
    rewards_B = torch.tensor([_g0(rewards, gamma) for rewards in turn_rewards], dtype=torch.float32)
    gid = torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts], dtype=torch.long)
    adv_B, info = compute_advantages(cfg.algorithm.advantage, rewards_B, gid)
    per_token = []
    for r, a, rewards in zip(flat, adv_B.tolist(), turn_rewards):
        tokens = [a] * len(r.response_ids)
        for turn, at in zip(r.turns, turn_advantages(a, rewards, gamma)):
            start, end = turn["span"]
            tokens[start:end] = [at] * (end - start)
            turn["advantage"] = at
        per_token.append(tokens)
    return adv_B, per_token, info


def turn_rewards(groups: list[Group]) -> tuple[torch.Tensor, list[list[float]], dict]:
    """`env.credit: reward_to_go` with `algorithm.advantage: gae`: the rewards where each turn earned
    them, for the critic's GAE to carry back over the tokens before (`rollover.algos.gae`): nothing
    at the sequence's end (`adv_B` 0), and per response token each turn's reward on its last trained
    token (a turn with none trained puts it on the last trained token before it; with none before
    either, no trained decision led to it, and it is left out), so a turn is credited with what it
    and the turns after it earned."""
    flat = [r for g in groups for r in g.rollouts]
    per_token = []
    for r in flat:
        tokens = [0.0] * len(r.response_ids)
        trained = [i for i, m in enumerate(r.loss_mask) if m]
        for turn in r.turns:
            k = bisect.bisect_left(trained, turn["span"][1])  # the trained tokens before the turn's end
            if k:
                tokens[trained[k - 1]] += float(turn["reward"])
        per_token.append(tokens)
    totals_B = torch.tensor([sum(per_token_i) for per_token_i in per_token], dtype=torch.float32)
    gid = torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts], dtype=torch.long)
    _, info = compute_advantages("gae", totals_B, gid)  # the groups' counts, as with rewards at the end
    return torch.zeros(len(flat)), per_token, info


def gigpo_credit(groups: list[Group], cfg) -> tuple[torch.Tensor, list[list[float]], dict]:
    """`env.credit: gigpo` (GiGPO, Feng et al., arXiv 2505.10978): each episode's advantage `A`
    (algorithm.advantage over its return, the undiscounted sum of its turns' rewards, within its
    group), and each turn's `A + w * A_step`, where `A_step` is the same estimator over the turns
    of the group that start from the same state (the opening for every first turn; after that
    the state the previous step left, `_state`), each turn's value its discounted return from
    there `G_t`. A turn from a state no other episode of its group reached has `A_step` 0."""
    flat = [r for g in groups for r in g.rollouts]
    gamma, weight = cfg.env.gamma, cfg.env.step_weight
    to_go = [_returns([t["reward"] for t in r.turns], gamma) for r in flat]
    rewards_B = torch.tensor([sum(t["reward"] for t in r.turns) for r in flat], dtype=torch.float32)
    gid = [i for i, g in enumerate(groups) for _ in g.rollouts]
    adv_B, info = compute_advantages(cfg.algorithm.advantage, rewards_B, torch.tensor(gid, dtype=torch.long))
    anchors: dict[tuple, int] = {}
    step_ids, step_values = [], []
    for b, r in enumerate(flat):
        for t in range(len(r.turns)):
            # the opening, or the state left before (a record from an older checkpoint has none: alone)
            key = (gid[b], (r.turns[t - 1].get("state") or f"{b}/{t}") if t else None)
            step_ids.append(anchors.setdefault(key, len(anchors)))
            step_values.append(to_go[b][t])
    step_adv = []
    if step_ids:
        step_adv = compute_advantages(cfg.algorithm.advantage, torch.tensor(step_values, dtype=torch.float32),
                                      torch.tensor(step_ids, dtype=torch.long))[0].tolist()
    sizes = torch.bincount(torch.tensor(step_ids, dtype=torch.long)) if step_ids else torch.zeros(0)
    info = {**info, "step_groups": len(anchors), "step_group_size": float(sizes.float().mean()) if len(sizes) else 0.0,
            "step_singleton_turns": int((sizes == 1).sum())}
    per_token, k = [], 0
    for r, a in zip(flat, adv_B.tolist()):
        tokens = [a] * len(r.response_ids)
        for turn in r.turns:
            at = a + weight * step_adv[k]
            k += 1
            start, end = turn["span"]
            tokens[start:end] = [at] * (end - start)
            turn["advantage"] = at
        per_token.append(tokens)
    return adv_B, per_token, info


def _returns(rewards: list[float], gamma: float) -> list[float]:
    """Each turn's discounted return: its reward and those after it, discounted by `gamma` per turn."""
    out, g = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        g = rewards[t] + gamma * g
        out[t] = g
    return out


def _g0(rewards: list[float], gamma: float) -> float:
    """The return from the first turn, discounted by `gamma` per turn."""
    g = 0.0
    for x in reversed(rewards):
        g = x + gamma * g
    return g


def _text(t: Trajectory) -> str:
    """What the model wrote, its messages apart ("||"): a continued message whole, the
    environment's continuations in it."""
    out = ""
    for k, turn in enumerate(t.turns):
        out += turn.text
        if turn.continuation is not None and k + 1 < len(t.turns):
            out += turn.continuation
        elif k + 1 < len(t.turns):
            out += " || "
    return out


def turn_record(turn: Turn, prompt_len: int, state: str = "") -> dict:
    """One turn as the samples log shows it: the assistant's text and the environment's reply
    as chat messages, the turn's reward and finish, where its sampled tokens sit in the
    response (`[start, end)`), and `state`, a digest of the state its step left (`_state`)."""
    out = {"messages": [{"role": "assistant", "content": turn.text}, *without_images(turn.messages)], "reward": turn.reward,
           "finish": turn.finish, "span": [turn.start - prompt_len, turn.end - prompt_len], "state": state}
    if turn.continuation is not None:  # the environment's text inside the assistant's turn
        out["continuation"] = turn.continuation
    return out


def _state(t: Trajectory, k: int) -> str:
    """A digest of the state turn k's step left, which env.credit=gigpo groups the next turns by:
    the state the environment named (`StepResult.state`), else the whole conversation up to the
    next turn (its tokens), so turns are only compared where everything before them is equal."""
    turn = t.turns[k]
    if turn.state is not None:
        data = b"s" + json.dumps(turn.state, sort_keys=True, default=repr).encode()
    else:
        end = t.turns[k + 1].start if k + 1 < len(t.turns) else len(t.tokens_T)
        data = b"t" + ",".join(map(str, t.tokens_T[:end])).encode()
    return hashlib.sha1(data).hexdigest()[:16]


def episode_eval_metrics(pending: list[PendingGroup], cfg, sources: dict[str, str] | None = None,
                         least: int = 2) -> dict:
    """Held-out metrics of complete groups of episodes: success rate, reward, turns, failures;
    per held-out source as `eval_metrics` gives them."""
    out = _episode_summary(pending, cfg)
    for name, part in by_source(pending, sources, least):
        out.update(per_source(name, _episode_summary(part, cfg)))
    return out


def _episode_summary(pending: list[PendingGroup], cfg) -> dict:
    trajs = [g.done[j] for g in pending for j in range(g.n)]
    ok = [t for t in trajs if t.ok]
    rewards = [t.reward for t in ok]
    # accuracy over every episode (a failed one solved nothing); the means over the scored ones,
    # NaN when none was (not a 0 no episode earned)
    per_ok = len(ok) or math.nan
    return {
        "eval/accuracy": sum(r >= cfg.reward.correct_threshold for r in rewards) / max(len(trajs), 1),
        "eval/pass_at_k": pass_at_k([[g.done[j].ok and g.done[j].reward >= cfg.reward.correct_threshold
                                      for j in range(g.n)] for g in pending]),
        "eval/reward_mean": sum(rewards) / per_ok,
        "eval/response_length": sum(len(t.tokens_T) - t.prompt_len for t in ok) / per_ok,
        "eval/repetition_frac": sum(last_turn_loops(t.tokens_T[t.prompt_len:], t.versions_T[t.prompt_len:])
                                    for t in ok) / per_ok,
        "eval/samples": len(trajs),
        "eval/failed": len(trajs) - len(ok),
        "eval/resampled": sum(getattr(t, "resampled", 0) for t in trajs),  # failed ones run again (env.resample_failed)
        "eval/turns_mean": sum(len(t.turns) for t in trajs) / max(len(trajs), 1),
        # what the environment reported (`eval/info/tool_calls`, ...), as training's `rollout/env/info/`
        **{f"eval/info/{key}": v for key, v in info_means(trajs).items()},
    }
