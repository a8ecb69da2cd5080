"""Building a run from its config.

`build_run(cfg)` loads the tokenizer and model, renders and length-checks every prompt at
start-up, builds the engine, trainer, reward runner and metrics logger, and restores the
latest checkpoint when `resume` says so. The loops (`sync.py`, `async_.py`) only drive the
`Run` it returns (`common.py`).

Nothing is written into `run_dir` until the run is accepted: the data loaded and
length-checked, the model and tokenizer loaded, the rewards resolved and the checkpoint (if
any) restored under a config that trains the same thing (`config.config_changes`). A run
refused on the way leaves the run dir as it found it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollover.algos.loss_options import loss_caveats
from rollover.config import Config, ConfigError
from rollover.loops.common import Run, _NoRecord
from rollover.loops.prompts import (MediaStore, _check_best, _check_stand_in, _env_processor, _media_store, _prompts,
                                    _render_all, _steps_from_epochs, _train_iterator,
                                    _warn_if_a_step_exceeds_the_data, eval_sources, first_held_out)
from rollover.loops.resume import (check_lora_matches, checkpoint_to_resume, config_changes_since, has_metrics,
                                   lock_run_dir, record_config, restart_without_checkpoint, run_dir_state,
                                   set_aside_later_checkpoints)
from rollover.models import eos_ids, text_config
from rollover.rewards import RewardRunner, TrainerState, build_rewards
from rollover.train import checkpoint
from rollover.train.seeding import seed_everything, use_deterministic_kernels
from rollover.train.weight_sync import InProcessWeightSync, RayWeightSync, share_engine_weights
from rollover.types import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rollover.data import MixedIterator, PromptIterator
    from rollover.envs.base import EnvGroupBuilder

log = logging.getLogger("rollover")



def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"device={name!r} is not a device torch knows ({e})") from None
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={name!r}: torch sees no MPS device here (an Apple GPU, with torch built for it)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device={name!r}: torch sees no CUDA device here")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"device={name!r}: torch sees {count} CUDA device{'s' if count > 1 else ''} "
                              f"(cuda:0 to cuda:{count - 1})")
    return device


def check_rank_devices(cfg: Config, device: torch.device, cuda_count: int, under_torchrun: bool) -> None:
    """The sharded trainer's ranks against the devices here: rank r of the ranks the command starts
    takes cuda:r (each needs a GPU of its own), and CPU offload is for ranks on GPUs."""
    t = cfg.train
    if t.parallel != "fsdp" or cfg.runtime != "local":
        return  # (Ray places rank actors on the GPUs it finds)
    if t.fsdp_offload and device.type != "cuda":
        raise ConfigError(f"train.fsdp_offload keeps each rank's shards in CPU memory while its GPU computes; on "
                          f"device={cfg.device!r} ({device.type}) they are in CPU memory already: leave it off")
    if device.type != "cuda" or under_torchrun:  # (torchrun gives each process its LOCAL_RANK's GPU)
        return
    if device.index not in (None, 0):
        raise ConfigError(f"device={cfg.device!r} with train.parallel=fsdp: the ranks take cuda:0 to "
                          f"cuda:{t.ranks - 1} (rank r on cuda:r); choose the GPUs with CUDA_VISIBLE_DEVICES")
    if t.ranks > cuda_count:
        raise ConfigError(f"train.ranks={t.ranks}: torch sees {cuda_count} CUDA device{'s' if cuda_count != 1 else ''} "
                          "here and each rank needs one of its own (rank r on cuda:r); give at most that many ranks, "
                          "or start them on several nodes with torchrun")


def _reward_runner(cfg: Config) -> RewardRunner:
    workers = cfg.runtime == "ray" and bool(cfg.ray.reward_workers)
    try:
        functions = build_rewards(cfg.reward.functions, here=not workers)  # Ray reward workers load their own
    except (FileNotFoundError, ImportError, AttributeError, SyntaxError, TypeError, ValueError) as e:
        # a reference that names nothing, a file that does not compile, a function that cannot take a sample
        raise ConfigError(f"reward.functions: {' '.join(_reward_error(e).split())}") from e
    pool = None
    if cfg.runtime == "ray" and cfg.ray.reward_workers:
        from rollover.runtime.rewards import RayRewardPool

        pool = RayRewardPool(functions, size=cfg.ray.reward_workers, timeout_s=cfg.reward.timeout_s,
                             gpus=cfg.ray.gpus_per_reward_worker,
                             cpus=cfg.ray.cpus_per_reward_worker)
    return RewardRunner(functions, timeout_s=cfg.reward.timeout_s, on_error=cfg.reward.on_error,
                        workers=cfg.reward.workers, pool=pool)


def _close_quietly(*closes) -> None:
    """Each of `closes` called (None skipped) while a failed build unwinds: a close that fails too
    is logged, and the build's own error is the one raised."""
    for close in closes:
        if close is None:
            continue
        try:
            close()
        except Exception:
            log.warning("closing what a failed start had built failed too", exc_info=True)


