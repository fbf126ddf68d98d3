"""``pagedkv plan``: presets, model files, JSON output, errors and exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedkv.plan import main, parse_memory
from pagedkv.presets import PRESETS

GiB = 1 << 30

# The figures docs/planning.md quotes: 40 GiB, max_model_len 8192.
EXPECTED = {
    "llama3-8b": (20480, 327_680, 327_680),
    "gemma3": (32768, 74_896, 476_272),
    # Attention pages padded to the 311,296-byte Mamba state (D-SPEC-17), blocks of 16.
    "jamba": (34492, 68_976, 551_760),
    "deepseek-v3": (9549, 611_136, 611_136),
    # 61 x 64 x (656 + 132) = 3,076,352 bytes a block (one uniform-type group).
    "deepseek-v3.2": (13961, 893_504, 893_504),
    # 4 groups of 8 layers, 37,440-byte pages: 40 GiB // 37,440 // 8.
    "swa-mla": (143395, 2_294_272, 9_152_128),
}


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_plan_and_report(preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    report = _json(capsys, "--preset", preset, "--memory", "40GiB", "--max-model-len", "8192")
    assert (report["num_blocks"], report["kv_cache_size_tokens"],
            report["largest_max_model_len"]) == EXPECTED[preset]
    assert report["max_concurrency"] > 1
    assert sum(t["size"] for t in report["tensors"]) <= 40 * GiB
    layers = [name for g in report["groups"] for name in g["layer_names"]]
    assert len(layers) == len(set(layers)) == len(PRESETS[preset].build(8192))
    assert main(["--preset", preset, "--memory", "40GiB"]) == 0
    text = capsys.readouterr().out
    assert "num_blocks" in text and "largest max_model_len" in text and "max concurrency" in text


def test_gpu_memory_times_utilization(capsys: pytest.CaptureFixture[str]) -> None:
    report = _json(capsys, "--preset", "llama3-8b", "--gpu-memory", "80GiB", "--utilization", "0.5")
    assert report["available_memory"] == 40 * GiB
    assert main(["--preset", "llama3-8b", "--gpu-memory", "80GiB", "--utilization", "1.5"]) == 2
    assert "utilization" in capsys.readouterr().err


def test_parse_memory() -> None:
    assert parse_memory("40GiB") == parse_memory("40G") == 40 * GiB
    assert parse_memory("1.5 MiB") == 3 << 19
    assert parse_memory("2GB") == 2 * 10**9
    assert parse_memory("123") == 123
    with pytest.raises(ValueError, match="memory size"):
        parse_memory("forty")


def test_not_enough_memory_exits_1_with_the_largest_length(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "llama3-8b", "--memory", "1GiB", "--max-model-len", "100000"]) == 1
    err = capsys.readouterr().err
    assert "largest max_model_len that fits is 8192" in err


def test_model_file_yaml_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = {
        "name": "tiny-hybrid", "block_size": 16, "dtype": "bfloat16",
        "layers": [
            {"type": "full_attention", "count": 10, "num_kv_heads": 8, "head_size": 128},
            {"type": "sliding_window", "count": 20, "num_kv_heads": 8, "head_size": 128,
             "sliding_window": 1024},
        ],
    }
    json_file = tmp_path / "model.json"
    json_file.write_text(json.dumps(model))
    report = _json(capsys, "--model", str(json_file), "--memory", "4GiB")
    assert report["model"] == "tiny-hybrid"
    assert [len(g["layer_names"]) for g in report["groups"]] == [10, 10, 10]
    assert len(report["tensors"]) == 10
    yaml_file = tmp_path / "model.yaml"
    yaml_file.write_text(
        "layers:\n"
        "  - {type: mamba, count: 3, shapes: [[64, 3], [64, 16]], dtypes: [bfloat16, float32]}\n"
        "  - {type: full_attention, num_kv_heads: 2, head_size: 64, name: attn}\n")
    report = _json(capsys, "--model", str(yaml_file), "--memory", "1GiB")
    assert report["model"] == "model"
    assert {g["manager_kind"] for g in report["groups"]} == {"mamba", "full_attention"}


@pytest.mark.parametrize(("content", "field"), [
    ('{"layers": []}', "layers"),
    ('{"layers": [{"type": "full", "num_kv_heads": 8}]}', "layers[0].type"),
    ('{"layers": [{"type": "full_attention", "head_size": 128}]}', "layers[0].num_kv_heads"),
    ('{"layers": [{"type": "full_attention", "num_kv_heads": -8, "head_size": 128}]}', "num_kv_heads"),
    ('{"layers": [{"type": "full_attention", "num_kv_heads": 8, "head_size": 128, "dtype": "f13"}]}',
     "dtype"),
    ('{"layers": [{"type": "full_attention", "num_kv_heads": 8, "head_size": 128, "colour": 1}]}',
     "layers[0].colour"),
    ('{"layers": [{"type": "mamba", "shapes": [[4, 4]]}]}', "layers[0].dtypes"),
    ('{"layer": []}', "layer"),
    ('{"layers": [', "not valid json"),
])
def test_malformed_model_files_exit_2_naming_file_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, field: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["--model", str(path), "--memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and field in err


def test_missing_file_and_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path / "nope.yaml"), "--memory", "1GiB"]) == 2
    assert "nope.yaml" in capsys.readouterr().err
    assert main(["--preset", "llama3-8b"]) == 2  # no memory given
    assert main(["--preset", "llama3-8b", "--memory", "lots"]) == 2
    assert main(["--preset", "llama3-8b", "--memory", "1GiB", "--max-model-len", "0"]) == 2
    assert "max_model_len" in capsys.readouterr().err
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("layers: [\n")
    assert main(["--model", str(bad_yaml), "--memory", "1GiB", "--json"]) == 2
    out = capsys.readouterr()
    assert json.loads(out.out)["error"] == "invalid_config" and "bad.yaml" in out.err
