"""`rollover simulate plan`: how many rollout workers a trainer needs, and which staleness bound
η, to keep the trainer busy a target fraction of the time; then the simulation's verdict.

The closed form is an overlap model of the async pipeline in steady state (rollover's own
derivation, in the spirit of ECHO-2's capacity model, whose inequality is not public). Per
training step the trainer needs S = B·G / y samples generated (B prompts of G samples; y the
fraction of groups dynamic sampling keeps). With N workers of R rows each:

    a worker step with r running rows   d(r) = decode.step(r, r·c̄) + (r / L̄)·prefill per sample
    samples per second of a worker      μ(r) = r / (L̄ · d(r))
    one training step, one weight push  T_t = train.seconds(B·G·(P + L̄)),  T_s = sync.seconds(N)
    a worker's stall per push           T_st = T_s + prefill(r·c̄)  (its running rows' K/V again)

where L̄ is the mean response length (the budget truncating the draw; the budget itself under
ignore_eos), c̄ = P + E[L²]/(2·L̄) the context a running row holds on average (a row spends more
steps in long samples), P the prompt tokens, and a group's prompt is prefilled once. Each worker
may run r_max = min(R, K / (c̄ + 1), (η+1)·S / N) rows (the gate lets (η+1)·B groups be in flight;
a K/V cache of K tokens holds about K / (c̄ + 1) rows of average context: preemptions, which
recompute a row's K/V when it comes back, are not in the closed form). For η ≥ 1
a training step starts every

    cycle = max( T_t + T_s,                                  the trainer's own step and push
                 T_st + S / (N · μ(r_max)),                   generating a batch
                 (W(r_c) · c/(c − T_st) + T_t + T_s) / (η+1) )  a batch's latency under the gate

The last term: batches are formed in the order their groups started, and the gate admits
batch j's groups once version j − η exists (step j − η − 1 trained and pushed); batch j is due
when step j starts, so η + 1 cycles must hold its latency plus one step and push. Its latency
W(r) = E[longest response of a batch]·d(r), stretched by the pushes that fall while it runs
(c/(c − T_st)), at the load r_c that produces S samples a cycle (r_c = S·L̄·d(r_c)/(N·(c − T_st)),
at most r_max): a fixed point in c, found by bisection. With η = 0 nothing overlaps:
cycle = max(S / (N·μ(r_max)), W(r_max)) + T_t + T_s. The trainer is busy u = T_t / cycle, at most
T_t / (T_t + T_s) whatever N. `recommend` returns the fewest workers reaching the target
utilization, at the smallest η within 5% of the fewest over η ≤ 8.

Then the simulator runs rollover's async loop at the recommended point and measures the
trainer's steady-state utilization: the closed form's error is that difference. A grid scales
the unit (trainer GPUs, batch, prompts) by 1, 2, 4, ... up to a GPU budget (1,024 by default):
the training step keeps its time (data parallel over more GPUs), the weight push crosses more
workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rollover.config import ConfigError
from rollover.sim.config import SimRunConfig
from rollover.sim.costs import DecodeCost, Profile, SyncCost, TrainCost
from rollover.sim.workload import LengthModel, make_prompts

ETA_MAX = 8


@dataclass(frozen=True)
class Lengths:
    """Moments of the response-length distribution the closed form needs (Monte Carlo over the
    simulator's own draws, so both see the same distribution)."""

    mean: float  # E[L]
    second: float  # E[L^2]
    group_max: float  # E[max over a group's G samples]
    batch_max: float  # E[max over a batch's samples]

    @classmethod
    def of(cls, model: LengthModel, group: int, batch_groups: int, budget: int, groups: int = 2000,
           ignore_eos: bool = False) -> "Lengths":
        if ignore_eos:  # every sample runs to its budget
            return cls(mean=budget, second=budget * budget, group_max=budget, batch_max=budget)
        draws = [[min(model.draw(g, 1_000_003 * g + i), budget) for i in range(group)] for g in range(groups)]
        flat = [x for g in draws for x in g]
        n_batches = max(1, groups // batch_groups)
        batch_max = sum(max(max(g) for g in draws[b * batch_groups:(b + 1) * batch_groups])
                        for b in range(n_batches)) / n_batches if groups >= batch_groups else float(budget)
        return cls(mean=sum(flat) / len(flat), second=sum(x * x for x in flat) / len(flat),
                   group_max=sum(max(g) for g in draws) / groups, batch_max=batch_max)


@dataclass(frozen=True)
class Capacity:
    """The closed-form capacity model of one trainer and its rollout workers (see the module)."""

    decode: DecodeCost
    rows: int
    train: TrainCost
    sync: SyncCost
    prompts_per_step: int
    group: int
    prompt_tokens: int
    lengths: Lengths
    kept: float = 1.0  # fraction of groups dynamic sampling keeps
    kv_tokens: int | None = None  # a worker's K/V capacity (None: the rows alone limit it)

    @property
    def samples(self) -> float:
        return self.prompts_per_step * self.group / self.kept

    @property
    def context(self) -> float:
        """c̄: the tokens a running row holds on average (a row spends more steps in long samples)."""
        return self.prompt_tokens + self.lengths.second / (2 * self.lengths.mean)

    @property
    def row_limit(self) -> float:
        """Rows a worker can run: its rows, or as many rows of average context as its K/V holds."""
        if self.kv_tokens is None:
            return self.rows
        return max(1.0, min(self.rows, self.kv_tokens / (self.context + 1)))

    def step_s(self, r: float) -> float:
        P, L, ctx = self.prompt_tokens, self.lengths, self.context
        d = self.decode
        prefill = (d.prefill_per_token_s * P + d.prefill_quadratic_s * P * P) / self.group
        rows = max(1.0, r)
        return d.step(rows, rows * ctx) + (rows / L.mean) * prefill

    def recompute_s(self, r: float) -> float:
        """A worker's stall after each weight push beyond the push: the K/V of its r running rows
        computed again under the new weights (a prefill of their context)."""
        return self.decode.prefill(max(1.0, r) * self.context)

    def worker_rate(self, r: float) -> float:
        return r / (self.lengths.mean * self.step_s(r))  # r < 1: a worker idle part of the time

    def train_s(self) -> float:
        return self.train.seconds(round(self.prompts_per_step * self.group * (self.prompt_tokens + self.lengths.mean)))

    def cycle(self, workers: int, eta: int) -> float:
        return self.bound(workers, eta)[0]

    def bound(self, workers: int, eta: int) -> tuple[float, str]:
        """(seconds between training steps, what sets them: 'trainer', 'rollout' or 'latency')."""
        S, Tt, Ts, L = self.samples, self.train_s(), self.sync.seconds(workers), self.lengths
        full = min(self.row_limit, (eta + 1) * S / workers)  # rows a worker may run
        generate = S / (workers * self.worker_rate(full))
        if eta == 0:
            last = L.batch_max * self.step_s(full)
            return max(generate, last) + Tt + Ts, "rollout" if generate >= last else "latency"
        stall = Ts + self.recompute_s(full)  # workers generate nothing meanwhile
        generate += stall - Ts
        base = max(Tt + Ts, Ts + generate)
        why = "trainer" if Tt >= generate else "rollout"

        def latency(c: float) -> float:
            # a longer cycle needs fewer running rows for S samples; the batch's last sample
            # decodes at that load (a fixed point in r, approached from the full rows down),
            # stalled by the pushes that fall while it runs
            r = full
            for _ in range(30):
                r = min(full, S * L.mean * self.step_s(r) / (workers * (c - stall)))
            return (L.batch_max * self.step_s(r) * c / (c - stall) + Tt + Ts) / (eta + 1)

        if latency(base) <= base:
            return base, why
        lo, hi = base, base + L.batch_max * self.step_s(full) * base / (base - stall)  # latency(c) - c falls as c grows
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if latency(mid) > mid else (lo, mid)
        return hi, "latency"

    def utilization(self, workers: int, eta: int) -> float:
        return self.train_s() / self.cycle(workers, eta)

    def fewest_workers(self, target: float, eta: int, limit: int = 1 << 17) -> int | None:
        """The fewest workers with utilization >= target at this eta (None up to `limit`):
        the first power of two that reaches it, then bisection below it (utilization need not
        rise with N everywhere: rows per worker and the push change with N)."""
        hi = 1
        while self.utilization(hi, eta) < target:
            if hi >= limit:
                return None
            hi *= 2
        lo = hi // 2 + 1 if hi > 1 else 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.utilization(mid, eta) >= target:
                hi = mid
            else:
                lo = mid + 1
        return hi

    def recommend(self, target: float) -> dict:
        """{workers, eta, utilization, per_eta: {eta: workers}}; ConfigError if no N and η reach it."""
        if not 0 < target < 1:
            raise ConfigError(f"plan: target utilization must be between 0 and 1, got {target}")
        per_eta = {eta: self.fewest_workers(target, eta) for eta in range(ETA_MAX + 1)}
        found = {e: n for e, n in per_eta.items() if n is not None}
        if not found:
            best = max(((self.utilization(n, e), e, n) for e in range(ETA_MAX + 1) for n in (1 << k for k in range(18))),
                       key=lambda t: (round(t[0], 4), -t[1], -t[2]))  # the fewest workers and smallest eta of the best
            u, e, n = best
            raise ConfigError(
                f"plan: no number of workers reaches trainer utilization {target:g} with eta <= {ETA_MAX}: the best "
                f"is {u:.3f} (eta={e}, {n} workers, bound by {self.bound(n, e)[1]}); a training step takes "
                f"{self.train_s():.3g} s, the weight push {self.sync.seconds(n):.3g} s there, and a batch's longest "
                f"response ({self.lengths.batch_max:.0f} tokens) {self.lengths.batch_max * self.step_s(self.row_limit):.3g} s "
                f"at full rows (lower the target, shorten the tail: rollout.max_new_tokens, or cheapen the push)")
        fewest = min(found.values())
        eta = min(e for e, n in found.items() if n <= math.ceil(1.05 * fewest))
        n = found[eta]
        return {"workers": n, "eta": eta, "utilization": self.utilization(n, eta), "per_eta": per_eta,
                "train_s": self.train_s(), "sync_s": self.sync.seconds(n), "cycle_s": self.cycle(n, eta),
                "worker_samples_per_s": self.worker_rate(min(self.row_limit, (eta + 1) * self.samples / n))}


def kept_fraction(cfg: SimRunConfig) -> float:
    """Groups dynamic sampling keeps: those whose samples are not all solved or all failed."""
    if not cfg.algorithm.dynamic_sampling:
        return 1.0
    s, G = cfg.simulate, cfg.rollout.samples_per_prompt
    prompts, _ = make_prompts(s.prompts, cfg.seed, s.prompt_tokens, s.solve_alpha, s.solve_beta)
    ps = [float(p.answer) for p in prompts]
    return max(1e-6, sum(1 - p ** G - (1 - p) ** G for p in ps) / len(ps))


def capacity(cfg: SimRunConfig, profile: Profile, lengths: Lengths | None = None) -> Capacity:
    from rollover.sim.run import length_model, reward_cost

    s, r = cfg.simulate, cfg.rollout
    if not reward_cost(cfg).free:
        raise ConfigError("plan's closed form has no scoring time yet: unset simulate.reward, or simulate the "
                          "point it recommends with `rollover simulate CONFIG simulate.reward=...`")
    if len(s.pools) != 1:
        raise ConfigError(f"plan sizes one pool of identical workers; simulate.pools has {len(s.pools)}")
    if s.shared_device:
        raise ConfigError("plan sizes clusters whose trainer and rollout workers have devices of their own; "
                          "simulate.shared_device=true describes one box")
    pool = s.pools[0]
    if lengths is None:
        lengths = Lengths.of(length_model(cfg), r.samples_per_prompt, r.prompts_per_step, r.max_new_tokens,
                             ignore_eos=r.ignore_eos)
    return Capacity(decode=replace(profile.decode, **pool.decode), rows=pool.max_rows, train=profile.train,
                    sync=profile.sync, prompts_per_step=r.prompts_per_step, group=r.samples_per_prompt,
                    prompt_tokens=s.prompt_tokens, lengths=lengths, kept=kept_fraction(cfg), kv_tokens=pool.kv_tokens)


def scaled(cfg: SimRunConfig, m: int, workers: int, eta: int) -> SimRunConfig:
    """The config as m trainer replicas (data parallel: m times the batch and the prompts, the
    same step time) with `workers` rollout workers, run async at `eta`."""
    s, r = cfg.simulate, cfg.rollout
    train = dict(s.train)
    per_token = train.get("per_token_s", None)
    pool = s.pools[0].model_copy(update={"workers": workers})
    update = {"pools": [pool], "prompts": s.prompts * m}
    if m > 1:
        from rollover.sim.run import profile_of

        per_token = profile_of(cfg).train.per_token_s if per_token is None else per_token
        update["train"] = {**train, "per_token_s": per_token / m}
    return cfg.model_copy(update={
        "mode": "async", "async_": cfg.async_.model_copy(update={"max_staleness": eta}),
        "rollout": r.model_copy(update={"prompts_per_step": r.prompts_per_step * m}),
        "simulate": s.model_copy(update=update)})


def steady_utilization(report: dict, warmup: int) -> float:
    """The trainer's busy fraction after the first `warmup` steps (the pipeline filling)."""
    rows = report["step_rows"]
    if len(rows) <= warmup:
        raise ConfigError(f"plan: {len(rows)} simulated steps leave nothing after {warmup} warm-up steps "
                          f"(raise steps)")
    start = rows[warmup - 1]["t_end"] if warmup else 0.0
    span = rows[-1]["t_end"] - start
    return sum(r["train_s"] for r in rows[warmup:]) / span if span > 0 else 0.0


def plan(cfg: SimRunConfig, target: float, max_gpus: int = 1024, simulate_points: bool = True, rounds: int = 6,
         progress=None) -> dict:
    """The recommendation at the config's scale and over a grid of scales (1, 2, 4, ... trainer
    replicas) up to `max_gpus`. At each: the closed form's workers, eta and utilization; with
    `simulate_points`, the simulated steady-state utilization there (the closed form's error),
    and, where the simulation falls short of the target, the point corrected until it reaches
    it (more workers where rollout throughput binds, a larger eta where a batch's latency does;
    at most `rounds` corrections)."""
    from rollover.sim.run import length_model, profile_of

    s, r = cfg.simulate, cfg.rollout
    model = length_model(cfg)
    points = []
    m = 1
    while True:
        unit = scaled(cfg, m, 1, 1)
        lengths = Lengths.of(model, r.samples_per_prompt, r.prompts_per_step * m, r.max_new_tokens,
                             groups=max(2000, 2 * r.prompts_per_step * m), ignore_eos=r.ignore_eos)
        cap = capacity(unit, profile_of(unit), lengths)
        try:
            rec = cap.recommend(target)
        except ConfigError as e:
            if not points:
                raise
            points.append({"scale": m, "trainer_gpus": m * s.trainer_gpus, "unreachable": str(e)})
            break
        gpus = m * s.trainer_gpus + rec["workers"] * s.pools[0].gpus_per_worker
        if gpus > max_gpus and points:
            break
        point = {"scale": m, "trainer_gpus": m * s.trainer_gpus, "rollout_workers": rec["workers"],
                 "gpus": gpus, "eta": rec["eta"], "workers_per_trainer_gpu": rec["workers"] / (m * s.trainer_gpus),
                 "closed_form_utilization": rec["utilization"], "bound": cap.bound(rec["workers"], rec["eta"])[1],
                 "per_eta": rec["per_eta"], "train_s": rec["train_s"], "sync_s": rec["sync_s"],
                 "cycle_s": rec["cycle_s"], "mean_response_tokens": lengths.mean}
        if simulate_points:
            point.update(_check(cfg, cap, m, rec["workers"], rec["eta"], target, rounds))
        points.append(point)
        if progress:
            progress(point)
        if gpus >= max_gpus:
            break
        m *= 2
    return {"target": target, "max_gpus": max_gpus, "profile": profile_of(cfg).name, "steps": cfg.steps,
            "points": points}


def _check(cfg: SimRunConfig, cap: Capacity, m: int, workers: int, eta: int, target: float, rounds: int) -> dict:
    """Simulate the closed form's point; correct it while the simulation falls short."""
    from rollover.sim.run import simulate

    def utilization(n: int, e: int) -> float:
        return steady_utilization(simulate(scaled(cfg, m, n, e)), warmup(cfg, e))

    u = first = utilization(workers, eta)
    out = {"simulated_utilization": first, "relative_error": cap.utilization(workers, eta) / first - 1}
    n, e, tried = workers, eta, 0
    while u < target and tried < rounds:
        if cap.bound(n, e)[1] == "latency" and e < ETA_MAX:
            e += 1
        else:
            n = max(n + 1, math.ceil(n * min(2.0, target / max(u, 1e-9)) * 1.02))
        u, tried = utilization(n, e), tried + 1
    gpus = m * cfg.simulate.trainer_gpus + n * cfg.simulate.pools[0].gpus_per_worker
    return {**out, "recommended": {"rollout_workers": n, "eta": e, "gpus": gpus, "simulated_utilization": u,
                                   "reaches_target": u >= target, "corrections": tried}}


def warmup(cfg: SimRunConfig, eta: int) -> int:
    """Steps left out of the steady state: the pipeline fills over about eta + 2 steps."""
    return min(eta + 2, max(cfg.steps // 3, 1))


def text(result: dict) -> str:
    lines = [f"plan: trainer utilization target {result['target']:g}, profile {result['profile']}, "
             f"{result['steps']} simulated steps per point, mean response "
             f"{result['points'][0]['mean_response_tokens']:.0f} tokens",
             "closed form (rollout workers, eta) | simulated there | corrected until the simulation reaches the target",
             f"{'GPUs':>6} {'trainer':>7} {'rollout':>7} {'eta':>3} {'bound':>8} {'closed form':>11} {'simulated':>9} "
             f"{'error':>7} | {'rollout':>7} {'eta':>3} {'GPUs':>6} {'simulated':>9}"]
    for p in result["points"]:
        if "unreachable" in p:
            lines.append(f"{'-':>6} {p['trainer_gpus']:>7}  {p['unreachable']}")
            continue
        row = (f"{p['gpus']:>6} {p['trainer_gpus']:>7} {p['rollout_workers']:>7} {p['eta']:>3} {p['bound']:>8} "
               f"{p['closed_form_utilization']:>11.3f}")
        if "simulated_utilization" in p:
            c = p["recommended"]
            row += (f" {p['simulated_utilization']:>9.3f} {p['relative_error']:>+7.1%} | {c['rollout_workers']:>7} "
                    f"{c['eta']:>3} {c['gpus']:>6} {c['simulated_utilization']:>9.3f}"
                    + ("" if c["reaches_target"] else "  (target not reached)"))
        lines.append(row)
    first = result["points"][0]
    rec = first.get("recommended", {"rollout_workers": first["rollout_workers"], "eta": first["eta"]})
    lines.append(f"recommendation: {rec['rollout_workers'] / first['trainer_gpus']:.2f} rollout workers per trainer "
                 f"GPU at eta={rec['eta']}; the closed form alone needs, by eta: "
                 + ", ".join(f"{e}: {n if n is not None else 'none'}" for e, n in first["per_eta"].items()))
    return "\n".join(lines)
