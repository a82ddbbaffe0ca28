"""Tensor parallel over gloo on the CPU: two ranks, each with half of every layer's weights
(transformers' tp_plan) and half of the KV heads, give the greedy tokens of one rank on
three tiny architectures; a model whose heads do not split is refused with the reason."""

from __future__ import annotations

import pytest
from support.models import make_tiny_model

from loomllm import LLM, ManagerError
from loomllm.protocols.sampling import SamplingParams

# Processes that need both cores at once: `make test` runs these tests one at a time.
pytestmark = pytest.mark.serial

PROMPTS = ["w5 w6 w7", "w9 " * 40, "w11", "w3 w200 w17 w4"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_two_ranks_give_the_tokens_of_one(arch, tmp_path, shared_manager):
    model = make_tiny_model(tmp_path, arch)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        # max_num_batched_tokens=32: the 40-token prompt is prefilled in two chunks. float32:
        # "auto" is bfloat16 on CPUs with native bf16, whose rounding breaks near-ties.
        with LLM(
            model,
            tensor_parallel_size=tp,
            keep_alive=0,
            max_num_batched_tokens=32,
            dtype="float32",
            manager_socket=shared_manager.socket,
        ) as llm:
            tokens[tp] = [
                o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)
            ]
            if tp == 2:
                shards = llm.collective_rpc(
                    lambda w: w.runner.kv_caches[0][0].shape[1]
                )  # KV heads held by each rank
    assert tokens[2] == tokens[1]
    assert shards == [1, 1]  # the tiny models have 2 KV heads


def test_heads_that_do_not_split_are_refused(tmp_path, shared_manager):
    import json

    model = make_tiny_model(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(num_attention_heads=3, num_key_value_heads=3, head_dim=16, hidden_size=48)
    (tmp_path / "config.json").write_text(json.dumps(config))  # SmolLM2's 9/3 heads, in small
    with pytest.raises(
        ManagerError,
        match="tensor_parallel_size=2 must divide the model's 3 attention heads and 3 KV heads",
    ):
        LLM(model, tensor_parallel_size=2, keep_alive=0, manager_socket=shared_manager.socket)
