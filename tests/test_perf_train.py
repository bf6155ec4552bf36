"""`pipeline bench train`: the architectures it builds from configs, its FLOP count and its JSON result.
Speed is never asserted here."""

import json
import sys
from importlib import metadata

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.perf import train as bench


def test_qwen2_1_5b_has_the_published_shape():
    model = bench.build_arch("qwen2-1.5b", device="meta")  # no memory, no init work
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size, c.max_position_embeddings) == (1536, 8960, 28, 12, 2, 151936, 32768)
    assert c.rope_parameters["rope_theta"] == 1e6
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # tied
    # by hand: embedding 151936·1536 = 233,373,696; per layer q 1536·1536+1536, k and v 1536·256+256 each,
    # o 1536·1536, MLP 3·1536·8960, two norms 2·1536 = 46,797,824; ×28 = 1,310,339,072; final norm 1536.
    # Qwen2.5-1.5B's card: 1.54B parameters, 1.31B non-embedding.
    total = sum(p.numel() for p in model.parameters())
    assert total == 1_543_714_304
    assert bench.matmul_params(model) == (1_543_714_304, 233_373_696)  # tied: the LM head counted once


def test_flop_count_by_hand():
    fc = bench.FlopCount(n=10, head=4, layers=2, hidden=3)
    # 6·((10 - 4)·5 tokens + 4·2 scored) = 228; attention 12·2·3·5² = 1800
    assert fc.per_step([5], 2) == 228
    assert fc.per_step([5], 2, per_param=4) == 152
    assert fc.per_step([5], 2, attention=True) == 228 + 1800


def test_lora_step_flops_by_hand():
    # N = 10 matmul parameters, head 4 of them, L = 3 LoRA parameters, T = 5 tokens, S = 2 scored:
    # 4·(10 - 4)·5 = 120 frozen body, 4·4·2 = 32 LM head, 6·3·5 = 90 adapters: 242
    assert bench.lora_step_flops(10, 4, 3, 5, 2) == 242
    assert bench.lora_step_flops(10, 4, 0, 5, 5) == 4 * 10 * 5  # no adapters, every position scored: 4N·T


def test_tiny_arch_bench_writes_json(tmp_path):
    out = tmp_path / "r" / "bench.json"
    lines = []
    r = bench.run("tiny", batch=2, completion_len=8, reps=1, prompt_len=8, json_path=out, echo=lines.append)
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    assert r["model"] == "tiny" and r["batch"] == 2
    assert r["completion_tokens"] == 8 + 1 and r["tokens"] == 2 * 8 + 8 + 1  # ragged: 8, then max(1, 8 - 16)
    # one group of 2 (the default): the prompt minus its last token once (7), then per sequence its last prompt
    # token and completion but the last (8 and 1 positions)
    assert r["group_size"] == 2 and r["computed_tokens"] == 7 + 8 + 1
    assert r["params"] == sum(p.numel() for p in bench.build_arch("tiny").parameters())
    # tiny (d 64, MLP 128, 2 layers, k/v 32 wide, vocab 1024 tied): per layer q 64·64+64, k and v 64·32+32 each,
    # o 64·64, MLP 3·64·128, two norms 2·64 = 37,120; ×2 + embedding 65,536 + final norm 64 = 139,840 = N, head 65,536.
    # LoRA r=16 on q, k, v, o, gate, up, down: 16·(64+64) + 2·16·(64+32) + 16·(64+64) + 3·16·(64+128) = 16,384 a
    # layer, 32,768 in all
    assert r["lora_params"] == 32_768
    # work: ours T = 16 computed positions, TRL T = 25, S = 9 scored:
    # ours 4·74,304·16 + 4·65,536·9 + 6·32,768·16 = 4,755,456 + 2,359,296 + 3,145,728 = 10,260,480
    # TRL  4·74,304·25 + 2,359,296 + 6·32,768·25 = 7,430,400 + 2,359,296 + 4,915,200 = 14,704,896
    assert (r["ours"]["work_flops"], r["trl"]["work_flops"]) == (10_260_480, 14_704_896)
    assert r["device_rate"]["dtype"] == "float32" and r["device_rate"]["flops"] > 0
    assert r["ours"]["utilisation"] > 0 and any("utilisation" in s for s in lines)
    for k in ("ours", "trl"):
        assert r[k]["ms_per_step"] > 0 and r[k]["completion_tokens_per_s"] > 0
        assert set(r[k]) >= {"peak_memory_gib", "mfu", "tokens_per_s"}
    assert abs(r["loss"]["ours"] - r["loss"]["trl"]) < 1e-4  # the same formula in both implementations
    assert set(r["flops_per_step"]) == {"6N", "4N", "6N+attn"}
    assert r["versions"]["torch"] == metadata.version("torch") and "trl" in r["versions"]
    assert {"device", "precision", "ratio_tokens_per_s"} <= set(r)
    assert any("ratio ours/TRL" in s for s in lines)


