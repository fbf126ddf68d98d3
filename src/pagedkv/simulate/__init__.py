"""``pagedkv simulate``: replay serving traces through real pagedkv managers.

Semantic model: a *workload* (requests with arrival times, prompt and output
lengths, and prompt block ids) is replayed through one or more *replicas*,
each a real ``pagedkv.KVCacheManager`` driven as an engine drives it, behind
a *router*; the replay yields per-replica statistics, compared with what the
workload allows at best (its *analysis*). docs/simulate.md has the method
and real runs. Modules, one concept each:

- ``workload``: trace readers (Mooncake, Bailian-style, Azure/BurstGPT CSV,
  the standard chat trace) with validation naming line and field;
- ``requests``: deterministic tokens from block ids, the request type the
  manager reads, memoised block hashing with the manager's hash function;
- ``analysis``: the ideal hit rate, the working set, reuse distances;
- ``capacity``: pool sizes from block counts, sweeps or the planner;
- ``replica``: one manager in cache mode or under an engine loop;
- ``fleet``: routers and the replay loop over replicas;
- ``report``, ``plots``: tables, JSON, CSV and PNGs;
- ``cli``: the command line.
"""
