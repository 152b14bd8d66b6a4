"""Search and guarantee: groups, screening, the budget search, final verification and repair, the floor."""