def test_cli_rejects_unknown_arch():
    r = CliRunner().invoke(app, ["bench", "train", "--arch", "nope"])
    assert r.exit_code == 2 and "qwen2-1.5b" in r.output


def test_missing_trl_names_the_wheel(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    with pytest.raises(bench.TrlMissing, match=f"trl=={bench.TRL_VERSION}"):
        bench._import_trl()
    assert metadata.version("trl") == bench.TRL_VERSION  # the pin follows the venv


def test_qwen2_0_5b_is_the_generator_as_stored():
    """The parity bench's default: the embedded generator's shape, 630M parameters with its untied head."""
    model = bench.build_arch("qwen2-0.5b", device="meta")
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size) == (896, 4864, 24, 14, 2, 151936)
    # by hand: two 151936·896 matrices (embedding, head) = 272,269,312; per layer q 896·896+896, k and v 896·128+128
    # each, o 896·896, MLP 3·896·4864, two norms 2·896 = 14,912,384; ×24 = 357,897,216; final norm 896
    assert sum(p.numel() for p in model.parameters()) == 630_167_424


def test_train_parity_of_two_precisions_on_cpu(tmp_path):
    from pipeline.perf import train_parity as parity

    out = tmp_path / "parity.json"
    r = parity.run("tiny", parity.parse_sides("cpu:fp32,cpu:bf16"), batch=4, prompt_len=8, completion_len=8,
                   steps=2, lr=1e-3, json_path=out, echo=lambda s: None)
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    assert r["reference_side"] == "cpu:fp32" and set(r["against_reference"]) == {"cpu:bf16"}
    for side in r["sides"].values():  # the GRPO step raises the positive-advantage sequences and lowers the others
        assert side["update_direction"]["positive"] > 0 > side["update_direction"]["negative"]
        assert len(side["loss"]) == len(side["step_s"]) == 2
    c = r["against_reference"]["cpu:bf16"]
    # bf16 rounds the frozen weights and the products (8 significant bits): the start log-probs differ, not by 0
    assert c["logp0_max_abs_diff"] > 0
    # ... while the gradient and the update keep their direction (a side that dropped the adapter or flipped the
    # loss would not)
    assert c["grad0_cosine"] > 0.99 and c["update_cosine"] > 0.99


def test_train_parity_refuses_bad_sides():
    from pipeline.perf import train_parity as parity

    with pytest.raises(ValueError, match="device:precision"):
        parity.parse_sides("cpu:fp16")
    with pytest.raises(ValueError, match="twice"):
        parity.parse_sides("cpu:fp32,cpu:fp32")
    if not __import__("torch").cuda.is_available():
        r = CliRunner().invoke(app, ["bench", "train-parity", "--arch", "tiny", "--sides", "cpu:fp32,cuda:bf16"])
        assert r.exit_code == 2 and "needs a CUDA device" in r.output
