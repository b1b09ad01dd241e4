"""Trainer integrations: one-line hooks that feed a `kldiag.Recorder` from inside a trainer.

    from kldiag.integrations.trl import attach
    attach(trainer, "runs/my_run")      # a trl.GRPOTrainer, before trainer.train()

Each integration is imported on its own (`kldiag.integrations.trl` imports torch and trl
lazily, inside `attach`), so `import kldiag.integrations` costs nothing.
"""
