"""The run level: ``Checkpointer`` (``checkpointer``), a run's steps on its tiers (``steps``)
and retention of the steps (``retention``)."""
