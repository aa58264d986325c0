"""The speculative method, numpy only: the loop (speculative.py), the two interfaces an engine
implements (interfaces.py), proposers, planners, acceptance, draft trees, prompt lookup, logprobs,
the prefix-cache policy, calibration and the round trace. No framework, engine, service or model
management is imported here (tests/test_layering.py)."""
