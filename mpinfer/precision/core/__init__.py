"""The shared vocabulary of precision/: what a graph holds (GraphInfo), the plan (PrecisionPlan), format limits."""
