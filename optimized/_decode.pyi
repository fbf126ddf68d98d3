# Stub of the optional C module optimized/_decode.c (D-PERF-39): the decode step's no-op test.
from typing import Any

def noop(rules: tuple[tuple[Any, ...], ...], request_id: str, num_computed: int, total: int,
         cache_tokens: int, /) -> bool | None: ...
def decode_step(context: tuple[Any, ...], request: Any, num_new_tokens: int, delay_cache_blocks: bool,
                /) -> Any: ...
