"""Config parsing: typed, documented, range-checked per field, unknown keys suggested, conflicts
rejected, resume differences listed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rollover.cli import main
from rollover.config import Config, ConfigError, config_changes, describe, dump_config, load_config, read_yaml

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse(path):
    from rollover.sim.config import load_sim_config

    if path.name.startswith("sim_"):  # `rollover simulate`'s: a training config plus the simulated cluster
        cfg = load_sim_config(path)
        with pytest.raises(ConfigError, match="unknown key 'simulate': .* read by `rollover simulate`"):
            load_config(path)
    else:
        cfg = load_config(path)
    # examples run offline on the embedded model (or one their script builds from it), unless they say they
    # need the hub
    text = path.read_text()
    assert cfg.model == "smollm2-135m-instruct" or "needs the Hugging Face hub" in text or \
        (f"python examples/{path.stem}.py" in text and (path.parent / f"{path.stem}.py").is_file())


def test_overrides_and_types():
    cfg = load_config(EXAMPLES[0], ["rollout.temperature=0.7", "train.lr=3e-6", "reward.functions=[math, numeric]"])
    assert cfg.rollout.temperature == 0.7 and cfg.train.lr == 3e-6 and cfg.reward.functions == ["math", "numeric"]
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        load_config(overrides=["steps"])
    with pytest.raises(ConfigError, match=r"overrides must be a list of key.path=value strings, got one string: \['steps=3'\]"):
        load_config(EXAMPLES[0], "steps=3")


def test_assigning_a_top_level_field_checks_that_field_and_keeps_the_rest():
    """A sweep sets run_dir or seed on a loaded config: that assignment broke the algorithm
    section (a dict in place of its object) and raised an AttributeError."""
    from pydantic import ValidationError

    cfg = load_config(model="m", run_dir="r", **{"data.train": "d", "algorithm.eps_high": 0.28})
    cfg.run_dir, cfg.seed, cfg.steps = "runs/other", 7, 5
    assert (cfg.run_dir, cfg.seed, cfg.steps) == ("runs/other", 7, 5)
    assert cfg.algorithm.eps_high == 0.28 and cfg.algorithm.loss == "ppo"
    with pytest.raises(ValidationError, match="steps"):
        cfg.steps = 0
    assert cfg.steps == 5
    # the keys the default loss follows: assigned, async would train with the synchronous loss
    for name, value in [("mode", "async"), ("partial_rollout", {"enabled": True}), ("algorithm", {"eps_high": 0.3})]:
        with pytest.raises(AttributeError, match=rf"cfg.{name} is not assigned: the default algorithm.loss follows"):
            setattr(cfg, name, value)
    assert (cfg.mode, cfg.partial_rollout.enabled, cfg.algorithm.loss) == ("sync", False, "ppo")



@pytest.mark.parametrize("override, key, value", [
    ("data.instruction=Answer: give a number", "instruction", "Answer: give a number"),  # not a mapping
    ("data.instruction=yes", "instruction", "yes"),  # not true
    ("data.instruction=42", "instruction", "42"),
    ("data.train=/data/set #1.jsonl", "train", "/data/set #1.jsonl"),  # not cut at a YAML comment
    ("data.instruction='quoted: yes'", "instruction", "quoted: yes"),  # quoted: YAML's reading
    ("data.instruction=null", "instruction", None),
    ("data.instruction=a: b: c", "instruction", "a: b: c"),  # not YAML at all: the text still
    ("data.instruction=* Put the answer last", "instruction", "* Put the answer last"),
    ("data.instruction=&a Be brief", "instruction", "&a Be brief"),
])
def test_an_override_of_a_text_key_is_the_text_given(override, key, value):
    assert getattr(load_config(overrides=[override]).data, key) == value


def test_a_comment_after_a_value_of_another_type_is_still_a_comment_and_overrides_may_be_any_iterable():
    cfg = load_config(overrides=["algorithm.loss=ppo # the default", "train.lr=1e-6 # a note", "steps=3 # three"])
    assert (cfg.algorithm.loss, cfg.train.lr, cfg.steps) == ("ppo", 1e-6, 3)
    assert load_config(overrides=(o for o in ["train.lr=0.5", "steps=7"])).steps == 7


def test_a_merged_key_may_be_given_again_but_an_own_key_not(tmp_path):
    (tmp_path / "m.yaml").write_text("base: &b {temperature: 0.7, top_p: 0.9}\nrollout:\n  <<: *b\n  temperature: 0.5\n")
    raw = read_yaml(tmp_path / "m.yaml")
    assert raw["rollout"] == {"temperature": 0.5, "top_p": 0.9}  # the merge overridden, as YAML means it
    (tmp_path / "d.yaml").write_text("rollout:\n  temperature: 0.7\n  temperature: 0.5\n")
    with pytest.raises(ConfigError, match=r"d.yaml:3:3: invalid YAML: key 'temperature' is given twice \(first on line 2\)"):
        read_yaml(tmp_path / "d.yaml")


def test_a_number_without_a_dot_in_exponent_form_is_a_number_in_free_form_mappings(tmp_path):
    """1e-1 (YAML 1.2, verl's OmegaConf) is a float inside a reward's kwargs, loss_options or
    engine_options too, where no field type makes the text a number; quoted, it stays text."""
    cfg = load_config(overrides=["algorithm.loss_options={is_cap: 5e0}", "rollout.engine_options={gpu_memory_utilization: 6e-1}",
                                 "reward.functions=[{fn: format, kwargs: {pattern: '1e5'}}]"])
    assert cfg.algorithm.loss_options == {"is_cap": 5.0} and cfg.rollout.engine_options == {"gpu_memory_utilization": 0.6}
    assert cfg.reward.functions[0]["kwargs"] == {"pattern": "1e5"}
    (tmp_path / "c.yaml").write_text("rollout:\n  engine_options: {swap: -2E+2, tag: 1e5x, scale: 1.5e3, rev: 3e81452}\n")
    assert read_yaml(tmp_path / "c.yaml")["rollout"]["engine_options"] == {"swap": -200.0, "tag": "1e5x", "scale": 1500.0,
                                                                          "rev": "3e81452"}  # (overflows: a git hash)
    # text of that form is quoted in config.yaml, so a recorded run reads back what it ran with
    cfg = load_config(overrides=["data.instruction=1e-6", "reward.functions=[{fn: format, kwargs: {pattern: '1e5'}}]"])
    (tmp_path / "r.yaml").write_text(dump_config(cfg))
    again = read_yaml(tmp_path / "r.yaml")
    assert again["data"]["instruction"] == "1e-6" and again["reward"]["functions"][0]["kwargs"] == {"pattern": "1e5"}


def test_off_unquoted_is_the_option_off():
    assert load_config(overrides=["selection.dars=off"]).selection.dars == "off"  # (YAML 1.1 reads it as false)


def test_lora_targets_as_peft_takes_them():
    for targets in ("all-linear", "ALL-LINEAR", r".*\\.(q_proj|v_proj)", "[q_proj, v_proj]"):
        load_config(overrides=[f"train.lora={{target_modules: {targets if targets[0] == '[' else repr(targets)}}}"])


def test_one_adapter_written_two_ways_is_no_config_change():
    import yaml

    saved = yaml.safe_load(dump_config(load_config(overrides=["train.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"])))
    same = load_config(overrides=["train.lora={r: 4, alpha: 8, target_modules: [v_proj, q_proj], dropout: 0.0}"])
    assert config_changes(saved, same) == []
    other = load_config(overrides=["train.lora={r: 8, alpha: 8, target_modules: [q_proj, v_proj]}"])
    assert [c.split(":")[0] for c in config_changes(saved, other)] == ["train.lora"]


def test_one_path_written_two_ways_is_no_config_change():
    """`tiny/` and `tiny`, `./a.jsonl` and `a.jsonl`: the same files; another path, or a text
    key with a slash, still a change."""
    import yaml

    saved = yaml.safe_load(dump_config(load_config(model="tiny", **{"data.train": "./a.jsonl",
                                                                    "data.eval": {"x": "b/", "y": "d?split=t"},
                                                                    "data.instruction": "a/b"})))
    same = load_config(model="tiny/", **{"data.train": "a.jsonl", "data.eval": {"x": "./b", "y": "d/?split=t"},
                                         "data.instruction": "a/b"})
    assert config_changes(saved, same) == []
    other = load_config(model="tiny2", **{"data.train": "gen:arithmetic?n=5", "data.eval": {"x": "b", "y": "d?split=t"},
                                          "data.instruction": "a/./b"})
    assert [c.split(":")[0] for c in config_changes(saved, other)] == ["model", "data.train", "data.instruction"]


def test_a_function_object_as_a_reward_says_how_to_name_it():
    def my_reward(completion, answer, **kw):
        return 1.0

    with pytest.raises(ConfigError, match=r"a function object \(my_reward\) cannot be written into a config: .*"
                                          r"'__main__:my_reward'"):
        load_config(**{"reward.functions": [my_reward]})
    from rollover.rewards import build_rewards

    with pytest.raises(TypeError, match="a function is named by reference: 'module:function'"):
        build_rewards([my_reward])


def test_a_mapping_for_a_section_sets_its_keys_and_keeps_the_others(tmp_path):
    """`data={...}` (a keyword or an override) sets those keys of the YAML's section; a key whose
    value is a mapping is replaced whole."""
    yaml_cfg = load_config("examples/arith.yaml")
    assert yaml_cfg.data.max_prompt_tokens != 256  # the default, which the YAML changes
    for cfg in (load_config("examples/arith.yaml", data={"eval_size": 16}),
                load_config("examples/arith.yaml", ["data={eval_size: 16}"])):
        assert cfg.data.eval_size == 16 and cfg.data.max_prompt_tokens == yaml_cfg.data.max_prompt_tokens
    assert load_config("examples/arith_async.yaml", ["async={max_staleness: 3}"]).async_.max_staleness == 3
    with_pool = tmp_path / "pool.yaml"
    with_pool.write_text("mode: async\nasync: {max_staleness: 3, experience_pool: true}\n")
    merged = load_config(with_pool, ["async={max_staleness: 1}"]).async_
    assert merged.max_staleness == 1 and merged.experience_pool
    cfg = load_config(**{"rollout.engine_options": {"forward": "rollover", "adapt_threads": False}},
                      overrides=["rollout.engine_options={forward: transformers}"])
    assert cfg.rollout.engine_options == {"forward": "transformers"}


@pytest.mark.parametrize("over, message", [
    ("rollout.max_rows=0", "rollout.max_rows=0: must be >= 1"),
    ("checkpoint.keep=0", "checkpoint.keep=0: must be >= 1"),
    ("checkpoint.keep=-2", "checkpoint.keep=-2: must be >= 1"),
    ("checkpoint.every=-1", "checkpoint.every=-1: must be >= 0"),
    ("steps=0", "steps=0: must be >= 1"),
    ("algorithm.eps_low=1.5", "algorithm.eps_low=1.5: must be <= 1"),  # (a ratio bound below 0: it had failed at the first update)
    ("algorithm.kl_estimator=low_var_kl", "algorithm.kl_estimator='low_var_kl': 'low_var_kl' is verl's name for k3: write k3"),
    ("steps=-5", "steps=-5: must be >= 1"),
    ("steps=abc", "steps='abc': must be an integer"),
    ("steps=2.5", "steps=2.5: must be an integer"),
    ("train.grad_clip=-1", "train.grad_clip=-1: must be >= 0"),
    ("train.lr=-1e-5", "train.lr=-1e-5: must be > 0"),
    ("train.lr=fast", "train.lr='fast': must be a number"),
    ("train.lr=.nan", "train.lr=NaN: must be a finite number"),
    ("train.betas=[0.9, 1.0]", "train.betas.1=1.0: must be < 1"),
    ("train.lora={r: 0}", "train.lora.r=0: must be an integer >= 1"),
    ("train.lora={rank: 4}", "train.lora: unknown keys ['rank']"),
    ("train.lora={target_modules: q_proj}", "train.lora.target_modules='q_proj': text is a regular expression that peft"),
    ("train.lora={target_modules: [123]}", "train.lora.target_modules=[123]: must be all-linear, a list"),
    ("train.lora={target_modules: []}", "train.lora.target_modules=[]: must be all-linear, a list"),
    ("data.eval_size=-1", "data.eval_size=-1: must be >= 0"),
    ("data.train=''", "data.train='': must not be empty"),
    ("rollout.top_p=2", "rollout.top_p=2: must be <= 1"),
    ("rollout.top_p=0", "rollout.top_p=0: must be > 0"),
    ("rollout.top_k=-1", "rollout.top_k=-1: must be >= 0"),
    ("rollout.min_p=1.5", "rollout.min_p=1.5: must be <= 1"),
    ("rollout.repetition_penalty=0", "rollout.repetition_penalty=0: must be > 0"),
    ("algorithm.top_entropy_quantile=-0.1", "algorithm.top_entropy_quantile=-0.1: must be >= 0"),
    ("algorithm.ref_mixup_alpha=0", "algorithm.ref_mixup_alpha=0: must be > 0"),
    ("rollout.temperature=0", "rollout.temperature=0: must be >= 0.01"),
    ("rollout.dtype=fp8", "rollout.dtype='fp8': must be 'auto', 'float32', 'bfloat16' or 'float16'"),
    ("reward.timeout_s=0", "reward.timeout_s=0: must be > 0"),
    ("reward.functions=[]", "reward.functions: must not be empty"),
    ("reward.functions=[{fn: numeric, weight: heavy}]", "reward.functions.0.weight='heavy': must be a number"),
    ("reward.functions=[numeric, {fn: format, weight: true}]", "reward.functions.1.weight=True: must be a finite number"),
    ("reward.functions=[{weight: 1}]", "reward.functions.0: needs `fn`"),
    ("reward.functions=[numeric, 3]", "reward.functions.1=3: must be a reward name or a mapping"),
    ("algorithm.dual_clip=1", "algorithm.dual_clip=1: must be > 1"),
    ("algorithm.eps_low=-0.1", "algorithm.eps_low=-0.1: must be >= 0"),
    ("algorithm.kl_coef=-1", "algorithm.kl_coef=-1: must be >= 0"),
    ("partial_rollout.oversample=0.5", "partial_rollout.oversample=0.5: must be >= 1"),
    ("partial_rollout.max_carry_steps=-1", "partial_rollout.max_carry_steps=-1: must be >= 0"),
    ("eval.samples_per_prompt=0", "eval.samples_per_prompt=0: must be >= 1"),
    ("async.max_staleness=-1", "async.max_staleness=-1: must be >= 0"),
    ("async.top_entropy_fraction=0", "async.top_entropy_fraction=0: must be > 0"),
    ("seed=-1", "seed=-1: must be >= 0"),
    ("device=gpu", "device='gpu': must be auto, cpu, cuda, cuda:N or mps"),
    ("steps=", "steps=null: must be an integer"),
])
def test_out_of_range_values_name_key_and_value(over, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[over])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_every_numeric_field_declares_its_range():
    import typing

    from pydantic import BaseModel

    unbounded_by_design = {"RewardConfig.correct_threshold"}  # any reward value can be the threshold

    def bounded(meta) -> bool:  # Ge(ge=1) etc., also inside a FieldInfo from Annotated[int, Field(ge=1)]
        flat = [x for m in meta for x in [m, *getattr(m, "metadata", [])]]
        return any(getattr(m, k, None) is not None for m in flat for k in ("ge", "gt", "le", "lt"))

    def walk(model):
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from walk(ann)
                continue
            for arg in [a for a in typing.get_args(ann) if a is not type(None)] or [ann]:  # X | None: X
                base, *meta = typing.get_args(arg) if typing.get_origin(arg) is typing.Annotated else (arg, *f.metadata)
                if base in (int, float) and not bounded(meta):
                    yield f"{model.__name__}.{name}"

    assert [n for n in walk(Config) if n not in unbounded_by_design] == []


def test_reward_weights_are_numbers_at_parse_time():
    cfg = load_config(overrides=["reward.functions=[numeric, {fn: format, weight: '0.5', kwargs: {pattern: x}}]"])
    assert cfg.reward.functions == ["numeric", {"fn": "format", "weight": 0.5, "kwargs": {"pattern": "x"}}]


def test_reward_isolate_is_a_known_boolean_key():
    cfg = load_config(overrides=["reward.functions=[{fn: numeric, isolate: true}]"])
    assert cfg.reward.functions == [{"fn": "numeric", "isolate": True, "weight": 1.0}]
    with pytest.raises(ConfigError, match=r"isolate='yes': must be true or false"):
        load_config(overrides=["reward.functions=[{fn: numeric, isolate: 'yes'}]"])


def test_invalid_yaml_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nrollout:\n  temperature: [0.7\n  top_p: 1\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:4:8: invalid YAML: ") as e:
        load_config(bad)
    assert "\n" not in str(e.value)
    (tmp_path / "list.yaml").write_text("- steps: 3\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="is a directory, not a YAML config file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"override 'reward.functions=\[math': the value is not valid YAML"):
        load_config(overrides=["reward.functions=[math"])


def test_yaml_file_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("checkpoint:\n  keep: 0\n")
    with pytest.raises(ConfigError, match=rf"^{path}: checkpoint.keep=0: must be >= 1$"):
        load_config(path)


@pytest.mark.parametrize("key, hint", [("rollout.temprature=1", "did you mean 'temperature'"),
                                       ("trian.lr=1", "did you mean 'train'"),
                                       ("algorithm.eps_hihg=0.3", "did you mean 'eps_high'"),
                                       ("asyn.max_staleness=2", "did you mean 'async'"),
                                       ("learning_rate=1e-5", "learning_rate is TRL's name for rollover's train.lr"),
                                       ("algorithm.adv_estimator=grpo", "adv_estimator is verl's name for rollover's algorithm.advantage"),
                                       ("train.beta=0.9", r"did you mean 'betas'\? \(beta is TRL's name for rollover's algorithm.kl_coef\)"),
                                       # a foreign name is not steered to a merely similar key of ours
                                       ("train.max_grad_norm=1", r"key 'train.max_grad_norm'; max_grad_norm is TRL's name for rollover's train.grad_clip$"),
                                       ("async.max_head_offpolicyness=2", "key 'async.max_head_offpolicyness'; max_head_offpolicyness is AReaL's name for rollover's async.max_staleness"),
                                       ("data=x.jsonl", "data='x.jsonl': must be a mapping of this section's keys")])
def test_unknown_keys_suggest_the_nearest(key, hint):
    with pytest.raises(ConfigError, match=hint):
        load_config(overrides=[key])


@pytest.mark.parametrize("over, match", [
    (["algorithm.loss=sapo", "algorithm.eps_high=0.3"], r"algorithm.eps_high for algorithm.loss=sapo, which clips nothing"),
    (["algorithm.loss=bapo", "algorithm.eps_low=0.1"], r"algorithm.eps_low for algorithm.loss=bapo.*chooses its bounds"),
    (["algorithm.overlong_penalty=0.5"], r"algorithm.overlong_penalty=0.5 .*algorithm.overlong_buffer=0 leaves off"),
    (["algorithm.max_resample_rounds=3"], r"max_resample_rounds=3 .*set algorithm.dynamic_sampling: true"),
    (["algorithm.tis_cap=2", "algorithm.loss_options={is_cap: 3}"], r"both cap the importance weight: give one"),
    (["algorithm.eps_high=0.5", "algorithm.loss_options={eps_high: 0.1}"], r"algorithm.eps_high=0.5 and algorithm.loss_options.eps_high=0.1 both set it"),
    (["algorithm.dual_clip=3", "algorithm.loss_options={dual_clip: 10}"], r"algorithm.dual_clip=3 and .*both set it"),
    (["algorithm.m2po_tau=0.04", "algorithm.loss_options={m2po_tau: 1}"], r"algorithm.m2po_tau=0.04 and .*both set it"),
    (["train.weight_bucket_mb=64"], r"train.weight_bucket_mb apply to the sharded trainer's ranks"),
    (["mode=async", "async.dynamic_samples=true", "selection.allocation=xrpo"], r"both size the groups: choose one"),
])
def test_keys_that_nothing_would_read_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model=m", "run_dir=r", *over])


def test_a_setting_given_once_in_loss_options_or_as_the_loss_own_default_is_not_a_conflict():
    gspo = load_config(None, ["model=m", "run_dir=r", "algorithm.loss=gspo", "algorithm.aggregation=seq-mean-token-mean",
                                     "algorithm.loss_options={eps_low: 0.001}"])
    assert gspo.algorithm.eps_low == 3e-4  # the loss's own default, which the option then overrides
    load_config(None, ["model=m", "run_dir=r", "algorithm.eps_high=0.28", "algorithm.loss_options={eps_high: 0.1}"])
    load_config(None, ["model=m", "run_dir=r", "algorithm.dual_clip=3", "algorithm.loss_options={dual_clip: 3}"])


@pytest.mark.parametrize("over, match", [
    (["selection.candidates=2", "selection.reprobe_every=3"],
     r"selection.candidates, selection.reprobe_every unused: selection.policy=uniform, allocation=fixed, dars=off"),
    (["selection.policy=skip_saturated", "selection.alpha0=2"], r"selection.alpha0 unused: selection.policy=skip_saturated"),
    (["selection.dars_max_samples=8"], r"selection.dars_max_samples unused"),
    (["mode=async", "async.min_samples=3"], r"async.min_samples unused: it bounds DART's dynamic samples"),
    (["mode=async", "partial_rollout.max_carry_steps=0"],
     r"partial_rollout.max_carry_steps unused: they configure APRIL, a sync-mode collector; .*async.max_staleness"),
    (["downsample.anneal_steps=5"], r"downsample.anneal_steps unused: it anneals from downsample.token_fraction_start"),
    (["partial_rollout.enabled=true", "rollout.inflight_weight_update=abort"],
     r"rollout.inflight_weight_update unused: it applies to mode: async; .*APRIL's partial_rollout.carry decides"),
    (["env.name=arithmetic_retry", "data.train=env", "data.system_prompt=Be brief", "data.chat_template=false"],
     r"data.system_prompt, data.chat_template unused: env.name=arithmetic_retry writes each episode's opening"),
])
def test_settings_of_a_feature_switched_off_are_warned_of_not_refused(over, match):
    """Switching a feature off for a comparison keeps its settings: the run says they are unused."""
    cfg = load_config(None, ["model=m", "run_dir=r", *over])
    assert any(re.search(match, line) for line in cfg.unused_settings()), cfg.unused_settings()
    assert load_config(None, ["model=m", "run_dir=r"]).unused_settings() == []


@pytest.mark.parametrize("over", [[], ["algorithm.loss=sapo"], ["algorithm.loss=bapo", "mode=async"],
                                  ["algorithm.loss=reinforce"], ["algorithm.dynamic_sampling=true"],
                                  ["selection.policy=thompson_skip_saturated", "selection.allocation=xrpo"],
                                  ["partial_rollout.enabled=true"]])
def test_a_runs_saved_config_loads_again(over, tmp_path):
    """config.yaml gives every key, defaults included (what `rollover eval RUN_DIR` reads): none of
    them counts as set where nothing reads it."""
    cfg = load_config(None, ["model=m", "run_dir=r", *over])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "config.yaml") == cfg
    # a run an earlier version accepted with a key nothing read: its record still loads (eval, show)
    older = yaml.safe_load(dump_config(cfg))
    older["algorithm"]["overlong_penalty"] = 0.5
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(older))
    assert load_config(tmp_path / "config.yaml", recorded=True).algorithm.overlong_penalty == 0.5
    with pytest.raises(ConfigError, match="overlong_penalty=0.5 weighs"):
        load_config(tmp_path / "config.yaml")


@pytest.mark.parametrize("over, match", [
    (["algorithm.loss=gspo"], "seq-mean-token-mean"),
    (["rollout.samples_per_prompt=1"], "samples_per_prompt must be >= 2"),
    (["critic.lr=1e-4", "algorithm.lam=0.95"], r"algorithm.lam, critic.lr set the critic of algorithm.advantage=gae, "
                                               "which algorithm.advantage=grpo does not use"),
    (["critic.model=other"], "critic.model set the critic of algorithm.advantage=gae"),
    (["algorithm.advantage=gae", "algorithm.loss=gspo", "algorithm.aggregation=seq-mean-token-mean"],
     "use gspo_token"),
    (["algorithm.advantage=gae", "downsample.keep=2"], "gae with downsample"),
    (["algorithm.kl_in_reward=0.1"], "kl_in_reward=0.1 puts a KL penalty on each token's reward.*needs "
                                     "algorithm.advantage=gae"),
    (["algorithm.kl_in_reward_target=0.1"], "steer the KL penalty in the reward: set algorithm.kl_in_reward > 0"),
    (["algorithm.advantage=gae", "critic.warmup_steps=20"], "with steps=20 the policy would never train"),
    (["rollout.samples_per_prompt=1", "algorithm.advantage=reinforce_pp_baseline"], "samples_per_prompt must be >= 2"),
    (["algorithm.dynamic_sampling=true", "rollout.samples_per_prompt=1", "algorithm.advantage=reinforce_pp_baseline"], "dynamic_sampling"),
    (["partial_rollout.enabled=true", "partial_rollout.adaptive=true", "partial_rollout.oversample=5"],
     r"oversample=5.0 must lie in \[min_oversample, max_oversample\] = \[1.0, 4.0\]"),
    (["train.mini_batches=9"], "train.mini_batches=9 cannot exceed rollout.prompts_per_step=8"),
    (["partial_rollout.enabled=true", "partial_rollout.max_carry_steps=0"],
     "score_lag=1 carries complete groups one version old .* max_carry_steps=0 with on_stale=mask"),
    (["train.micro_batch_tokens=100"], "train.micro_batch_tokens=100 must be >= train.pack_length"),
    (["async.max_staleness=2"], "mode is sync"),
    (["mode=async", "partial_rollout.enabled=true"], "applies to sync mode"),
    (["data.chat_template=false", "data.system_prompt=Be brief"],
     "data.system_prompt goes to the chat template, which data.chat_template=false leaves out"),
    (["partial_rollout.enabled=true", "partial_rollout.on_stale=is", "algorithm.loss=ppo"], "decoupled_ppo, algorithm.tis_cap or algorithm.loss_options.is_level"),
    (["train.pack_length=64", "data.max_prompt_tokens=64"], "must hold the longest sequence"),
    (["algorithm.overlong_buffer=300"], "overlong_buffer"),
    (["algorithm.advantage=gdpo", "algorithm.overlong_buffer=16"], "gdpo normalises each reward function's scores; algorithm.overlong_buffer=16 adds"),
    (["algorithm.advantage=gdpo", "env.name=guess_number"], "gdpo normalises each reward function's scores; env.name='guess_number' scores episodes"),
    (["algorithm.entropy_target=1.0", "algorithm.entropy_coef=2.0"], r"entropy_coef=2.0 is where adaptive entropy control starts"),
    (["algorithm.entropy_coef_max=0.5"], "algorithm.entropy_coef_max steer adaptive entropy control: set algorithm.entropy_target"),
    (["algorithm.kl_is_correction=true"], "kl_is_correction weighs the KL term, which algorithm.kl_coef=0 leaves out"),
    (["algorithm.kl_coef=0.1", "algorithm.ref_mixup_alpha=0.5"], "ref_mixup_alpha=0.5 is the weight of a reference sync"),
    (["algorithm.ref_sync_every=4"], "ref_sync_every=4 has no reference to move: algorithm.kl_coef=0 and kl_in_reward=0 load no reference"),
    (["algorithm.ref_sync_every=4", "algorithm.kl_coef=0.1", "train.lora={r: 8}"],
     "ref_sync_every=4 has no reference to move: with train.lora the reference is the base model"),
    (["train.sequence_parallel=2"], r"sequence_parallel=2 splits rows over ranks .* train.parallel=fsdp and train.ranks a multiple"),
    (["train.sequence_parallel=2", "train.parallel=fsdp", "train.ranks=3"], r"train.ranks a multiple of it \(train.ranks=3\)"),
    (["train.sequence_parallel=2", "train.parallel=fsdp", "train.ranks=2", "train.colocate=true"], "sequence_parallel with train.colocate"),
    (["steps=5", "epochs=2"], "steps=5 and epochs=2 both say how long to train"),
    (["env.name=guess_number", "env.credit=gigpo", "algorithm.advantage=reinforce_pp"], "reinforce_pp has no group baseline"),
    (["algorithm.loss_options={is_levle: sequence}"], "unknown option 'is_levle'; ppo takes eps_low, eps_high, dual_clip, is_level"),
])
def test_conflicts_rejected_not_repaired(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=over)


def test_loss_default_follows_mode():
    assert load_config().algorithm.loss == "ppo"
    assert load_config(mode="async").algorithm.loss == "decoupled_ppo"


def test_every_field_is_documented():
    from pydantic import BaseModel

    def walk(model):
        for name, f in model.model_fields.items():
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                yield from walk(f.annotation)
            else:
                yield f"{model.__name__}.{name}", f.description

    from rollover.sim.config import SimPoolConfig, SimRunConfig

    undocumented = [name for model in (Config, SimRunConfig, SimPoolConfig) for name, doc in walk(model) if not doc]
    assert undocumented == []
    assert "max_staleness" in describe()
    assert "  checkpoint.keep = 2  (>= 1)" in describe()


def test_resume_changes_list_what_is_trained_only():
    before = load_config(overrides=["train.lr=1e-3", "reward.functions=[numeric]"])
    saved = yaml.safe_load(dump_config(before))
    assert config_changes(saved, before) == []  # a YAML round trip is no change
    after = load_config(overrides=["train.lr=2e-3", "model=a/b", "reward.functions=[math]", "rollout.top_p=0.9",
                                   "steps=99", "eval.every=1", "checkpoint.keep=5", "logging.progress=false",
                                   "device=cpu", "rollout.max_rows=3", "run_dir=elsewhere"])
    assert config_changes(saved, after) == [
        'model: "smollm2-135m-instruct" -> "a/b"',
        "rollout.top_p: 1.0 -> 0.9",
        'reward.functions: ["numeric"] -> ["math"]',
        "train.lr: 0.001 -> 0.002",
    ]
    del saved["train"]["lr"]  # a key the saved config lacks counts as its default
    assert config_changes(saved, before) == ["train.lr: 1e-05 -> 0.001"]


def test_cli_reports_config_errors_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "rollout.temprature=1"]) == 2
    assert "did you mean 'temperature'" in capsys.readouterr().err
    assert main(["train", "checkpoint.keep=0"]) == 2
    assert capsys.readouterr().err == "rollover train: config error: checkpoint.keep=0: must be >= 1\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override,key", [
    ("steps=true", "steps=true"), ("train.lr=true", "lr=true"), ("seed=false", "seed=false"),
    ("rollout.max_rows=true", "max_rows=true"), ("train.pack_length=true", "pack_length=true"),
])
def test_booleans_are_not_numbers(override, key):
    with pytest.raises(ConfigError, match=rf"{key}: must be a number, not true/false"):
        load_config(overrides=[override])
    assert load_config(overrides=["data.shuffle=false"]).data.shuffle is False  # real booleans still work


def test_gspo_and_cispo_take_their_own_clip_range_unless_one_is_given():
    """GSPO's sequence ratio moves far less than a token's: left unset, its clip range is the
    paper's 3e-4 / 4e-4, not PPO's; CISPO's has no lower bound; a range given is kept."""
    seq = ["algorithm.aggregation=seq-mean-token-mean"]
    got = {loss: (a.eps_low, a.eps_high) for loss in ("ppo", "gspo", "gspo_token", "cispo")
           for a in [load_config(None, [f"algorithm.loss={loss}", *seq]).algorithm]}
    assert got == {"ppo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "cispo": (1.0, 0.28)}
    a = load_config(None, ["algorithm.loss=gspo", *seq, "algorithm.eps_low=0.001"]).algorithm
    assert (a.eps_low, a.eps_high) == (0.001, 4e-4)
    assert load_config(None, ["mode=async"]).algorithm.eps_low == 0.2  # decoupled_ppo: PPO's


def test_an_algorithm_section_object_keeps_what_it_was_given():
    from rollover.config.algorithm import AlgorithmConfig

    a = Config(algorithm=AlgorithmConfig(advantage="drgrpo", loss="cispo", kl_coef=0.1)).algorithm
    assert (a.advantage, a.loss, a.kl_coef, a.eps_low) == ("drgrpo", "cispo", 0.1, 1.0)
    a = Config(mode="async", algorithm=AlgorithmConfig(advantage="rloo")).algorithm
    assert (a.advantage, a.loss) == ("rloo", "decoupled_ppo")  # the loss left unset follows the mode


def test_an_error_names_whether_the_file_or_an_override_gave_the_key(tmp_path):
    """Every unknown key of a section at once, two guesses where both are near, and the source of
    each bad key: the file, the command line's overrides, or both."""
    path = tmp_path / "c.yaml"
    path.write_text("modle: x\nsteps: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["devce=cpu"])
    assert str(e.value) == (f"{path} and overrides: unknown key 'modle'; did you mean 'mode' or 'model'?; "
                            "unknown key 'devce'; did you mean 'device'?")
    path.write_text("steps: 3\n")
    with pytest.raises(ConfigError, match=r"^override steps='abc': must be an integer$"):
        load_config(path, ["steps=abc"])
    with pytest.raises(ConfigError, match=r"^override unknown key 'data.trian'; did you mean 'train'\?$"):
        load_config(path, ["data.trian=x"])
    path.write_text("steps: abc\n")
    with pytest.raises(ConfigError, match=rf"^{path}: steps='abc': must be an integer$"):
        load_config(path, ["device=cpu"])
    # a check across keys that the overrides alone gave (it had been blamed on the file)
    path.write_text("steps: 3\n")
    with pytest.raises(ConfigError, match=r"^override checkpoint.best needs an evaluation at every checkpoint"):
        load_config(path, ["checkpoint.best=eval/accuracy", "checkpoint.every=3", "eval.every=2"])
    with pytest.raises(ConfigError, match=r"^override algorithm.ref_mixup_alpha=0.5 is the weight of a reference sync"):
        load_config(path, ["algorithm.ref_mixup_alpha=0.5"])  # (the key its hint suggests is not a given one)
    path.write_text("checkpoint:\n  every: 3\n")
    with pytest.raises(ConfigError, match=rf"^{path} and overrides: checkpoint.best needs"):
        load_config(path, ["checkpoint.best=eval/accuracy", "eval.every=2"])
    # load_config's keyword arguments are named as such, not blamed on the file
    with pytest.raises(ConfigError, match=r"^keyword argument: unknown key 'stepz'; did you mean 'steps'\?$"):
        load_config(path, stepz=3)
    with pytest.raises(ConfigError, match=r"^keyword argument: rollout.samples_per_prompt=4.5: must be an integer$"):
        load_config(path, rollout={"samples_per_prompt": 4.5})
    path.write_text("modle: x\n")
    with pytest.raises(ConfigError, match=rf"^{path} and keyword arguments: unknown key 'modle'"):
        load_config(path, stepz=3)
    path.write_text("rollout:\n  samples_per_prompt: 4.5\n")  # a section given as a keyword: its own keys only
    with pytest.raises(ConfigError, match=rf"^{path}: rollout.samples_per_prompt=4.5: must be an integer$"):
        load_config(path, rollout={"max_new_tokens": 64})


def test_a_loss_that_is_not_a_name_and_an_async_override_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm.loss"):
        load_config(None, ["algorithm.loss=[gspo]"])
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\n")
    with pytest.raises(ConfigError, match=r"^override async.max_staleness=-1: must be >= 0$"):
        load_config(path, ["mode=async", "async.max_staleness=-1"])


def test_resuming_a_gspo_run_begun_under_ppos_clip_range_says_how_to_keep_it(tmp_path):
    from rollover.loops.resume import config_changes_since

    seq = ["algorithm.loss=gspo", "algorithm.aggregation=seq-mean-token-mean"]
    ckpt = tmp_path / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(dump_config(load_config(None, [*seq, "algorithm.eps_low=0.2", "algorithm.eps_high=0.28"])))
    with pytest.raises(ConfigError, match=r"algorithm.eps_low: 0.2 -> 0.0003(.|\n)*write out the saved eps_low and eps_high"):
        config_changes_since(load_config(None, seq), ckpt, allow=False)
    assert config_changes_since(load_config(None, [*seq, "algorithm.eps_low=0.2", "algorithm.eps_high=0.28"]),
                                ckpt, allow=False) == []


def test_an_override_to_the_local_runtime_or_sync_mode_sets_the_files_section_for_the_other_aside(tmp_path, caplog):
    """A Ray run's config.yaml evaluated with runtime=local (an async config compared with
    mode=sync): its ray (async) section is set aside, said in a warning; written so in a file it
    is a mistake, refused, as is an override that sets the section too."""
    import logging

    path = tmp_path / "c.yaml"
    path.write_text("model: m\nrun_dir: r\nruntime: ray\nray: {rollout_workers: 2}\nmode: async\n"
                    "async: {max_staleness: 2}\n")
    with caplog.at_level(logging.WARNING, logger="rollover"):
        cfg = load_config(path, ["runtime=local", "mode=sync"])
    assert cfg.runtime == "local" and cfg.ray == type(cfg.ray)() and cfg.mode == "sync"
    assert cfg.async_ == type(cfg.async_)()
    assert "runtime=local (an override): the config's ray section is not used" in caplog.text
    assert "mode=sync (an override): the config's async section is not used" in caplog.text
    path.write_text("model: m\nrun_dir: r\nruntime: local\nray: {rollout_workers: 2}\n")
    for over in ([], ["runtime=local"], ["runtime=local", "ray.rollout_workers=3"]):  # no switch: the file's mistake
        with pytest.raises(ConfigError, match="the ray section is set but runtime is local"):
            load_config(path, over)
