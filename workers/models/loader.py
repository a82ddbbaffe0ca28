"""Load a model on a worker: its source found and prepared (sources.py), then built on its
device in its dtype, by loomllm's own Llama family or transformers, and quantized.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loomllm.protocols.choices import CPU_LINEAR_KERNELS, LOAD_FORMATS, MODEL_IMPLS
from loomllm.workers.attention.geometry import kv_geometry
from loomllm.workers.device.dtype import DTYPES, pick_dtype, resolve_device, stored_dtype
from loomllm.workers.models import architectures, encoders, gguf_model, llama4
from loomllm.workers.models import quantization as quantize
from loomllm.workers.models.half_weights import WEIGHT_DTYPES, store_linear_weights_in
from loomllm.workers.models.llama import config as llama_config
from loomllm.workers.models.llama import weights as llama_weights
from loomllm.workers.models.llama.model import LlamaFamilyForCausalLM
from loomllm.workers.models.sources import (
    ModelLoadError,
    ModelSource,
    cache_root,
    prepare_model_dir,
    resolve_model,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    """A model ready for the worker: eval mode, on `device`, in `dtype`."""

    model: torch.nn.Module
    model_dir: Path
    config: Any  # the HF config of the model (facts below come from its text config)
    source: ModelSource
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32", "bfloat16", "float16"
    device: str  # "cpu", "cuda:0", ...
    tp_size: int = 1  # tensor-parallel ranks the weights (and KV heads) are split over
    encoder: bool = False  # a BERT-family encoder (models/encoders.py): it embeds only


def load_model(
    model: str,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    weight_dtype: str | None = None,
    load_format: str = "auto",
    tensor_parallel_size: int = 1,
    model_impl: str = "auto",
    quantization: str | None = None,
    cpu_linear_kernel: str = "auto",
    batch_invariant: bool = False,
    revision: str | None = None,
) -> LoadedModel:
    """Resolve, prepare and load `model` in eval mode on `device`.

    dtype: "auto" (on CPU: bfloat16 where the CPU computes it natively, else float32; see
    device/cpu_features.py; on CUDA: the checkpoint's 16-bit dtype, else bfloat16),
    "float32", "bfloat16" or "float16". device: "cpu", "cuda", "cuda:N" or "auto".
    weight_dtype: "bfloat16" or "float16" stores a float32 model's linear weights in 16
    bits (models/half_weights.py); ignored, with a log line, when the model is 16-bit anyway.
    load_format: "auto" reads the weights; "dummy" builds the model from its config with
    random weights, on the device (as vLLM's dummy format: benchmarks, where with
    ignore_eos the values change nothing of the cost).
    tensor_parallel_size > 1: this rank's shard only (transformers' tp_plan over the
    torch.distributed group the caller has initialized); heads must split evenly.
    model_impl: see MODEL_IMPLS; tensor parallelism runs transformers' modeling code.
    quantization: see models/quantization.py (None: a GGUF file runs as it is stored, on
    the CPU, with loomllm's own model); cpu_linear_kernel overrides the measured choice of
    "int8" and "int4", and is refused elsewhere.
    batch_invariant: a GGUF run as stored computes every batch size on one kernel, so that a
    row's result does not depend on its batch.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}"
        )
    if weight_dtype is not None and weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(
            f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)} or None; got {weight_dtype!r}"
        )
    if dtype != "auto" and dtype not in DTYPES:
        allowed = ", ".join(map(repr, ["auto", *DTYPES]))
        raise ValueError(f"dtype must be one of {allowed}; got {dtype!r}")
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}; got {model_impl!r}")
    torch_device = resolve_device(device)
    source = resolve_model(model, revision)
    model_dir = prepare_model_dir(source)
    architecture = architectures.check(model_dir / "config.json")  # before any weight is read
    if architecture in encoders.ENCODERS or architecture in encoders.CLASSIFIERS:
        if tensor_parallel_size > 1 or quantization not in (None, "none") or model_impl == "loom":
            raise ValueError(
                f"{architecture} runs with transformers' model on one rank, unquantized: "
                "model_impl='loom', tensor_parallel_size and quantization are for decoders"
            )
        return _load_encoder(
            model, source, model_dir, dtype, torch_device, weight_dtype, load_format
        )
    shape, why_not = None, "model_impl='transformers'"
    if model_impl != "transformers":
        shape, why_not = llama_config.read_shape(model_dir / "config.json")
        if shape is not None and tensor_parallel_size > 1:
            shape, why_not = None, "tensor parallelism (transformers' tp_plan shards it)"
        if (
            shape is not None
            and load_format != "dummy"
            and source.kind != "gguf"
            and not llama_weights.safetensors_files(model_dir)
        ):
            shape, why_not = None, "no safetensors checkpoint"
        if shape is None and model_impl == "loom":
            raise ValueError(f"model_impl='loom' cannot run {model!r}: {why_not}")
    quantization = quantize.resolve(
        quantization,
        source.kind,
        torch_device,
        shape is not None,
        weight_dtype=weight_dtype,
        dummy=load_format == "dummy",
    )
    if cpu_linear_kernel not in CPU_LINEAR_KERNELS:
        allowed = ", ".join(CPU_LINEAR_KERNELS)
        raise ValueError(f"cpu_linear_kernel must be one of {allowed}; got {cpu_linear_kernel!r}")
    if cpu_linear_kernel != "auto" and quantization not in ("int8", "int4"):
        # A GGUF's blocks run on the GGUF kernels, a float model's weights on dense matmuls:
        # neither has a kernel to choose, and ignoring the option would hide that.
        raise ValueError(
            f"cpu_linear_kernel={cpu_linear_kernel!r} chooses the kernel of weights quantized "
            f"on load (quantization 'int8' or 'int4'); this load's quantization is "
            f"{quantization!r}"
        )
    if shape is not None:
        loaded = _load_llama_family(
            model,
            source,
            model_dir,
            shape,
            dtype,
            torch_device,
            weight_dtype,
            load_format,
            quantization,
            batch_invariant,
        )
        if quantization in ("int8", "int4"):
            assert isinstance(loaded.model, LlamaFamilyForCausalLM)
            with torch.no_grad():
                quantize.quantize(loaded.model, quantization, cpu_linear_kernel, cache_root())
        return loaded
    logger.info("loading %s with transformers' modeling code: %s", model, why_not)
    if source.kind == "gguf":
        model_dir = prepare_model_dir(source, dense_weights=True)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_dir)
        torch_dtype = pick_dtype(dtype, stored_dtype(config), torch_device)
        if tensor_parallel_size > 1:
            _check_tensor_parallel(config, tensor_parallel_size, weight_dtype, load_format)
            module = AutoModelForCausalLM.from_pretrained(
                model_dir, config=config, dtype=torch_dtype, tp_plan="auto"
            )
        elif load_format == "dummy":
            with torch_device:  # initialized where it runs: an 8B model never sits in RAM
                module = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        else:
            module = AutoModelForCausalLM.from_pretrained(
                model_dir, config=config, dtype=torch_dtype, device_map={"": torch_device}
            )
    except Exception as exc:
        raise ModelLoadError(f"could not load model {model!r} from {model_dir}: {exc}") from exc
    module.eval()
    _store_weights_in(module, weight_dtype, torch_dtype)
    text = module.config.get_text_config()
    max_len = getattr(text, "max_position_embeddings", None)
    if max_len is None:
        raise ModelLoadError(f"config of {model_dir} has no max_position_embeddings")
    limit = llama4.context_limit(text)
    if limit is not None and limit < max_len:
        logger.info(
            "max_model_len capped at %d, the chunk of %s's chunked attention (past it, "
            "loomllm's attention would not be chunked)",
            limit,
            architecture,
        )
        max_len = limit
    llama4.adapt(module)
    num_layers, num_kv_heads, head_dim = kv_geometry(text)
    return LoadedModel(
        model=module,
        model_dir=model_dir,
        config=module.config,
        source=source,
        vocab_size=text.vocab_size,
        max_model_len=max_len,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=str(torch_dtype).removeprefix("torch."),
        device=str(next(module.parameters()).device),  # "cuda:0" where "cuda" was asked for
        tp_size=tensor_parallel_size,
    )