def _reward_error(e: Exception) -> str:
    """A reward's building error as the user needs it: rollover's own checks say what is wrong;
    an error raised in the user's code (importing their module, a reward model's loading) keeps
    its type and where it was raised."""
    import traceback

    if isinstance(e, (SyntaxError, ImportError)):  # (the file and line are in a SyntaxError's text)
        return f"{type(e).__name__}: {e}"
    frames = traceback.extract_tb(e.__traceback__)
    if not frames or Path(frames[-1].filename).resolve().is_relative_to(Path(__file__).resolve().parents[1]):
        return str(e)
    return f"{type(e).__name__} at {frames[-1].filename}:{frames[-1].lineno}: {e}"


def _load_model(cfg: Config, ckpt: Path | None, training: bool):
    from rollover.models import load_hf_model, resolve_model
    from rollover.train.lora import apply_lora

    src = resolve_model(cfg.model)
    if ckpt is not None and training:
        check_lora_matches(cfg, ckpt)
    if ckpt is not None and (ckpt / "adapter").exists() and cfg.train.lora is None:
        raise ConfigError(f"{ckpt} holds a LoRA adapter but train.lora is unset; set train.lora as the run that "
                          "wrote it did")
    if ckpt is not None and (ckpt / "model").exists():
        src = str(ckpt / "model")
    model = load_hf_model(src, dtype=torch.float32)
    if cfg.train.lora is not None:
        if ckpt is not None and (ckpt / "adapter").exists():
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(ckpt / "adapter"), is_trainable=True)
        else:
            model = apply_lora(model, cfg.train.lora)
    return model


def build_run(cfg: Config, *, engine_factory=None, allow_config_change: bool = False, record: bool = True) -> Run:
    """Everything a loop needs, with the checkpoint `cfg.resume` names restored.

    `allow_config_change`: resume even when the config differs from the checkpoint's in what
    is trained (the differences are logged and kept in RUN_DIR/config_changes.log).
    `record=False` builds a run that writes nothing anywhere (evaluation): no config.yaml, no
    metrics, and no comparison with the checkpoint's config.

    In order: where the run trains and what it resumes (`_start`), the data and rewards
    (`_inputs`), the model and the models beside it checked against the data (`_check_models`),
    the trainer and engine, then the run accepted (`_accept`): only then is run_dir written.
    """
    start = _start(cfg, allow_config_change, record)
    seed_everything(cfg.seed)
    inputs = _inputs(cfg, record)
    trainer = engine = None
    try:
        if record:
            _check_data(inputs.train_iter, start)
        if record and start.state is not None and start.state["step"] > cfg.steps:
            raise ConfigError(f"the run in {Path(cfg.run_dir)} has trained {start.state['step']} steps, past "
                              f"steps={cfg.steps}: nothing to train (steps counts from the run's start: give more "
                              f"than {start.state['step']} to go on); nothing was changed")
        model = _load_model(cfg, start.ckpt, training=record)
        longest, env_processor = _check_models(cfg, model, inputs, record)
        eos_token_ids = list(eos_ids(getattr(model, "generation_config", None), model.config, inputs.tokenizer))
        trainer = _make_trainer(cfg, model, inputs.tokenizer.pad_token_id or 0, start.device, start.ckpt,
                                start.remote_trainer, record)
        del model  # held by the trainer (or sent to its actor or ranks): no second reference here
        engine, weights = _make_engine(cfg, trainer, engine_factory, start.device, longest + 1, eos_token_ids)
    except BaseException:  # what was built goes, in the order Run.close takes
        _close_quietly(inputs.rewards.close, engine and engine.shutdown, trainer and trainer.close)
        raise
    run = Run(cfg=cfg, device=start.device, tokenizer=inputs.tokenizer, model=trainer.model, engine=engine,
              trainer=trainer, train_iter=inputs.train_iter, eval_prompts=inputs.eval_prompts, rewards=inputs.rewards,
              prompt_ids=inputs.prompt_ids, logger=_NoRecord(), data_skipped=inputs.skipped, checkpoint=start.ckpt,
              env_builder=inputs.env_builder, eval_sources=inputs.sources, media=inputs.media,
              env_processor=env_processor)
    run.weights = weights
    try:
        _attach_parts(run, cfg)
        _accept(run, start, record)
    except BaseException:
        run.close()
        raise
    if start.ckpt is not None:
        log.info("%s from %s at step %d", "resumed" if record else "loaded", start.ckpt, run.start_step)
    return run


