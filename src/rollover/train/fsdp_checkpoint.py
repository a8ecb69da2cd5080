"""The sharded trainer's checkpoints (`rollover.train.fsdp.FSDPTrainer`): every rank's shards of
the weights and optimizer states as a `torch.distributed.checkpoint` directory, loadable at
another world size, and what is not sharded (schedules, counters) as the trainer state."""

from __future__ import annotations

import warnings


class ShardedCheckpoints:
    """`FSDPTrainer`'s checkpoint methods (the trainer's model, optimizer, critic and reference)."""

    def save_sharded(self, path) -> None:
        """Every rank writes its shards of the weights and the optimizer state under `path` (and of
        the KL reference, when `algorithm.ref_sync_every` moves it)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.cfg.algorithm.ref_sync_every is not None:
            state["reference"] = get_model_state_dict(self.ref_model)
        if self.critic is not None:
            state["critic"] = self._critic_state()
        dcp.save(state, checkpoint_id=str(path), process_group=self._cpu_group)

    def load_sharded(self, path) -> None:
        """Weights and optimizer state from `path` (written at any world size), resharded here."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self._reference_saved:
            state["reference"] = get_model_state_dict(self.ref_model)
        if self.critic is not None:
            state["critic"] = self._critic_state()
        dcp.load(state, checkpoint_id=str(path), process_group=self._cpu_group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self._reference_saved:
            set_model_state_dict(self.ref_model, state["reference"])
        if self.critic is not None:
            set_state_dict(self.critic.value, self.critic.optimizer, model_state_dict=state["critic"]["model"],
                           optim_state_dict=state["critic"]["optim"], options=self._critic_options())
        self.follow_schedules()  # (the optimizer state just loaded holds the saved rates)

    @staticmethod
    def _critic_options():
        """The critic's trained weights only (under LoRA the frozen base comes from the model again)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=True, strict=False)

    def _critic_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.critic.value, self.critic.optimizer, options=self._critic_options())
        return {"model": model, "optim": optim}

    def state_dict(self) -> dict:
        """What is not sharded: the schedulers and counters (the optimizers' moments, the critic, and
        a moved KL reference, go through `save_sharded`)."""
        return {"scheduler": self.scheduler.state_dict(), "bad_steps": self.bad_steps,
                "steps_trained": self.steps_trained, "reference_saved": self.cfg.algorithm.ref_sync_every is not None,
                "entropy_control": [self.entropy_coef, self.last_entropy],
                "micro_batch_tokens": [self._micro_batch_start, self.micro_batch_tokens],
                **({"critic_scheduler": self.critic.scheduler.state_dict(), "critic_kl_coef": self.critic.kl_coef,
                    "critic_source": self.cfg.critic.model} if self.critic is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:
            if "critic_scheduler" not in state:
                raise self.critic.missing_error()
            self.critic.check_source(state.get("critic_source"))
            self.critic.scheduler.load_state_dict(state["critic_scheduler"])
            self.critic.kl_coef = self.critic.resumed_kl_coef(state.get("critic_kl_coef"))
        self.bad_steps = state["bad_steps"]
        self.steps_trained = state.get("steps_trained", 0)
        self.entropy_coef, self.last_entropy = state.get("entropy_control", (self.entropy_coef, self.last_entropy))
        start, now = state.get("micro_batch_tokens", (None, None))
        if start == self._micro_batch_start:
            self.micro_batch_tokens = now
        # read before load_sharded (rank_server.load): a reference is loaded only from a checkpoint that has one
        self._reference_saved = self.cfg.algorithm.ref_sync_every is not None and state.get("reference_saved", False)
        if self.cfg.algorithm.ref_sync_every is not None and not self._reference_saved:
            warnings.warn("algorithm.ref_sync_every: the checkpoint holds no moved KL reference; the reference "
                          "starts again from the starting model", RuntimeWarning, stacklevel=2)
