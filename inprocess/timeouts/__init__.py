"""Section and step timeouts of one rank: the pure estimator, the section clock and
``ft_state.json``."""
