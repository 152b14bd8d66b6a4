"""Example models for the README, tests and benchmarks. Never imported by mpinfer/.

Each module has ``build()`` (a torch.nn.Module in eval mode, seeded weights), ``example_inputs()``
(a tuple of tensors) and ``INPUT_SPECS`` (mpinfer input specs, symbolic dims where dynamic).
"""
