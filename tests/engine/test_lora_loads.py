"""A worker's adapter reads (engine.lora_loads): requests wait while their adapter is read on a
thread, are handed back once it is registered, and are failed with the reason when the files
are not the adapter they were admitted with, or not an adapter at all; an abort takes a waiting
request out; a worker serving no adapters refuses requests that name one."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from lora_testing import make_peft_adapter

from tandem.engine.lora_adapter import load_lora_adapter
from tandem.engine.lora_loads import AdapterLoads, AdapterRef
from tandem.engine.runner import ModelRunner


@pytest.fixture(scope="module")
def base(tiny_checkpoints) -> str:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loads")
    return {"a": make_peft_adapter(base, root / "a", 4, 8, ["q_proj", "v_proj"], seed=1),
            "b": make_peft_adapter(base, root / "b", 8, 8, ["o_proj", "down_proj"], seed=2)}


def _ref(runner, name: str, path: str) -> AdapterRef:
    return AdapterRef(name, path, load_lora_adapter(path, runner.config, 16).digest)


def _poll_until_done(loads: AdapterLoads, timeout_s: float = 30.0):
    released, failed = [], []
    deadline = time.monotonic() + timeout_s
    while loads.num_waiting and time.monotonic() < deadline:
        r, f = loads.poll()
        released += r
        failed += f
        time.sleep(0.01)
    return released, failed


def test_requests_wait_for_their_adapter_and_are_released_once_it_is_read(base, adapters):
    runner = ModelRunner(base, num_blocks=8, block_size=4)
    loads = AdapterLoads(runner.enable_lora(max_loras=2, max_rank=16))
    ref = _ref(runner, "a", adapters["a"])
    assert loads.problem(ref) is None and not loads.ready(ref)
    loads.hold(ref, "req-1")
    loads.hold(ref, "req-2")  # one read for both
    loads.hold(_ref(runner, "b", adapters["b"]), "req-3")
    assert loads.take(lambda r: r == "req-3") == ["req-3"]  # aborted while its adapter is read
    released, failed = _poll_until_done(loads)
    assert released == ["req-1", "req-2"] and failed == []
    assert loads.ready(ref) and ref.key in runner.lora
    assert runner.lora.slots_for([ref.key]) == {ref.key: 0}  # a step can take it now
    loads.close()


def test_an_adapter_whose_files_changed_is_refused_with_its_digest(base, adapters, tmp_path):
    runner = ModelRunner(base, num_blocks=8, block_size=4)
    loads = AdapterLoads(runner.enable_lora(max_loras=2, max_rank=16))
    path = str(tmp_path / "moving")
    shutil.copytree(adapters["a"], path)
    ref = _ref(runner, "moving", path)
    shutil.rmtree(path)
    shutil.copytree(adapters["b"], path)  # another adapter's weights at the admitted path
    loads.hold(ref, "req")
    released, failed = _poll_until_done(loads)
    assert released == [] and len(failed) == 1
    assert "digest" in failed[0][1] and "changed" in failed[0][1]
    assert ref.key not in runner.lora  # nothing registered
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    loads.hold(AdapterRef("gone", path, "0" * 64), "req-2")
    released, failed = _poll_until_done(loads)
    assert failed and "adapter_model.safetensors" in failed[0][1]
    loads.close()


def test_a_worker_serving_no_adapters_refuses_a_request_naming_one(base, adapters):
    loads = AdapterLoads(None)
    problem = loads.problem(AdapterRef("a", adapters["a"], "x" * 64))
    assert problem is not None and "--enable-lora" in problem
    runner = ModelRunner(base, num_blocks=8, block_size=4)
    serving = AdapterLoads(runner.enable_lora(max_loras=1, max_rank=16))
    assert "lacks" in serving.problem(AdapterRef("a", "", ""))


def test_startup_adapters_are_ready_before_the_first_request(base, adapters, tmp_path):
    """--lora-modules are read at start: a request naming one with its weights runs at once; a
    broken one is left out (its requests get the reason when they read it)."""
    runner = ModelRunner(base, num_blocks=8, block_size=4)
    loads = AdapterLoads(runner.enable_lora(max_loras=2, max_rank=16))
    broken = tmp_path / "broken"
    broken.mkdir()
    keys = loads.preload({"a": adapters["a"], "b": adapters["b"], "broken": str(broken)})
    a, b = _ref(runner, "a", adapters["a"]), _ref(runner, "b", adapters["b"])
    assert keys == [a.key, b.key]
    assert loads.ready(a) and loads.ready(b) and loads.num_waiting == 0
    assert not loads.ready(AdapterRef("a", adapters["a"], "0" * 64))  # other weights: read again
    loads.close()


def test_a_read_beside_a_busy_step_loop_is_not_starved(tmp_path):
    """A worker reads adapters on a thread while its step loop keeps the GIL busy: the read takes
    a few GIL hand-overs, not a few per tensor (224 tensors here; read tensor by tensor it took
    seconds, each hand-over waiting out the busy thread's switch interval)."""
    import threading

    from tandem.bench.random_lora import write_random_adapter
    from tandem.bench.shapes import hf_config_dict
    from tandem.engine.config import ModelConfig

    config = ModelConfig.from_dict(hf_config_dict("llama3.2-1b"))  # 16 layers x 7 projections
    path = write_random_adapter(config, str(tmp_path / "adapter"), rank=4)
    idle = load_lora_adapter(path, config, 16)
    stop = threading.Event()

    def step_loop():  # pure Python: holds the GIL but for the interpreter's switch interval
        n = 0
        while not stop.is_set():
            n += 1

    busy = threading.Thread(target=step_loop)
    busy.start()
    try:
        t0 = time.monotonic()
        again = load_lora_adapter(path, config, 16)
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        busy.join()
    assert again.digest == idle.digest and len(again.modules) == 16 * 7
    assert elapsed < 2.0, f"the read took {elapsed:.2f} s beside a busy thread"
