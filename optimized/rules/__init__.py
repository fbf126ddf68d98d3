"""Pure decisions of the optional features (DCP, EAGLE, Mamba checkpoints and partial
states, connector hits): functions of a spec and numbers, no state.

The optimized twin of the ``*_rules`` modules of ``pagedkv.reference.features``;
it imports only ``pagedkv.spec``.
"""