@dataclass
class _Start:
    """What `build_run` settles before it loads anything: where the run trains and what it resumes."""

    device: torch.device
    remote_trainer: bool  # ray.trainer: actor: the driver holds no trainer
    found: object  # run_dir's checkpoints and metrics as first seen (`run_dir_state`)
    ckpt: Path | None  # the checkpoint to resume from
    changes: list  # what the config changed since that checkpoint (allow_config_change)
    allow_config_change: bool  # resume whatever changed, the training data too
    state: dict | None  # the checkpoint's state


def _start(cfg: Config, allow_config_change: bool, record: bool) -> _Start:
    """The device, and the checkpoint `cfg.resume` names with its state; a run_dir in use by a
    live run, or holding a run that `resume` says not to continue, is refused here."""
    # a trainer actor (ray.trainer: actor) trains wherever Ray puts it: the driver needs no GPU;
    # an evaluation (record=False) builds none (it only samples)
    remote_trainer = cfg.runtime == "ray" and cfg.ray.trainer == "actor" and record
    device = torch.device("cpu") if remote_trainer else pick_device(cfg.device)
    if record:
        from rollover.train.torchrun import torchrun_env

        check_rank_devices(cfg, device, torch.cuda.device_count() if torch.cuda.is_available() else 0,
                           torchrun_env() is not None)
    if cfg.train.deterministic:
        use_deterministic_kernels()
    run_dir = Path(cfg.run_dir)
    if record and run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir {run_dir} is a file: give a directory (one that does not exist is made)")
    if record and (blocked := next((p for p in run_dir.parents if p.exists() and not p.is_dir()), None)) is not None:
        raise ConfigError(f"run_dir {run_dir}: {blocked} is a file, so no directory can be made under it")
    if record and run_dir.is_dir():
        lock_run_dir(run_dir).close()  # in use by a live run: refused before anything is built
    found = run_dir_state(run_dir) if record else None
    ckpt = checkpoint_to_resume(cfg)
    changes = config_changes_since(cfg, ckpt, allow_config_change) if record and ckpt is not None else []
    if record and cfg.resume == "never" and has_metrics(run_dir):
        raise ConfigError(f"run_dir {run_dir} already holds a run (metrics.jsonl) and resume=never starts a new one: "
                          "give another run_dir, or resume=auto to continue it")
    if record and ckpt is None and cfg.resume == "auto" and has_metrics(run_dir):
        restart_without_checkpoint(cfg, run_dir, allow_config_change)
    if Path(cfg.model).is_dir() and not (Path(cfg.model) / "config.json").is_file():
        raise ConfigError(f"model={cfg.model!r} is a directory without config.json, not a saved model")
    state = checkpoint.load_state(ckpt) if ckpt is not None else None
    return _Start(device=device, remote_trainer=remote_trainer, found=found, ckpt=ckpt, changes=changes,
                  allow_config_change=allow_config_change, state=state)


@dataclass
class _Inputs:
    """The tokenizer, rewards, environments and prompts of a run, rendered and length-checked."""

    tokenizer: PreTrainedTokenizerBase
    rewards: RewardRunner
    env_builder: EnvGroupBuilder | None
    train_iter: PromptIterator | MixedIterator
    eval_prompts: list[Prompt]
    prompt_ids: dict[str, list[int]]
    sources: dict[str, str]
    media: MediaStore | None
    skipped: int  # malformed rows skipped and prompts too long for data.max_prompt_tokens


def _inputs(cfg: Config, record: bool) -> _Inputs:
    """The data rendered with the tokenizer, the rewards and the environment builder; sets
    `cfg.steps` from `data.epochs` where that is given."""
    from rollover.models import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    rewards = _reward_runner(cfg)
    try:
        return _rest_of_inputs(cfg, record, tokenizer, rewards)
    except BaseException:
        _close_quietly(rewards.close)  # a reward model loaded, a reward process pool
        raise


