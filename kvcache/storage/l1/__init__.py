"""L1: the pinned CPU pool. Slots come from a slab allocator; an eviction policy picks victims."""
