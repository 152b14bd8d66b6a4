"""Example task metrics for ``--metric NAME=FILE.py:FUNCTION`` (docs/compare.md, "Metrics of your own").

Each file is self-contained (numpy only) so it can be copied and edited: ``FUNCTION(baseline, candidate, inputs)``
gets dicts of numpy arrays for one batch and returns one value per sample.
"""
