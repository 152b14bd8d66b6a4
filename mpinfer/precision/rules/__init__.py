"""Policy to decisions: op tables, the node classifier, resolution to one precision per node, the rule plan."""
