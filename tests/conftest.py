"""Suite-wide set-up, and the one place that chooses where kernels run.

``DEVICE`` is CUDA when the machine has it, else the CPU; every kernel, attention, engine and
offload test puts its tensors and models there (``from conftest import DEVICE``). Triton's
interpreter is selected here and nowhere else, only without CUDA, and before anything imports
Triton (transformers does on import): on a GPU machine ``pytest`` runs the compiled kernel on the
GPU, without one every Triton kernel runs on the CPU through the interpreter."""

import contextlib
import os

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Each pytest-xdist worker gets its share of the cores: two workers with torch's default of one
# thread per core oversubscribe the CPU, and OpenMP's spinning threads then slow both down.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, _workers)))


import pytest  # noqa: E402


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to ``n`` inside, the previous count restored after (a test
    never leaves it changed for the tests after it). Module-scoped fixtures use it directly."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Every test measures on a "quiet" machine: ``measured``'s busy detector says quiet, so a test's
    measurements are cached whatever else runs here (tests of the detector replace it themselves)."""
    from dyntree_core import measured

    monkeypatch.setattr(measured, "busy_detector", lambda watch: None)


@pytest.fixture()
def one_torch_thread():
    """One torch thread for this test, the count restored after it: tiny models gain nothing from
    threads, and OpenMP's spinning threads slow their many small ops down on a busy machine."""
    with torch_threads(1):
        yield


def pytest_collection_modifyitems(config, items):
    """On pytest-xdist workers the long statistical tests (marker ``slow``) come first, so the last
    minutes of a run are short tests that both workers share (``--dist worksteal``), not one worker
    alone on a 3-minute test. Every worker sorts the same collection the same way (xdist requires it)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def embedded_fetched() -> None:
    """Fails (never fetches) unless the embedded pair was fetched by `make test` beforehand."""
    from dyntree_core.models.fetch import cache_root, converted
    from dyntree_core.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_preset

    for name in (DEFAULT_DRAFT, DEFAULT_TARGET):
        p = resolve_preset(name)
        if not converted(cache_root() / "models" / p.name, p.sha256):
            pytest.fail(f"embedded model {name} is not in {cache_root()}; run `python -m dyntree_core fetch` first")


@pytest.fixture(scope="session")
def embedded_pair(embedded_fetched):
    """The embedded Qwen2.5-Coder pair in fp32 (fetched by `make test` beforehand; never fetched here)."""
    from dyntree_core.models.load import load_pair

    return load_pair("embedded", "embedded", dtype="float32", device="cpu")


@pytest.fixture()
def kernel_calls(monkeypatch):
    """Records the metadata of every Triton tree-attention kernel launch made through the HF glue."""
    from dyntree_core.attention import hf_backend

    calls = []
    real = hf_backend.triton_tree_attention

    def spy(q, k, v, meta, **kw):
        calls.append(meta)
        return real(q, k, v, meta, **kw)

    monkeypatch.setattr(hf_backend, "triton_tree_attention", spy)
    return calls


@pytest.fixture()
def auto_table_store(tmp_path, monkeypatch):
    """An empty store for ``attention="auto"`` tables (``attention.auto_table``), forgotten afterwards."""
    from dyntree_core.attention import auto_table

    monkeypatch.setenv("DYNTREE_CACHE", str(tmp_path))
    auto_table.reload()
    yield tmp_path
    auto_table.reload()
