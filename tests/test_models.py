import pytest

from pipeline.models import ModelError, cache_dir, prepare_embedded, resolve_model


def test_resolve_errors(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        resolve_model("./no/such/folder")
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelError, match="unknown embedded model"):
        resolve_model("embedded:gpt-9")
    assert resolve_model("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"  # hub ids pass through


@pytest.mark.slow
def test_embedded_model_is_prepared_once_and_answers():
    path = prepare_embedded()
    assert path.is_relative_to(cache_dir())
    assert (path / "model.safetensors").is_file() and (path / ".complete").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime
    assert prepare_embedded() == path and (path / "model.safetensors").stat().st_mtime == mtime  # idempotent

    from pipeline.models import load_causal_lm, load_tokenizer

    tok, lm = load_tokenizer("embedded:smollm2-135m-instruct"), load_causal_lm("embedded:smollm2-135m-instruct")
    assert tok.chat_template and "quantization_config" not in lm.config.to_dict()
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = lm.generate(**enc, max_new_tokens=20, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
