"""Shared fixtures: the embedded default model (float32), its transformers twin, and a tiny
random Llama that shares the default tokenizer (fast property tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from spectral.models.resolve import resolve_model_path

# Two cores: one suite process uses both; under pytest-xdist (-n 2) each worker, and every
# server or worker process it starts, uses one.
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
if THREADS == 1:
    os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(THREADS)


def _build_test_kernels_beside() -> None:
    """The builds of the kernels that only the tests use (scalar loops; AVX2 on an AVX-512 CPU)
    start in processes of their own as the session starts, so that on a fresh machine they
    compile while the native build does (each is one single-threaded compiler run); the test
    modules that load them then wait on torch's build lock for a build already under way."""
    import subprocess
    import sys

    from spectral.kernels.cpu_kernels import cpu_flags, is_built

    for isa in ("scalar", "avx2") if "avx512f" in cpu_flags() else ("scalar",):
        if not is_built(isa):
            code = f"from spectral.kernels.cpu_kernels import load_cpu_kernels as l; l({isa!r})"
            subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)


_build_test_kernels_beside()


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    return resolve_model_path("default")


@pytest.fixture(scope="session")
def hf_model(default_model_dir: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: str):
    return AutoTokenizer.from_pretrained(default_model_dir)


# The float32 server that test_server.py and test_sglang_compat.py share (one start-up).
SERVER_API_KEY = "test-key"


@pytest.fixture(scope="session")
def fp32_server(default_model_dir: str):
    from tests.server_utils import start_fp32_server, stop_server

    proc, url = start_fp32_server(
        default_model_dir, SERVER_API_KEY, "--served-model-name", "smollm2"
    )
    yield url
    stop_server(proc)


@pytest.fixture(scope="session")
def engine_fp32(default_model_dir: str):
    from spectral import Engine

    engine = Engine(model_path=default_model_dir, dtype="float32", max_total_tokens=16384)
    yield engine
    engine.shutdown()


def make_tiny_model(
    path: Path, tokenizer_dir: str, seed: int = 0, model_type: str = "llama", **overrides
) -> str:
    """A 2-layer random model (a Llama unless `model_type` says otherwise) with the tokenizer
    of `tokenizer_dir`, saved as a HF directory; biases, which transformers initialises to
    zero, drawn like the weights."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings))
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.data.normal_(0.0, model.config.initializer_range)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def peaky_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """A tiny random Llama with large weights: its next-token distributions are sharp, so greedy
    choices are far from ties and equal-output tests between scheduler settings are robust."""
    return make_tiny_model(
        tmp_path_factory.mktemp("peaky-llama"),
        default_model_dir,
        seed=1,
        initializer_range=1.0,
        max_position_embeddings=2048,
    )


def make_scheduler(model_dir: str, num_kv_slots: int = 4096, **options):
    """A Scheduler over a float32 worker, stepped by the test itself (no engine thread)."""
    from transformers import AutoTokenizer

    from spectral.models.config import ModelConfig
    from spectral.scheduler.config import SchedulerConfig
    from spectral.scheduler.scheduler import Scheduler

    config = ModelConfig.from_pretrained(model_dir)
    max_running = options.pop("max_running_requests", 64)
    worker = make_worker(model_dir, num_kv_slots, config.max_context_len, max_running=max_running)
    limits = SchedulerConfig(
        num_kv_slots=num_kv_slots,
        max_running_requests=max_running,
        max_context_len=config.max_context_len,
        max_prefill_tokens=options.pop("max_prefill_tokens", 8192),
        eos_token_ids=(2,),
        vocab_size=config.vocab_size,
        **options,
    )
    return Scheduler(worker, AutoTokenizer.from_pretrained(model_dir), limits, spec=None)


def scheduler_leaks(s) -> list[str]:
    """What a drained scheduler failed to give back (empty when nothing leaked)."""
    kv = s.kv
    problems = []
    if s.running or s.waiting or s.chunked is not None:
        problems.append("requests still queued")
    if kv.tree.protected_size:
        problems.append(f"{kv.tree.protected_size} tokens still locked")
    if kv.allocator.free_count + kv.tree.evictable_size != kv.allocator.num_slots:
        problems.append(
            f"free {kv.allocator.free_count} + evictable {kv.tree.evictable_size} "
            f"!= total {kv.allocator.num_slots}"
        )
    if len(kv.free_rows) != kv.max_rows:
        problems.append("request rows not returned")
    return problems


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


def make_worker(
    model_dir: str,
    max_total_tokens: int,
    max_context_len: int,
    use_cpu_kernels: bool = True,
    max_running: int = 4,
):
    """A float32 CPU worker."""
    from spectral.worker.model_worker import ModelWorker

    return ModelWorker(
        model_dir,
        dtype=torch.float32,
        device="cpu",
        max_total_tokens=max_total_tokens,
        max_running_requests=max_running,
        max_context_len=max_context_len,
        use_cpu_kernels=use_cpu_kernels,
    )


def wait_idle(engine, timeout: float = 10.0) -> None:
    """Wait until the engine's scheduler thread has nothing in flight."""
    deadline = time.monotonic() + timeout
    while engine.scheduler.has_work or engine._listeners:
        assert time.monotonic() < deadline, "engine did not become idle"
        time.sleep(0.01)


def assert_no_leaks(engine) -> None:
    """Everything the scheduler handed out has come back: every slot is free or in the radix
    cache unlocked, every request row is free."""
    wait_idle(engine)
    s = engine.scheduler
    kv = s.kv
    assert not s.running and not s.waiting and s.chunked is None
    assert kv.tree.protected_size == 0
    assert kv.allocator.free_count + kv.tree.evictable_size == kv.allocator.num_slots
    assert len(kv.free_rows) == kv.max_rows


def run_under_triton_interpreter(module: str) -> str:
    """Run `python -m module` with Triton's interpreter on (it must be chosen before triton is
    imported, which this process may have done); its output, after asserting it succeeded."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=300
    )
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# The files that share the session's float32 server (`fp32_server`): one unit of work for
# pytest-xdist (`pytest_xdist_make_scheduler`), so that the server starts once, not on each
# worker that runs one of them.
FP32_SERVER_FILES = (
    "test_server.py",
    "test_sglang_compat.py",
    "test_lang.py",
    "test_structured.py",
)

# The longest files (that group first), longest first: handed out first (make test passes
# --no-loadscope-reorder), they do not leave one pytest-xdist worker running them alone at the
# end (--dist loadfile).
LONGEST_FILES = (
    *FP32_SERVER_FILES,
    "test_tensor_parallel.py",
    "test_structured_spec.py",
    "test_data_parallel.py",
    "test_gguf_native.py",
    "test_hostile.py",
    "test_speculative.py",
    "test_gpu_kit.py",
    "test_generate_greedy.py",
    "test_worker_process.py",
    "test_parallel_layers.py",
    "test_architectures.py",
    "test_standalone.py",
    "test_scheduler.py",
    "test_engine.py",
    "test_train_eagle3.py",
    "test_triton_attention.py",
    "test_int8_serving.py",
    "test_spec_tree.py",
)


@pytest.hookimpl(optionalhook=True)  # pytest without pytest-xdist runs the suite too
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadfile, with the FP32_SERVER_FILES one unit."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "fp32_server" if Path(path).name in FP32_SERVER_FILES else path

    return SharedServerScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))
