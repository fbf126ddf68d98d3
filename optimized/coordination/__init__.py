"""The coordinator: the kv-cache groups of one model driven as one (hits, demand,
admission, caching, release), in its three kinds and with sub-block hits.
"""
