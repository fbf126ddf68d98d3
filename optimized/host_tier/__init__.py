"""The host tier of HiSparse (spec/host_tier.md): its state, rules and steps.

Independent of the device pool: it imports only ``pagedkv.spec``.
"""
