"""Embeddings (runner="pooling"): each pooling method against transformers' own model, over
chunked prompts batched together; Matryoshka dimensions; every refusal names its field and
leaves the engine serving."""

from __future__ import annotations

import json

import anyio
import pytest
import torch
from sentence_transformers import SentenceTransformer
from support.hf_reference import hf_embedding
from support.models import make_pooling_model, make_tiny_encoder

from loomllm import Engine, SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.compute]

TOLERANCE = 1e-4
# Longer than a step's 16-token budget: pooled over several prefill chunks. Ids 30-99, whose
# words ("w30") hold none of the special words ("w1", "w2") that split a text's words.
PROMPTS = [[5, 6, 7, 8, 9], [(7 * i) % 70 + 30 for i in range(45)], [42]]


@pytest.mark.parametrize(
    "arch, method, normalize, model_impl",
    [
        ("qwen3", "mean_tokens", True, "auto"),
        ("qwen3", "lasttoken", True, "auto"),
        ("llama", "cls_token", False, "auto"),
        ("llama", None, True, "auto"),  # no sentence-transformers files: last token, normalized
        ("llama", "mean_tokens", True, "transformers"),  # its base model's hidden states
    ],
)
async def test_embeddings_match_transformers(
    tmp_path, shared_manager, arch, method, normalize, model_impl
):
    model_dir = make_pooling_model(tmp_path, arch, method, normalize)
    results: dict[int, list[float]] = {}
    async with Engine(
        model_dir,
        manager_socket=shared_manager.socket,
        runner="pooling",
        dtype="float32",
        max_num_batched_tokens=16,
        model_impl=model_impl,
    ) as e:

        async def one(index: int) -> None:
            out = await e.embed({"prompt_token_ids": PROMPTS[index]})
            assert out.prompt_token_ids == PROMPTS[index] and out.finished
            results[index] = out.outputs.embedding

        async with anyio.create_task_group() as tg:  # batched together
            for index in range(len(PROMPTS)):
                tg.start_soon(one, index)
    for index, prompt in enumerate(PROMPTS):
        expected = hf_embedding(model_dir, prompt, method or "lasttoken", normalize)
        ours = torch.tensor(results[index])
        assert (ours - expected).abs().max().item() < TOLERANCE, (index, method)
    if method is not None:  # and as sentence-transformers itself computes it
        st = SentenceTransformer(model_dir, device="cpu")
        st.tokenizer.pad_token = st.tokenizer.eos_token  # the tiny tokenizer has none
        texts = [" ".join(f"w{t}" for t in prompt) for prompt in PROMPTS]
        expected = st.encode(texts, convert_to_tensor=True, batch_size=len(texts))
        ours = torch.tensor([results[i] for i in range(len(PROMPTS))])
        assert (ours - expected).abs().max().item() < TOLERANCE, method


# Texts for the encoders: the tokenizer wraps each as "w1 ... w2" (CLS ... SEP).
ENCODER_TEXTS = ["w5 w6 w7", " ".join(f"w{(7 * i) % 70 + 30}" for i in range(40)), "w42"]


@pytest.mark.parametrize(
    "arch, method, normalize",
    [
        ("bert", "cls_token", True),
        ("bert", "mean_tokens", False),
        ("bert", None, True),  # no sentence-transformers files: CLS, normalized
        ("roberta", "mean_tokens", True),  # positions from pad_token_id + 1
        ("xlm-roberta", "cls_token", True),
    ],
)
async def test_encoder_embeddings_match_sentence_transformers(
    tmp_path, shared_manager, arch, method, normalize
):
    """BERT-family encoders attend both ways within each prompt, batched together in one
    step (a prompt is never split), and pool as sentence-transformers does."""
    model_dir = make_pooling_model(tmp_path, arch, method, normalize)
    results: dict[int, tuple[list[int], list[float]]] = {}
    async with Engine(
        model_dir, manager_socket=shared_manager.socket, runner="pooling", dtype="float32"
    ) as e:
        assert e.max_model_len == (130 if arch == "bert" else 129)  # RoBERTa: 130 - 1

        async def one(index: int) -> None:
            out = await e.embed(ENCODER_TEXTS[index])
            results[index] = (out.prompt_token_ids, out.outputs.embedding)

        async with anyio.create_task_group() as tg:
            for index in range(len(ENCODER_TEXTS)):
                tg.start_soon(one, index)
        stats = e.stats()
        assert stats.num_preemptions == 0 and stats.num_generation_tokens == 0  # none made
        assert stats.num_prompt_tokens == sum(len(ids) for ids, _ in results.values())
        assert stats.num_finished["stop"] + stats.num_finished["length"] == 3
    for index, (ids, embedding) in results.items():
        assert ids[0] == 1 and ids[-1] == 2  # CLS ... SEP, as the tokenizer wraps a text
        expected = hf_embedding(model_dir, ids, method or "cls_token", normalize)
        assert (torch.tensor(embedding) - expected).abs().max().item() < TOLERANCE, index
    if method is not None:
        st = SentenceTransformer(model_dir, device="cpu")
        expected = st.encode(ENCODER_TEXTS, convert_to_tensor=True, batch_size=3)
        ours = torch.tensor([results[i][1] for i in range(len(ENCODER_TEXTS))])
        assert (ours - expected).abs().max().item() < TOLERANCE, method