def _rest_of_inputs(cfg: Config, record: bool, tokenizer, rewards: RewardRunner) -> _Inputs:
    env_builder = None
    if cfg.env.name is not None:
        from rollover.envs.builders import make_env_builder

        env_builder = make_env_builder(cfg.env.name, cfg.env.options)
        if cfg.reward.functions != type(cfg.reward)().functions:
            log.warning("reward.functions is not called in a multi-turn run: env.name=%s gives each episode's reward "
                        "(a score option of the environment, where it has one, is where a reward of yours goes)",
                        cfg.env.name)
    train_prompts, eval_prompts, skipped, sets = _prompts(cfg, env_builder)
    if skipped:
        log.warning("data: skipped %d malformed rows (data.on_bad_row=skip)", skipped)
    # images among the held-out rows that may be held out (the first eval_size, unless some do not fit)
    media = _media_store(cfg, train_prompts + (eval_prompts if cfg.data.eval is None else
                                               first_held_out(cfg, eval_prompts, sets)))
    prompt_ids, train_prompts, eval_prompts, too_long = _render_all(cfg, tokenizer, train_prompts, eval_prompts, media,
                                                                    sets)
    sources = eval_sources(cfg, eval_prompts, sets)
    train_iter = _train_iterator(cfg, train_prompts, sets)
    _check_best(cfg, env_builder, sources, rewards, eval_prompts)
    _warn_if_a_step_exceeds_the_data(cfg, len(train_prompts))
    for caveat in [*loss_caveats(cfg), *cfg.unused_settings()] if record else ():  # (not for an evaluation)
        log.warning("%s", caveat)
    _steps_from_epochs(cfg, len(train_prompts))
    rewards.trainer_state = TrainerState(global_step=0, max_steps=cfg.steps)  # (steps set from data.epochs too)
    return _Inputs(tokenizer=tokenizer, rewards=rewards, env_builder=env_builder, train_iter=train_iter,
                   eval_prompts=eval_prompts, prompt_ids=prompt_ids, sources=sources, media=media,
                   skipped=skipped + too_long)


def _check_models(cfg: Config, model, inputs: _Inputs, record: bool) -> tuple[int, object | None]:
    """The most tokens a sample holds, checked against the model's context and against the
    critic's and teacher's where the run has them; and the processor that renders episodes'
    images (None without one)."""
    if inputs.media is not None and cfg.train.parallel != "none":
        _check_stand_in(model)
    env_processor = _env_processor(cfg, model) if inputs.env_builder is not None else None
    if inputs.env_builder is not None:
        from rollover.envs.builders import check_template

        try:
            check_template(inputs.env_builder, inputs.tokenizer, env_processor, **cfg.data.chat_template_kwargs)
        except ValueError as e:  # (a tokenizer without a chat template too: episodes need one)
            raise ConfigError(str(e)) from None
    longest = _longest(cfg, model, inputs.prompt_ids, inputs.env_builder)
    if record and cfg.algorithm.advantage == "gae" and cfg.critic.model is not None:
        from rollover.train.critic import check_critic_model

        try:
            check_critic_model(cfg.critic.model, inputs.tokenizer, model.config, longest,
                               sequence_parallel=cfg.train.sequence_parallel, lora=cfg.train.lora)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if record and cfg.distill.teacher is not None:
        from rollover.train.teacher import check_teacher_model

        try:
            check_teacher_model(cfg.distill.teacher, inputs.tokenizer, model.config, longest,
                                sequence_parallel=cfg.train.sequence_parallel)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return longest, env_processor


def _accept(run: Run, start: _Start, record: bool) -> None:
    """The run's environment workers started and its checkpoint restored; then, recording, the
    run is accepted: run_dir locked, the metrics logger opened and the config recorded."""
    cfg = run.cfg
    if run.env_builder is not None and cfg.runtime == "ray" and cfg.ray.env_workers:
        _start_env_workers(run, cfg, run.env_builder)
    if start.state is not None:
        _restore(run, start.state, record)
    if not record:
        return
    from rollover.metrics import MetricsLogger

    run_dir = Path(cfg.run_dir)
    run.lock = lock_run_dir(run_dir)
    if run_dir_state(run_dir) != start.found:  # another run on run_dir ended while this one was built
        raise ConfigError(f"run_dir {run_dir} changed while this run was starting: another process wrote "
                          "checkpoints or metrics there and has ended; run the command again to start from "
                          "what it left")
    # resuming at step s drops the killed run's rows after s; a restart from scratch under
    # resume=auto drops them all; resume=never was refused above if run_dir has metrics
    resume_step = start.state["step"] if start.state else (-1 if cfg.resume == "auto" else None)
    run.logger = MetricsLogger(run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                               resume=resume_step)
    if start.state is not None:  # a resume from an earlier checkpoint than the newest: the later ones go aside
        set_aside_later_checkpoints(run_dir, start.state["step"])
    record_config(cfg, run_dir, start.ckpt, start.changes)


