"""The `rollover bench train` workload through TRL's GRPOTrainer (`--compare trl`).

Same model (loaded by rollover from the GGUF file, fp32; where rollover's trainer uses bf16
autocast, `train.dtype=autocast_bf16` or `auto` on CUDA, TRL trains and generates under it too,
`bf16=True`), on the config's `device`, same prompts (the generator, system
prompt and instruction of the workload's config, given to TRL in chat form so it applies the
same chat template), same reward (rollover's `numeric`), same batch (8 prompts x 4 samples =
32 completions and one optimizer step per generation), same length budget (48 new tokens),
temperature, learning rate and schedule, gradient clipping, no KL term, one pass over each batch. TRL generates with HF
`generate` on the trainer's own weights and trains in micro-batches of 8 completions (4
gradient-accumulation steps). A step is timed from TRL's `on_step_begin` to `on_step_end`, so
it holds generation, scoring and the update, as rollover's `timing_s/step` does; the first step
is not counted. Needs `pip install trl` (not part of the test extras).
"""

from __future__ import annotations

import statistics
import tempfile
import time


def measure_trl(args, workload: tuple[str, ...]) -> dict:
    from rollover.config import load_config
    from rollover.data.generators import generate_from_spec

    trl = _import_trl("rollover bench train --compare trl")
    cfg = load_config(None, [f"model={args.model}", *workload, *args.overrides])
    if not isinstance(cfg.data.train, str) or not cfg.data.train.startswith("gen:"):
        raise ValueError(f"bench train --compare trl generates its prompts: data.train={cfg.data.train!r} must be "
                         "a gen: source")
    trainer_of, _ = _grpo(trl, cfg, generate_from_spec(cfg.data.train), max_steps=args.steps + 1, logging_steps=1)
    times: list[float] = []
    trainer = trainer_of([_step_clock(times)])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h][1:]
    return {
        "trl_version": trl.__version__, "steps_measured": len(times) - 1,
        "seconds_per_step": statistics.fmean(times[1:]), "step_seconds": times[1:],
        "reward_mean": statistics.fmean(h["reward"] for h in logs) if logs else None,
        "completion_length_mean": statistics.fmean(h["completions/mean_length"] for h in logs
                                                   if "completions/mean_length" in h) if logs else None,
    }


def learn_trl(cfg) -> list[dict]:
    """`rollover bench learn --policies trl`: the run `cfg` describes (its task, model, batch,
    length budget, learning rate, schedule and seed) trained by TRL's GRPOTrainer instead, with
    the held-out accuracy of the same evaluation prompts measured every `eval.every` steps (and
    at the start) by sampling the trainer's own weights with HF `generate`. The points are
    those `rollover.bench.learn.curve` gives a rollover run: training seconds count the steps
    only (generation, scoring, update), never the evaluations."""
    from transformers import TrainerCallback

    from rollover.loops.prompts import _prompts, first_held_out

    trl = _import_trl("rollover bench learn --policies trl")
    if cfg.data.train_weights is not None:
        raise ValueError("bench learn --policies trl trains on one dataset: data.train_weights has no TRL counterpart here")
    train, held, _, sets = _prompts(cfg)
    held = held if cfg.data.eval is None else first_held_out(cfg, held, sets)  # (each set's first eval_size)
    trainer_of, tokenizer = _grpo(trl, cfg, train, max_steps=cfg.steps, logging_strategy="no")
    completions = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    times: list[float] = []
    points: list[dict] = []

    class Evaluate(TrainerCallback):  # after the step clock: an evaluation is never inside a step's time
        def on_train_begin(self, args, state, control, model=None, **kw):
            if cfg.eval.at_start:
                self._point(0, model)

        def on_step_end(self, args, state, control, model=None, **kw):
            every = cfg.eval.every
            if (every and state.global_step % every == 0) or state.global_step == cfg.steps:
                self._point(state.global_step, model)

        def _point(self, step: int, model) -> None:
            samples = step * completions
            points.append({"step": step, "samples": samples, "trained": samples, "train_seconds": sum(times[:step]),
                           "accuracy": hf_accuracy(model, tokenizer, held, cfg)})

    trainer_of([_step_clock(times), Evaluate()]).train()
    return points


def _import_trl(who: str):
    try:
        import trl
    except ImportError as e:
        raise SystemExit(f"{who}: needs TRL ({e}); pip install trl") from None
    return trl


