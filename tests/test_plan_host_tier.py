"""``pagedkv plan --host-memory``: a HiSparse host tier planned beside the
device plan (spec/host_plan.py, D-CFG-13; host_pool_num_blocks, D-HOST-10)."""

from __future__ import annotations

import json

import pytest

from pagedkv.plan import main
from pagedkv.presets import PRESETS
from pagedkv.spec import FullAttentionSpec
from pagedkv.spec.errors import InsufficientMemoryError, InvalidConfigError
from pagedkv.spec.host_plan import plan_host_tier
from pagedkv.spec.kv_cache_spec import MLAAttentionSpec
from pagedkv.spec.setting import ModelSetting

GiB = 1 << 30


def test_the_deepseek_v32_host_tier() -> None:
    preset = PRESETS["deepseek-v3.2"]
    specs = preset.build(8192)
    sources = preset.host_source_layers(specs)
    assert len(sources) == 61 and all(name.endswith(".attn") for name in sources)
    plan = plan_host_tier(ModelSetting(max_model_len=8192), specs, sources, 64 * GiB)
    # 61 layers x 64 tokens x 656 bytes (fp8_ds_mla); 64 GiB // 2,561,024 bytes.
    assert plan.host_block_bytes == 61 * 64 * 656 == 2_561_024
    assert plan.host_num_blocks == 64 * GiB // 2_561_024 == 26_832
    assert (plan.host_tokens, plan.min_host_blocks) == (26_831 * 64, 130)


def test_a_pool_too_small_for_one_request_is_refused() -> None:
    specs = {"a": MLAAttentionSpec(64, 1, 576, "bfloat16")}
    page = specs["a"].page_size_bytes
    setting = ModelSetting(max_model_len=1024)  # 16 blocks + null + spare = 18
    assert plan_host_tier(setting, specs, ["a"], 18 * page).host_num_blocks == 18
    with pytest.raises(InsufficientMemoryError, match="needs 18"):
        plan_host_tier(setting, specs, ["a"], 18 * page - 1)


def test_source_layers_must_be_mla_of_one_block_size() -> None:
    setting = ModelSetting(max_model_len=1024)
    with pytest.raises(InvalidConfigError, match="not an MLA layer"):
        plan_host_tier(setting, {"a": FullAttentionSpec(16, 1, 8, "float16")}, ["a"], GiB)
    with pytest.raises(InvalidConfigError, match="one block size"):
        plan_host_tier(setting, {"a": MLAAttentionSpec(64, 1, 576, "bfloat16"),
                                 "b": MLAAttentionSpec(32, 1, 576, "bfloat16")}, ["a", "b"], GiB)
    with pytest.raises(InvalidConfigError, match="at least one"):
        plan_host_tier(setting, {}, [], GiB)


def test_cli_reports_the_host_tier_beside_the_device_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "deepseek-v3.2", "--memory", "40GiB", "--host-memory", "64GiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_blocks"] == 13961  # the device plan is unchanged
    assert report["host_tier"]["host_num_blocks"] == 26_832
    assert main(["--preset", "deepseek-v3.2", "--memory", "40GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_tier"] is None
    assert main(["--preset", "deepseek-v3.2", "--memory", "40GiB", "--host-memory", "64GiB"]) == 0
    assert "host blocks         26,832" in capsys.readouterr().out


def test_cli_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    # Too little host memory: 1; a model without source layers: 2.
    assert main(["--preset", "deepseek-v3.2", "--memory", "40GiB", "--host-memory", "100MiB"]) == 1
    assert main(["--preset", "llama3-8b", "--memory", "40GiB", "--host-memory", "1GiB"]) == 2
    assert "names no HiSparse source layers" in capsys.readouterr().err
