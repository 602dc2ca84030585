"""Drop-in adapters for RL frameworks: ``verl`` (the "ktae" estimator, a package), ``trl`` (a
``GRPOTrainer`` subclass), ``openrlhf`` (an experience-maker hook), on top of ``shared`` (settings,
labels, baseline, metrics). Each adapter imports its framework; this package imports none."""
