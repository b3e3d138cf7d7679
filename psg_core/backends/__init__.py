"""Per-sample gradient backends, one module per :class:`~psg_core.modes.GradSampleMode`."""
