"""The per-group managers: one class per attention kind (full, sliding window,
chunked local, cross attention, Mamba, ring, RSWA, DCP sub-block), the feature
state they carry (Mamba partial states, EAGLE groups) and the hit search over groups.

Imports the pool and the feature rules below it, never the coordinator above it.
"""
