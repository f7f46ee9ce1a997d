"""The four private Trainer methods ExtTrainer overrides, each because no public hook reaches what it must change;
everything else ExtTrainer does rides on public hooks (trainer.py). A transformers release that renames or re-signs
one of these fails tests/unit/test_trainer_contract.py, and docs/versions.md lists them with these reasons."""

from __future__ import annotations


class PrivateTrainerHooks:
    """Mixed in before transformers' Trainer: `class ExtTrainer(PrivateTrainerHooks, Trainer)`."""

    def _get_output_dir(self, trial):
        # Where transformers writes a checkpoint: its staging folder, so that a half-written checkpoint never carries
        # a checkpoint-N name; RunCheckpoints.on_save publishes it complete (the only place this folder is chosen).
        return self.checkpoints.stage(super()._get_output_dir(trial))

    def _wrap_model(self, model, training=True, dataloader=None):
        # evaluation_loop asks this method, not model_wrapped, for the model to run: the backend's evaluation engine
        # (ZeRO-3 before training) must come from here; a backend's own training wrapper (FairScale) is not one
        # accelerate recognises, so transformers would wrap it again.
        if not training and self._evaluation_model is not None:
            return self._evaluation_model
        if training and self.backend.unwrap(model) is not model:
            return model
        return super()._wrap_model(model, training, dataloader)

    def _clip_grad_norm(self, model):
        # With sharded gradients (FairScale) the norm must be taken over every rank's shard; transformers' only
        # clipping call (accelerate's clip_grad_norm_) would clip each rank by its own shard's norm.
        norm = self.backend.clip_grad_norm(self, model, self.args.max_grad_norm)
        return norm if norm is not None else super()._clip_grad_norm(model)

    def _finalize_training(self, trial, num_train_samples, start_time):
        # transformers adds the loss accumulated since the last log as this rank's own, so the final train_loss
        # depended on --logging_steps and on rank 0's batches; the mean over ranks is what a single process logs.
        # And it averages only this call's steps: after a resume, the sum it divides is made the whole run's.
        # (The only place the remainder is added before train_loss is computed.)
        from transformers.trainer_pt_utils import nested_gather

        if self.args.world_size > 1:
            self._tr_loss = nested_gather(self._tr_loss, self.args.parallel_mode).mean()
        earlier = self._resume.get("loss_sum") if self._resume is not None else None
        if earlier is not None and self.state.global_step > 0:
            unlogged = self._tr_loss.item()
            whole_run = (earlier + self._total_loss_scalar + unlogged) / self.state.global_step
            steps_now = self.state.global_step - self._initial_global_step
            self._total_loss_scalar = whole_run * max(steps_now, 0.001) - unlogged
        return super()._finalize_training(trial, num_train_samples, start_time)
