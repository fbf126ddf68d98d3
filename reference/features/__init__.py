"""pagedkv.reference.features: what vLLM 0.33 added on top of the kernel.

The kernel (the pool, the hash chain, the seed attention types, the
brute-force coordinator, the facade, validation and invariants) reads top to
bottom without these modules. Each module here states one feature's rules
simply -- the optimized implementation states them again, fast, in its own
modules, so a mistake in one is seen by the lockstep machines (nothing that
decides a hit, a block, a checkpoint, a copy or an event lives in
``pagedkv.spec``). spec/managers.md §9, "Hooks", lists how they plug in; :mod:`.enabled` lists the
features the facade hands the kernel.
"""