def _load_encoder(
    model: str,
    source: ModelSource,
    model_dir: Path,
    dtype: str,
    device: torch.device,
    weight_dtype: str | None,
    load_format: str,
) -> LoadedModel:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
        torch_dtype = pick_dtype(dtype, stored_dtype(config), device)
        module = encoders.load_encoder(model_dir, torch_dtype, device, load_format == "dummy")
    except Exception as exc:
        raise ModelLoadError(f"could not load model {model!r} from {model_dir}: {exc}") from exc
    module.eval()
    _store_weights_in(module, weight_dtype, torch_dtype)
    num_layers, num_kv_heads, head_dim = kv_geometry(config)
    return LoadedModel(
        model=module,
        model_dir=model_dir,
        config=module.config,
        source=source,
        vocab_size=config.vocab_size,
        max_model_len=encoders.max_tokens(config),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=str(torch_dtype).removeprefix("torch."),
        device=str(next(module.parameters()).device),
        encoder=True,
    )


def _load_llama_family(
    model: str,
    source: ModelSource,
    model_dir: Path,
    shape: llama_config.DecoderShape,
    dtype: str,
    device: torch.device,
    weight_dtype: str | None,
    load_format: str,
    quantization: str,
    batch_invariant: bool = False,
) -> LoadedModel:
    started = time.perf_counter()
    try:
        torch_dtype = pick_dtype(dtype, shape.dtype, device)
        if source.kind == "gguf" and load_format != "dummy":
            module = gguf_model.build(
                shape,
                torch_dtype,
                device,
                Path(source.path),
                quantization == "gguf",
                batch_invariant=batch_invariant,
            )
            load_format = "GGUF" if quantization == "gguf" else "dequantized GGUF"
        else:
            module = llama_weights.build(shape, torch_dtype, device, model_dir, load_format)
    except gguf_model.UnsupportedTensorType as exc:
        raise ModelLoadError(f"could not load model {model!r}: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(
            f"could not load model {model!r} from {model_dir}: {exc} "
            "(model_impl='transformers' loads it with transformers' modeling "
            "code instead)"
        ) from exc
    _store_weights_in(module, weight_dtype, torch_dtype)
    logger.info(
        "%s built by loomllm's own model (%s weights) in %.1f s",
        shape.architecture,
        load_format,
        time.perf_counter() - started,
    )
    return LoadedModel(
        model=module,
        model_dir=model_dir,
        config=shape,
        source=source,
        vocab_size=shape.vocab_size,
        max_model_len=shape.max_position_embeddings,
        num_layers=shape.num_hidden_layers,
        num_kv_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        dtype=str(torch_dtype).removeprefix("torch."),
        device=str(next(module.parameters()).device),
    )


def _store_weights_in(
    module: torch.nn.Module, weight_dtype: str | None, torch_dtype: torch.dtype
) -> None:
    if weight_dtype is None:
        return
    if torch_dtype == torch.float32:
        store_linear_weights_in(module, weight_dtype)
    else:
        logger.info("weight_dtype=%s ignored: the model runs in %s", weight_dtype, torch_dtype)


def _check_tensor_parallel(
    config: Any, tp_size: int, weight_dtype: str | None, load_format: str
) -> None:
    """ValueError unless transformers can shard this model over `tp_size` ranks evenly."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if not getattr(text, "base_model_tp_plan", None):
        raise ValueError(
            f"tensor_parallel_size={tp_size}: transformers has no tensor-parallel "
            f"plan for {type(text).__name__}"
        )
    if heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide the model's {heads} attention heads "
            f"and {kv_heads} KV heads (each rank holds an equal share of them)"
        )
    if weight_dtype is not None or load_format != "auto":
        raise ValueError(
            f"tensor_parallel_size={tp_size} works with the default weight_dtype "
            "and load_format only"
        )
