"""Planners: which proposer makes each round's draft, and how wide (planner.py has the
protocol and `make_planner`; one estimator per module). Package `__init__`s import nothing, so
importing a submodule never runs a sibling's imports behind a reader's back."""