def _start_env_workers(run: Run, cfg: Config, env_builder) -> None:
    """The run's environments on Ray actors (`ray.env_workers`), each building the environment
    now from the driver's options (a builder's `worker_options` where it has them: paths made
    absolute), so a setup error stops the run here."""
    from rollover.rewards.registry import _absolute
    from rollover.runtime.envs import RayEnvBuilder

    options = env_builder.worker_options() if hasattr(env_builder, "worker_options") else cfg.env.options
    run.env_workers = RayEnvBuilder(env_builder, _absolute(cfg.env.name), options, workers=cfg.ray.env_workers,
                                    cpus=cfg.ray.cpus_per_env_worker, concurrency=max(16, cfg.env.max_concurrent))
    run.env_builder = run.env_workers
    run.env_workers.start()


def _longest(cfg: Config, model, prompt_ids: dict, env_builder) -> int:
    """The most tokens a sample can hold (prompt and response, or an episode's turns), checked
    against the model's context."""
    ctx = getattr(model.config, "max_position_embeddings", None)
    longest = max(map(len, prompt_ids.values())) + cfg.rollout.max_new_tokens
    if env_builder is not None:
        longest = cfg.env.max_total_tokens  # an episode's tokens, all turns included
    if ctx is not None and longest > ctx:
        what = "env.max_total_tokens" if env_builder is not None else "the longest prompt plus rollout.max_new_tokens"
        raise ConfigError(f"{what} is {longest} tokens, more than the model's context of {ctx}")
    return longest


def _make_trainer(cfg: Config, model, pad_id: int, device, ckpt: Path | None, remote_trainer: bool, record: bool):
    """One trainer here, a trainer actor, FSDP rank processes or FSDP rank actors."""
    if not record:  # an evaluation only samples: no critic, KL reference or teacher to build or load
        quiet = {"advantage": "grpo", "kl_coef": 0.0, "kl_in_reward": 0.0, "ref_sync_every": None}
        cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update=quiet),
                                     "distill": cfg.distill.model_copy(update={"teacher": None})})
    if cfg.train.sequence_parallel > 1:  # before any rank starts
        from rollover.train.ulysses import check

        try:
            check(text_config(model.config), cfg.train.sequence_parallel)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    ref = _reference(cfg, ckpt)
    if remote_trainer and cfg.train.parallel == "fsdp":
        from rollover.runtime.trainer_group import RayShardedTrainer

        return RayShardedTrainer(model, cfg, pad_id=pad_id, checkpoint=ckpt, reference=ref)
    if remote_trainer:  # the actor holds the model; the driver keeps its config (trainer.model)
        from rollover.runtime.trainer import RemoteTrainer

        return RemoteTrainer(model, cfg, pad_id=pad_id, reference=ref)
    if cfg.train.parallel == "fsdp" and record:
        from rollover.train.ranks import ShardedTrainer

        return ShardedTrainer(model, cfg, pad_id=pad_id, checkpoint=ckpt, reference=ref)
    from rollover.train.trainer import Trainer

    return Trainer(model, cfg, device=device, pad_id=pad_id, reference=ref)


def _reference(cfg: Config, ckpt: Path | None):
    """The KL reference for a resumed run: the starting model (`model`), not the checkpoint's
    policy the trainer resumes from. None where the trainer's copy of its model is it: a fresh run,
    or LoRA, whose reference is the base model under the adapter."""
    if not cfg.algorithm.uses_reference or cfg.train.lora is not None or ckpt is None or not (ckpt / "model").exists():
        return None
    from rollover.models import load_hf_model

    return load_hf_model(cfg.model, dtype=torch.float32)


