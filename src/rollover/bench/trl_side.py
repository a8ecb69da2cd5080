"""The `rollover bench train` workload through TRL's GRPOTrainer (`--compare trl`).

Same model (loaded by rollover from the GGUF file, fp32), same prompts (the generator, system
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
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"rollover bench train --compare trl: needs TRL ({e}); pip install trl") from None
    from datasets import Dataset
    from transformers import TrainerCallback

    from rollover.config import load_config
    from rollover.data.generators import generate_from_spec
    from rollover.data.render import render_messages
    from rollover.models import load_hf_model, load_tokenizer
    from rollover.rewards.builtins import numeric_reward

    cfg = load_config(None, [f"model={args.model}", *workload, *args.overrides])
    d, r = cfg.data, cfg.rollout
    prompts = generate_from_spec(d.train)
    rows = [{"prompt": render_messages(p, d.system_prompt, d.instruction), "answer": p.answer} for p in prompts]

    def numeric(prompts, completions, answer, **_):
        return [numeric_reward(c[-1]["content"], a) for c, a in zip(completions, answer)]

    tokenizer = load_tokenizer(cfg.model)
    tokenizer.padding_side = "left"
    completions = r.prompts_per_step * r.samples_per_prompt
    micro = min(8, completions)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="rollover-bench-trl-"), use_cpu=True, bf16=False, seed=cfg.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
        num_generations=r.samples_per_prompt, max_completion_length=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, learning_rate=cfg.train.lr, lr_scheduler_type=cfg.train.schedule,
        warmup_steps=cfg.train.warmup_steps, max_grad_norm=cfg.train.grad_clip, beta=0.0, num_iterations=1,
        max_steps=args.steps + 1, logging_steps=1, save_strategy="no", report_to="none",
        dataloader_num_workers=0, disable_tqdm=True,
    )
    times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            times.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(model=load_hf_model(cfg.model), reward_funcs=[numeric], args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h][1:]
    return {
        "trl_version": trl.__version__, "steps_measured": len(times) - 1,
        "seconds_per_step": statistics.fmean(times[1:]), "step_seconds": times[1:],
        "reward_mean": statistics.fmean(h["reward"] for h in logs) if logs else None,
        "completion_length_mean": statistics.fmean(h["completions/mean_length"] for h in logs
                                                   if "completions/mean_length" in h) if logs else None,
    }
