"""Layout and planning: topologies, page tables and builders, block ids, peer ranks, fragment plans."""
