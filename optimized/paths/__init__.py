"""The fast paths of ``allocate_slots`` (admission, the decode step, filling a block)
and the roll-back (:mod:`.recovery`) they and the general path share.

Written against the coordinator's state, not its class: they sit below the
coordination layer that builds them (docs/architecture.md).
"""