def _grpo(trl, cfg, prompts, **options):
    """TRL's GRPOTrainer set up as `cfg` trains (what the module docstring lists as matched),
    on `prompts` in chat form: a function of the callbacks making the trainer, and the tokenizer."""
    from datasets import Dataset

    from rollover.data.render import render_messages
    from rollover.loops.build import pick_device
    from rollover.models import load_hf_model, load_tokenizer
    from rollover.rewards.builtins import numeric_reward

    d, r = cfg.data, cfg.rollout
    rows = [{"prompt": render_messages(p, d.system_prompt, d.instruction), "answer": p.answer} for p in prompts]

    def numeric(prompts, completions, answer, **_):
        return [numeric_reward(c[-1]["content"], a) for c, a in zip(completions, answer)]

    tokenizer = load_tokenizer(cfg.model)
    tokenizer.padding_side = "left"
    t = cfg.train
    completions = r.prompts_per_step * r.samples_per_prompt
    micro = max(k for k in range(1, 9) if completions % k == 0)  # micro-batches that add up to the batch
    schedule = "constant_with_warmup" if t.schedule == "constant" and t.warmup_steps else t.schedule
    device = pick_device(cfg.device)
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="rollover-bench-trl-"), use_cpu=device.type == "cpu", seed=cfg.seed,
        # rollover's mixed precision is TRL's too: fp32 weights, bf16 autocast (on CUDA by default)
        bf16=t.dtype == "autocast_bf16",
        per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
        num_generations=r.samples_per_prompt, max_completion_length=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p or None,
        repetition_penalty=r.repetition_penalty, learning_rate=t.lr, lr_scheduler_type=schedule,
        warmup_steps=t.warmup_steps, max_grad_norm=t.grad_clip, weight_decay=t.weight_decay,
        adam_beta1=t.betas[0], adam_beta2=t.betas[1], beta=0.0, num_iterations=1,
        gradient_checkpointing=t.gradient_checkpointing,  # TRL's default is on; rollover's is off
        save_strategy="no", report_to="none", dataloader_num_workers=0, disable_tqdm=True, **options,
    )

    def trainer_of(callbacks):
        return trl.GRPOTrainer(model=load_hf_model(cfg.model), reward_funcs=[numeric], args=config,
                               train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=callbacks)

    return trainer_of, tokenizer


def _step_clock(times: list[float]):
    """A callback appending each training step's seconds to `times` (generation, scoring and
    the update: TRL generates inside the step)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            times.append(time.perf_counter() - self.t0)

    return StepClock()


def hf_accuracy(model, tokenizer, prompts, cfg, batch: int = 32) -> float:
    """Held-out accuracy as rollover's evaluation defines it (the share of samples whose
    `numeric` reward reaches `reward.correct_threshold`), sampling `eval.samples_per_prompt`
    completions of each prompt with HF `generate` at `eval.temperature` (the model is put back
    in training mode after)."""
    import torch

    from rollover.data.render import render_messages
    from rollover.rewards.builtins import numeric_reward

    d, e = cfg.data, cfg.eval
    texts = [tokenizer.apply_chat_template(render_messages(p, d.system_prompt, d.instruction), tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    answers = [p.answer for p in prompts]
    greedy = e.temperature == 0
    n = 1 if greedy else e.samples_per_prompt  # greedy samples of one prompt are all the same
    was_training = model.training
    model.eval()
    correct = total = 0
    try:
        # its own random stream: TRL's training draws the same whether or how often it is evaluated
        with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
            torch.manual_seed(cfg.seed)
            for i in range(0, len(texts), batch):
                enc = tokenizer(texts[i:i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
                enc = {k: v.to(model.device) for k, v in enc.items()}
                with torch.no_grad():
                    out = model.generate(**enc, do_sample=not greedy, temperature=None if greedy else e.temperature,
                                         top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,  # 0: off, as in rollover
                                         min_p=cfg.rollout.min_p or None, repetition_penalty=cfg.rollout.repetition_penalty,
                                         max_new_tokens=cfg.rollout.max_new_tokens, num_return_sequences=n,
                                         pad_token_id=tokenizer.pad_token_id)
                new = out[:, enc["input_ids"].shape[1]:]
                weight = e.samples_per_prompt // n  # the samples one completion stands for
                for k, ids in enumerate(new):
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    correct += weight * (numeric_reward(text, answers[i + k // n]) >= cfg.reward.correct_threshold)
                    total += weight
    finally:
        model.train(was_training)
    return correct / max(total, 1)
