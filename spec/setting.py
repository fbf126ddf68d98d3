"""The serving setting a KV cache is planned for.

vLLM reads these numbers from its global engine config; pagedkv gathers the
few the planner needs in one frozen value, so every planning function is a
pure function of (setting, specs per layer, available memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.spec.errors import InvalidConfigError

__all__ = ["ModelSetting", "DEFAULT_MAX_NUM_BATCHED_TOKENS"]

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""Tokens the scheduler puts in one step unless told otherwise."""


def _check_int(field: str, value: object, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise InvalidConfigError(
            f"ModelSetting.{field} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelSetting:
    """What one engine instance serves, as far as the KV cache is concerned.

    - ``max_model_len``: the longest request (prompt + output) in tokens.
    - ``max_num_batched_tokens``: the most tokens scheduled in one step; it
      bounds the chunk a sliding-window or chunked-local layer must hold
      beside its window.
    - ``max_num_encoder_input_tokens``: the longest encoder input a
      cross-attention layer caches; ``None`` means ``max_num_batched_tokens``.
    - ``dcp_world_size`` / ``pcp_world_size``: decode / prefill context
      parallelism; each rank stores ``1 / (dcp * pcp)`` of every request.
    - ``num_gpu_blocks_override``: use exactly this many blocks instead of
      as many as fit (it must still fit).
    - ``disable_hybrid_kv_cache_manager``: treat sliding-window and
      chunked-local layers as full attention so the model has one group.

    Raises ``InvalidConfigError`` naming the field on a bad value.
    """

    max_model_len: int
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_encoder_input_tokens: int | None = None
    dcp_world_size: int = 1
    pcp_world_size: int = 1
    num_gpu_blocks_override: int | None = None
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        _check_int("max_model_len", self.max_model_len, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_encoder_input_tokens is not None:
            _check_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, 1)
        _check_int("dcp_world_size", self.dcp_world_size, 1)
        _check_int("pcp_world_size", self.pcp_world_size, 1)
        if self.num_gpu_blocks_override is not None:
            _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1)
        if type(self.disable_hybrid_kv_cache_manager) is not bool:
            raise InvalidConfigError(
                "ModelSetting.disable_hybrid_kv_cache_manager must be a bool, "
                f"got {self.disable_hybrid_kv_cache_manager!r}")

    @property
    def encoder_tokens(self) -> int:
        """The encoder input length cross-attention layers are sized for."""
        if self.max_num_encoder_input_tokens is None:
            return self.max_num_batched_tokens
        return self.max_num_encoder_input_tokens

    @property
    def context_parallel_size(self) -> int:
        """Ranks each request is spread over: ``dcp * pcp``."""
        return self.dcp_world_size * self.pcp_world_size

    def with_max_model_len(self, max_model_len: int) -> ModelSetting:
        """This setting with another ``max_model_len`` (validated)."""
        return ModelSetting(
            max_model_len, self.max_num_batched_tokens, self.max_num_encoder_input_tokens,
            self.dcp_world_size, self.pcp_world_size, self.num_gpu_blocks_override,
            self.disable_hybrid_kv_cache_manager)