async def test_an_encoder_is_refused_as_a_generator_and_its_long_prompts_by_length(
    tmp_path, shared_manager
):
    model_dir = make_pooling_model(tmp_path, "bert", "cls_token")
    with pytest.raises(Exception, match="is an encoder .*runner='pooling'"):
        async with Engine(model_dir, manager_socket=shared_manager.socket, dtype="float32"):
            pass
    options = {"manager_socket": shared_manager.socket, "runner": "pooling", "dtype": "float32"}
    with pytest.raises(ValueError, match=r"an encoder computes each prompt whole, in one step"):
        async with Engine(model_dir, **options, max_num_batched_tokens=64):
            pass
    async with Engine(model_dir, **options) as e:
        with pytest.raises(ValueError, match="130"):
            await e.embed({"prompt_token_ids": [5] * 131})
        assert len((await e.embed("w5")).outputs.embedding) == 64  # serving on


async def test_matryoshka_dimensions_cut_and_normalize_again(tmp_path, shared_manager):
    model_dir = make_pooling_model(tmp_path, "qwen3", "mean_tokens", is_matryoshka=True)
    async with Engine(
        model_dir, manager_socket=shared_manager.socket, runner="pooling", dtype="float32"
    ) as e:
        full = (await e.embed("w5 w6 w7")).outputs.embedding
        cut = (await e.embed("w5 w6 w7", dimensions=16)).outputs.embedding
        with pytest.raises(ValueError, match=r"dimensions must be an integer in \[1, 64\]"):
            await e.embed("w5", dimensions=65)
    assert len(full) == 64 and len(cut) == 16
    expected = torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0)
    assert (torch.tensor(cut) - expected).abs().max().item() < 1e-6


async def test_refusals_name_the_field_and_the_engine_keeps_serving(tmp_path, shared_manager):
    model_dir = make_pooling_model(tmp_path, "qwen3", "lasttoken")
    async with Engine(
        model_dir, manager_socket=shared_manager.socket, runner="pooling", dtype="float32"
    ) as e:
        with pytest.raises(ValueError, match="this model's embeddings cannot be shortened"):
            await e.embed("w5", dimensions=8)
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await e.embed({"prompt_token_ids": []})
        with pytest.raises(ValueError, match="prompt_token_ids must be a list of token ids"):
            await e.embed({"prompt_token_ids": [10**6]})
        with pytest.raises(ValueError, match="runner='pooling': it embeds"):
            e.generate("w5", SamplingParams(max_tokens=2))
        out = await e.embed("w5 w6")
        assert len(out.outputs.embedding) == 64
    async with Engine(model_dir, manager_socket=shared_manager.socket, dtype="float32") as e:
        with pytest.raises(ValueError, match="runs with runner='generate': start the engine"):
            await e.embed("w5")


