"""Graph rewrites and the validity gate: normalize, fusion, masks, apply (plan → graph), validate."""
