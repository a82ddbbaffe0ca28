"""benchmarks/bench_models.py and random_llama.py: the shapes are the real models', the random
weights are a loadable HF checkpoint written shard by shard, and files already made are not
made again."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from loomllm.benchmarks import bench_models, random_llama
from loomllm.workers.models.sources import resolve_model

TINY = dataclasses.replace(
    random_llama.SHAPES["llama-8b"],
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
)


def test_the_shapes_have_the_real_models_parameter_counts():
    # SmolLM2-1.7B's own count; Llama-3.1-8B's 8,030,261,248 less its larger vocabulary's
    # embedding and lm_head: (128256 - 49152) x 4096 x 2.
    assert random_llama.num_parameters(random_llama.SHAPES["smollm2-1.7b"]) == 1_711_376_384
    llama = random_llama.SHAPES["llama-8b"]
    assert random_llama.num_parameters(llama) == 8_030_261_248 - (128256 - 49152) * 4096 * 2
    names = [name for shard in random_llama.tensor_shards(llama) for name, _ in shard]
    assert "lm_head.weight" in names and len(names) == 2 + 1 + 32 * 9


def test_the_config_is_a_llama_checkpoints():
    from transformers import LlamaConfig

    config = random_llama.hf_config(random_llama.SHAPES["llama-8b"], 1, 2)
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["head_dim"] == 128
    parsed = LlamaConfig(**config)
    assert (parsed.num_key_value_heads, parsed.intermediate_size) == (8, 14336)
    assert parsed.tie_word_embeddings is False
    smol = random_llama.hf_config(random_llama.SHAPES["smollm2-1.7b"], 1, 2)
    assert smol["tie_word_embeddings"] is True and "rope_scaling" not in smol
    assert smol["rope_theta"] == 130000.0 and smol["max_position_embeddings"] == 8192


def test_random_weights_load_in_transformers_and_repeat_with_the_seed(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    for run in ("a", "b"):
        folder = tmp_path / run
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(random_llama.hf_config(TINY, 1, 2)))
        random_llama.write_random_weights(TINY, folder, seed=3)
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.1.mlp.down_proj.weight"] == shards[2]
    a = load_file(tmp_path / "a" / shards[1])
    b = load_file(tmp_path / "b" / shards[1])
    assert all(torch.equal(a[name], b[name]) for name in a)
    q = a["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.bfloat16 and 0.015 < q.float().std().item() < 0.025
    assert torch.equal(a["model.layers.0.input_layernorm.weight"], torch.ones(64).bfloat16())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")  # no missing or extra tensors
    assert model.config.num_hidden_layers == 2


def test_only_picks_targets_by_name_and_refuses_unknown_ones():
    args = bench_models.argparse.Namespace(only=["llama-8b-q8_0", "smollm2-135m-f32.gguf"])
    assert [t.name for t in bench_models.wanted(args)] == [
        "smollm2-135m-f32.gguf",
        "llama-8b-q8_0.gguf",
    ]
    with pytest.raises(SystemExit, match="no target llama-70b"):
        bench_models.wanted(bench_models.argparse.Namespace(only=["llama-70b-q4_k_m"]))


def fake_tools(tmp_path):
    """A llama-quantize that copies its input and logs its arguments, and a convert-deps
    folder with a sentencepiece in it."""
    quantize = tmp_path / "llama-quantize"
    quantize.write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n'
        '[ "$1" = --allow-requantize ] && shift\ncp "$1" "$2"\n'
    )
    quantize.chmod(0o755)
    (tmp_path / "deps" / "sentencepiece").mkdir(parents=True)
    return ["--llama-quantize", str(quantize), "--convert-deps", str(tmp_path / "deps")]


def test_requantizations_are_made_once_and_summed_up(tmp_path, capsys):
    out = tmp_path / "models"
    argv = [*fake_tools(tmp_path), "--out", str(out), "--only", "smollm2-135m-q6_k"]
    bench_models.main(argv)
    shipped = resolve_model("smollm2").path
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == [f"--allow-requantize {shipped} {out}/smollm2-135m-q6_k.gguf.part Q6_K 2"]
    printed = capsys.readouterr().out
    assert f"| {out}/smollm2-135m-q6_k.gguf | " in printed and "210 Q4_1, 61 F32" in printed
    assert "peak RSS" in printed
    bench_models.main(argv)  # there already: nothing run
    assert len((tmp_path / "calls").read_text().splitlines()) == 1
    assert not list(out.glob("*.part"))


def test_a_tool_that_fails_exits_with_its_log(tmp_path):
    log = tmp_path / "log"
    with pytest.raises(SystemExit, match=r"fails failed \(-11\).*\n.*last words"):
        bench_models.run_stage("fails", ["sh", "-c", "echo last words; kill -SEGV $$"], log)
    stage = bench_models.run_stage("works", ["sh", "-c", "true"], log)
    assert stage.peak_rss_bytes > 0 and stage.what == "works"


def test_without_the_converters_dependencies_it_says_how_to_get_them(tmp_path):
    quantize = tmp_path / "llama-quantize"
    quantize.touch()
    argv = ["--llama-quantize", str(quantize), "--convert-deps", str(tmp_path)]
    with pytest.raises(SystemExit, match="make bench-models"):
        bench_models.main(argv)
    with pytest.raises(SystemExit, match="make bench-peers"):
        bench_models.main(["--llama-quantize", os.devnull + "-none"])


def test_the_converters_folder_has_smollm2s_tokenizer_and_a_stamp_last(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setitem(random_llama.SHAPES, "tiny", TINY)
    folder = tmp_path / "tiny-hf"
    random_llama.main(["tiny", str(folder), "--seed", "1"])
    config = json.loads((folder / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # <|im_start|>, <|im_end|>
    assert (folder / ".weights-written").exists()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 49152 and tokenizer.chat_template
