"""Hooks that get rollouts out of RL trainers in a form ``simkit diagnose`` reads.

- :mod:`simkit.integrations.trl`: ``DumpingGRPOTrainer``, a TRL ``GRPOTrainer`` that writes
  every generation's per-token log-probabilities to parquet (optional extra ``trl``).

verl needs no code: save the batch in ``RayPPOTrainer.fit()`` (the docs page "Diagnose your
rollouts" says where and which keys).
"""