async def test_a_pooling_module_loomllm_does_not_compute_is_refused_at_start(
    tmp_path, shared_manager
):
    model_dir = make_pooling_model(tmp_path, "qwen3", "lasttoken")
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append(
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(Exception, match="holds sentence_transformers.models.Dense"):
        async with Engine(model_dir, manager_socket=shared_manager.socket, runner="pooling"):
            pass
    with pytest.raises(ValueError, match="runner must be one of"):
        Engine(model_dir, runner="embed")


def test_smollm2_last_token_embeddings_through_llm_embed(shared_manager):
    """A real checkpoint, no sentence-transformers files: each text's last token, normalized,
    as transformers computes it; LLM.embed keeps the input order."""
    from loomllm import LLM

    texts = ["The capital of France is Paris.", "Embeddings map text to vectors.", "Hi"]
    with LLM(
        "smollm2",
        manager_socket=shared_manager.socket,
        runner="pooling",
        dtype="float32",
        quantization="none",  # the dequantized weights, which transformers reads
    ) as llm:
        outs = llm.embed(texts, use_tqdm=False)
        model_dir = llm.engine.model_info.model_dir
        token_ids = [llm.get_tokenizer().encode(t) for t in texts]
    for out, ids in zip(outs, token_ids, strict=True):
        assert out.prompt_token_ids == ids
        expected = hf_embedding(model_dir, ids, "lasttoken", normalize=True)
        assert (torch.tensor(out.outputs.embedding) - expected).abs().max().item() < TOLERANCE


async def test_score_is_the_cosine_of_the_embeddings_paired_as_vllm_pairs(tmp_path, shared_manager):
    model_dir = make_pooling_model(tmp_path, "qwen3", "mean_tokens", normalize=False)
    async with Engine(
        model_dir, manager_socket=shared_manager.socket, runner="pooling", dtype="float32"
    ) as e:
        one_to_many = await e.score("w5 w6", ["w5 w6", "w7", "w8 w9 w30"])
        pairwise = await e.score(["w5", "w7"], ["w6", "w8"])
        with pytest.raises(ValueError, match="text_1 holds 2 texts and text_2 3"):
            await e.score(["w5", "w6"], ["w7", "w8", "w9"])
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await e.score("w5", [{"prompt_token_ids": []}])
        assert len(await e.score("w5", "w6")) == 1  # serving on

    def cosine(a: list[int], b: list[int]) -> float:
        x, y = (hf_embedding(model_dir, t, "mean_tokens", False) for t in (a, b))
        return torch.nn.functional.cosine_similarity(x, y, dim=0).item()

    assert one_to_many[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    assert one_to_many[0].prompt_token_ids == [5, 6, 5, 6]
    for out, other in zip(one_to_many, [[5, 6], [7], [8, 9, 30]], strict=True):
        assert out.outputs.score == pytest.approx(cosine([5, 6], other), abs=TOLERANCE)
    for out, (a, b) in zip(pairwise, [([5], [6]), ([7], [8])], strict=True):
        assert out.outputs.score == pytest.approx(cosine(a, b), abs=TOLERANCE)


PAIRS = [("w5 w6 w7", "w8 w9"), ("w5 w6 w7", "w40 w41 w42 w43"), ("w30", "w31 w5")]


@pytest.mark.parametrize("arch", ["bert", "roberta", "xlm-roberta"])
async def test_cross_encoder_scores_match_sentence_transformers(tmp_path, shared_manager, arch):
    """A cross-encoder reads each pair as one input (BERT's with its second text's segment
    marked), its logit activated as sentence-transformers' CrossEncoder does."""
    from sentence_transformers import CrossEncoder

    model_dir = make_tiny_encoder(tmp_path / "ce", arch, num_labels=1)
    expected = CrossEncoder(model_dir, device="cpu").predict(PAIRS, batch_size=3)
    async with Engine(
        model_dir, manager_socket=shared_manager.socket, runner="pooling", dtype="float32"
    ) as e:
        one_to_many = await e.score(PAIRS[0][0], [PAIRS[0][1], PAIRS[1][1]])
        pairwise = await e.score([a for a, _ in PAIRS], [b for _, b in PAIRS])
        with pytest.raises(ValueError, match="it does not embed"):
            await e.embed("w5")
        with pytest.raises(ValueError, match="pairs of texts"):
            await e.score({"prompt_token_ids": [5]}, "w6")
        with pytest.raises(ValueError, match="token_type_ids must each be 0 or 1"):
            await e.classify({"prompt_token_ids": [1, 5, 2], "token_type_ids": [0, 2, 0]})
    scores = [out.outputs.score for out in pairwise]
    assert max(abs(a - b) for a, b in zip(scores, expected, strict=True)) < TOLERANCE
    assert [out.outputs.score for out in one_to_many] == pytest.approx(scores[:2], abs=1e-6)
    assert len(set(round(s, 4) for s in scores)) == 3  # the pairs' scores differ
    assert pairwise[0].prompt_token_ids == [1, 5, 6, 7, 2, 8, 9, 2]  # the pair, as one input


async def test_classify_matches_transformers(tmp_path, shared_manager):
    import transformers

    model_dir = make_tiny_encoder(tmp_path / "clf", "bert", num_labels=3)
    texts = ["w5 w6 w7", "w40 w41", "w9"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    with torch.inference_mode():
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        expected = model(**batch).logits.softmax(-1)
    async with Engine(
        model_dir, manager_socket=shared_manager.socket, runner="pooling", dtype="float32"
    ) as e:
        outs = [await e.classify(text) for text in texts]
        with pytest.raises(ValueError, match="one label; this classifier has 3"):
            await e.score("w5", "w6")
    probs = torch.tensor([out.outputs.probs for out in outs])
    assert (probs - expected).abs().max().item() < TOLERANCE
    assert outs[0].outputs.num_classes == 3
