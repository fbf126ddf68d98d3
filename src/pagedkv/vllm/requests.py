"""vLLM ``Request`` objects as pagedkv's ``RequestView``.

vLLM's ``Request`` has every attribute pagedkv reads but the LoRA ones
(``lora_id``, ``lora_name``, which vLLM keeps in ``lora_request``). The core
reads every attribute once per call (D-API-24), so every request goes to it
wrapped in :class:`VllmRequestView`. :class:`CappedRequest` narrows the hit length of a lookup
(``get_computed_blocks(max_cache_hit_length=...)``) to what pagedkv's
lookup reads: a hit never reaches ``num_tokens`` tokens.
:func:`capture_request` reads a request of vLLM's own type straight into
the core's snapshot (``RequestFacts``), as the view would, without a property
call per attribute (D-PERF-12).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.spec.request import RequestFacts
from pagedkv.spec.types import BlockHash

__all__ = ["VllmRequestView", "CappedRequest", "capture_request"]


class VllmRequestView:
    """A vLLM request, read through pagedkv's ``RequestView`` attributes."""

    __slots__ = ("request",)

    def __init__(self, request: Any) -> None:
        self.request = request

    @property
    def request_id(self) -> str:
        return str(self.request.request_id)

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self.request.all_token_ids  # type: ignore[no-any-return]

    @property
    def num_tokens(self) -> int:
        return int(self.request.num_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.request.num_prompt_tokens)

    @property
    def num_computed_tokens(self) -> int:
        return int(self.request.num_computed_tokens)

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        return self.request.block_hashes  # type: ignore[no-any-return]

    @property
    def num_preemptions(self) -> int:
        return int(self.request.num_preemptions)

    @property
    def lora_id(self) -> int | None:
        lora = self.request.lora_request
        return None if lora is None else int(lora.adapter_id)

    @property
    def lora_name(self) -> str | None:
        lora = self.request.lora_request
        return None if lora is None else str(lora.name)

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt  # type: ignore[no-any-return]

    @property
    def mm_features(self) -> Sequence[Any]:
        return self.request.mm_features or ()

    @property
    def session_id(self) -> str | None:
        """The session label vLLM 0.33 puts on ``BlockStored`` events (D-EVT-10)."""
        session = getattr(self.request, "session_id", None)
        return None if session is None else str(session)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        return bool(self.request.skip_reading_prefix_cache)

    @property
    def shared_prefix_boundary(self) -> int:
        # Set by vLLM's scheduler from get_computed_blocks (0.33); absent in 0.32.
        return int(getattr(self.request, "shared_prefix_boundary", 0) or 0)


class CappedRequest(VllmRequestView):
    """A request whose lookup may hit at most ``max_hit_tokens`` tokens."""

    __slots__ = ("max_hit_tokens",)

    def __init__(self, request: Any, max_hit_tokens: int) -> None:
        super().__init__(request)
        self.max_hit_tokens = max_hit_tokens

    @property
    def num_tokens(self) -> int:
        # pagedkv's lookup bounds a hit by num_tokens - 1.
        return min(int(self.request.num_tokens), self.max_hit_tokens + 1)


_new_facts = RequestFacts.__new__


def capture_request(request: Any) -> RequestFacts:
    """``RequestFacts(VllmRequestView(request))`` for vLLM's own ``Request``
    (the caller checks the type): the same values, read in the same order
    with the same conversions, from the request's attributes directly, so
    admission pays no property call per attribute (D-PERF-12). The core
    takes the snapshot as it is (``RequestFacts.capture``). Cost: O(1)."""
    facts = _new_facts(RequestFacts)
    try:
        facts.request_id = str(request.request_id)
        facts.all_token_ids = request.all_token_ids
        facts.num_tokens = int(request.num_tokens)
        facts.num_prompt_tokens = int(request.num_prompt_tokens)
        facts.num_computed_tokens = int(request.num_computed_tokens)
        facts.block_hashes = request.block_hashes
        facts.num_preemptions = int(request.num_preemptions)
        lora = request.lora_request
        facts.lora_id = None if lora is None else int(lora.adapter_id)
        lora = request.lora_request
        facts.lora_name = None if lora is None else str(lora.name)
        facts.cache_salt = request.cache_salt
        facts.mm_features = request.mm_features or ()
        facts.skip_reading_prefix_cache = bool(request.skip_reading_prefix_cache)
        session = getattr(request, "session_id", None)
        facts.session_id = None if session is None else str(session)
        facts.lora_path = None  # the view has no lora_path (RequestFacts reads None)
        facts.shared_prefix_boundary = int(getattr(request, "shared_prefix_boundary", 0) or 0)
    except AttributeError:
        # The view's error, raised by the snapshot (InvalidArgumentError naming the attribute).
        return RequestFacts(VllmRequestView(request))
    return facts
