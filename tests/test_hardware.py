"""The dtype follows the hardware (pipeline.engines.hardware): `auto` is bf16 only where the probe measures bf16 at
least as fast as fp32; an explicit bf16 where it is slow is honoured with a warning naming the slowdown; the probe
runs once per machine. The rates are injected: what is tested is the rule, not this machine's CPU."""

import json
import logging
from pathlib import Path

import pytest
import yaml

from pipeline.config import config_from_dict
from pipeline.engines import hardware

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def probed(monkeypatch, tmp_path):
    """A fresh cache dir, no forcing env, and a probe that returns the rates given to `set_rates` (counting calls)."""
    monkeypatch.setenv("PIPELINE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(hardware.FORCE_ENV, raising=False)
    monkeypatch.setattr(hardware, "_said", set())  # each test sees its own first log lines
    calls = []

    def set_rates(fp32: float, bf16: float):
        def measure(reps: int = 3):
            calls.append((fp32, bf16))
            return fp32, bf16

        monkeypatch.setattr(hardware, "measure_cpu", measure)

    return set_rates, calls


def test_auto_is_float32_where_bf16_is_slow_and_the_warning_names_the_slowdown(probed, caplog):
    set_rates, calls = probed
    set_rates(36.0, 0.8)  # an AVX2-only EPYC: 45x
    with caplog.at_level(logging.INFO, logger="pipeline.hardware"):
        assert hardware.resolve_dtype("auto", "cpu") == "float32"
        assert hardware.resolve_dtype("bfloat16", "cpu") == "bfloat16"  # honoured
    assert any("auto -> float32" in r.message for r in caplog.records)
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "45x slower" in warned[0]
    assert len(calls) == 1  # the second resolution read the cached verdict
    with caplog.at_level(logging.INFO, logger="pipeline.hardware"):
        caplog.clear()
        assert hardware.resolve_dtype("auto", "cpu") == "float32"
        assert hardware.resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert not caplog.records  # a stage resolves its dtypes several times: each line is said once a process


def test_auto_is_bfloat16_where_bf16_is_at_least_as_fast(probed, caplog):
    set_rates, _ = probed
    set_rates(60.0, 240.0)  # AMX
    with caplog.at_level(logging.WARNING, logger="pipeline.hardware"):
        assert hardware.resolve_dtype("auto", "cpu") == "bfloat16"
        assert hardware.resolve_dtype("bfloat16", "cpu") == "bfloat16"
        assert hardware.resolve_bf16("auto", "cpu") is True
    assert not caplog.records  # nothing to warn about


def test_the_verdict_is_cached_per_machine_and_survives_a_new_process(probed, tmp_path):
    set_rates, calls = probed
    set_rates(36.0, 0.8)
    first = hardware.probe("cpu")
    files = list((tmp_path / "hardware").glob("dtype-probe-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["native_bf16"] is False
    set_rates(1.0, 100.0)  # a probe that would now say the opposite is not run again
    assert hardware.probe("cpu") == first and len(calls) == 1
    assert hardware.probe("cpu", refresh=True).native_bf16 is True and len(calls) == 2
    files[0].write_text("{not json")  # a torn file is measured again, not an error
    assert hardware.probe("cpu").native_bf16 is True and len(calls) == 3


def test_explicit_and_forced_choices(monkeypatch, probed):
    set_rates, calls = probed
    set_rates(36.0, 0.8)
    assert hardware.resolve_dtype("float32") == "float32" and hardware.resolve_dtype("float16") == "float16"
    assert hardware.resolve_bf16(False, "cpu") is False
    assert not calls  # fixed choices need no probe
    monkeypatch.setenv(hardware.FORCE_ENV, "1")
    assert hardware.resolve_dtype("auto", "cpu") == "bfloat16" and not calls
    monkeypatch.setenv(hardware.FORCE_ENV, "0")
    assert hardware.resolve_bf16("auto", "cpu") is False and not calls
    with pytest.raises(ValueError, match="unknown dtype 'bf16'"):
        hardware.resolve_dtype("bf16")


def test_shipped_configs_use_auto_and_defaults_are_auto():
    cfg = config_from_dict({}, "defaults")
    assert (cfg.generator.dtype, cfg.training.bf16) == ("auto", "auto")
    for path in sorted((REPO / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        for section in ("generator", "executor"):
            serve = (raw.get(section) or {}).get("serve") or {}
            assert serve.get("dtype", "auto") == "auto", (path.name, section)
        # fp32 is pinned only by the test configs, whose log-probs are compared across backends
        assert raw.get("generator", {}).get("dtype", "auto") in (("auto", "float32") if path.stem in
                                                                ("smoke", "two-level") else ("auto",)), path.name
        assert raw.get("training", {}).get("bf16", "auto") == "auto", path.name


@pytest.mark.parametrize("run", ["gsm-learn/gsm-learn-s0", "gsm-learn/gsm-learn-baseline-io"])
def test_runs_frozen_before_the_auto_defaults_keep_their_finished_stages(run):
    """A committed store's saved config (bf16 and fp32 spelled out at their former defaults) hashes to what its stage
    manifests recorded, so its finished stages stay finished on a fresh clone."""
    root = REPO / "data" / "stores" / run
    cfg = config_from_dict(yaml.safe_load((root / "config.yaml").read_text()), str(root))
    manifests = sorted(root.glob("round=*/_done/*.json"))
    assert manifests
    assert {json.loads(m.read_text())["config_hash"] for m in manifests} == {cfg.config_hash()}


def test_a_machine_is_named_by_its_cpu_its_widest_vector_extension_and_its_cores():
    from pipeline.engines.hardware import machine

    amx = "fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile"
    assert machine(amx, "Intel Xeon Platinum", 4) == "Intel Xeon Platinum (AMX, 4 cores)"
    assert machine("avx2 avx512f avx512_bf16", "X", 2) == "X (AVX512-BF16, 2 cores)"
    assert machine("avx2 avx512f", "X", 2) == "X (AVX-512, 2 cores)"
    assert machine("fpu sse avx2", "AMD EPYC", 2) == "AMD EPYC (AVX2, 2 cores)"
    assert machine("fpu sse", "old", 1) == "old (no AVX2, 1 cores)"