def _make_engine(cfg: Config, trainer, engine_factory, device, max_len: int, eos_token_ids: list[int]):
    """The rollout engine (here, Ray workers, or the FSDP ranks' own) and the seam the trainer's
    weights take to it."""
    if engine_factory is None and cfg.runtime == "ray":
        from rollover.runtime.router import RayEngine

        engine_factory = RayEngine
    elif engine_factory is None:
        from rollover.engine import make_engine

        engine_factory = make_engine
    architecture = trainer.architecture
    colocated = trainer.sharded and cfg.train.colocate  # the engines live in the ranks
    if colocated:
        from rollover.runtime.colocated import ColocatedEngines

        engine = ColocatedEngines(trainer, cfg, max_len=max_len, eos_token_ids=eos_token_ids,
                                  vocab_size=text_config(architecture.config).vocab_size)
    else:
        engine = engine_factory(cfg, architecture, weights=trainer.named_weights(), device=device,
                                max_len=max_len, eos_token_ids=eos_token_ids)
    try:
        share_engine_weights(cfg, engine, trainer)
    except BaseException:
        engine.shutdown()
        raise
    if colocated:
        from rollover.runtime.colocated import ColocatedWeightSync

        weights = ColocatedWeightSync(engine)
    else:
        weights = RayWeightSync(engine) if cfg.runtime == "ray" else InProcessWeightSync(engine)
    return engine, weights


def _attach_parts(run: Run, cfg: Config) -> None:
    """The parts some runs have: prompt selection, the environments' runner and turn budgets."""
    if cfg.selection.policy != "uniform" or cfg.selection.allocation != "fixed":
        from rollover.rollout.selection import PromptSelection

        run.selection = PromptSelection(cfg.selection, seed=cfg.seed, correct=cfg.reward.correct_threshold,
                                        per_step=cfg.rollout.prompts_per_step)
    if run.env_builder is not None:
        from rollover.rollout.core import EnvRunner

        run.env_runner = EnvRunner(cfg.env.max_concurrent, inline=cfg.env.inline)
        if cfg.env.dynamic_turns:
            from rollover.rollout.curation import TurnBudget

            e = cfg.env
            run.turn_budget = TurnBudget(e.max_turns, e.min_turns, e.dynamic_turns_threshold, cfg.reward.correct_threshold)


def _data_unlike(train_iter, state: dict) -> str | None:
    """Why the checkpoint's place in the training data does not fit this run's data (a file edited
    since, another data.train, seed, data.shuffle or data.train_weights), or None."""
    try:
        train_iter.check_state(state["data"])
    except ValueError as e:
        return str(e)
    return None


def _check_data(train_iter, start: _Start) -> None:
    """A resume's training data, checked before the model loads: unlike the checkpoint's, it is
    refused, or under allow_config_change drawn from its start (`_restore`)."""
    why = _data_unlike(train_iter, start.state) if start.state is not None else None
    if why is not None and not start.allow_config_change:
        raise ConfigError(f"the training data is not the checkpoint's ({why}): it changed since the run was saved; "
                          "to go on drawing the new data from its start, pass --allow-config-change "
                          "(build_run(cfg, allow_config_change=True))")


def _restore(run: Run, state: dict, record: bool = True) -> None:
    """The checkpoint's state into the run's parts; training data unlike the checkpoint's
    (accepted by `_check_data`) is drawn from its start."""
    if record or not state["trainer"].get("sharded"):  # an evaluation's trainer only holds the checkpoint's model
        run.trainer.load_state_dict(state["trainer"])
    why = _data_unlike(run.train_iter, state)
    if not record:  # an evaluation draws no training prompt, but may carve its held-out ones from them
        if why is not None and run.cfg.data.eval is None and run.cfg.data.eval_size > 0:
            log.warning("the training data is not the checkpoint's (%s): the held-out prompts carved from it "
                        "(data.eval_size) may not be the run's own, and may include prompts it trained on; give "
                        "data.eval to evaluate on a set of your own", why)
    elif why is not None:
        log.warning("the training data is not the checkpoint's (%s); allowed (allow_config_change): it is drawn "
                    "from its start", why)
    else:
        run.train_iter.load_state_dict(state["data"])
    if record:
        if run.turn_budget is not None and state.get("turn_budget"):
            run.turn_budget.load_state_dict(state["turn_budget"])
        if run.selection is not None and state.get("selection"):
            run.selection.load_state_dict(state["selection"])
    run.serial = state["serial"]
    run.start_step = state["step"]
    run.at_step(state["step"])
    run.weights.push(run.trainer.named_weights(), version=state["version"])
    run.engine.settle()  # lazy pulls: no restored request is sampled before every worker holds the checkpoint's weights
    checkpoint.set_rng_state(state["rng"])
    run.resumed_extra = state
