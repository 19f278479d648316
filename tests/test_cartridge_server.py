"""The tokenizer-side swap sequence (integration/cartridge_server.py) against the real scheduler handler and the real
cartridge runtime on a CPU-served model. SGLang's TokenizerManager and Scheduler need a GPU server, so two thin
stand-ins carry only what the sequence touches: SGLang's own RWLock as the model-update lock, a communicator that
hands each request to `handle_request`, and SGLang's flush reply. Covered: success and the status, a no-op
deactivation without a pause, a failed drain and a cancellation while draining that both discard the staged copy
and leave the lock free, and a failed activation answered with the primary error and the base served."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from sglang_cpu import load_as_server, msrt_base, sglang_runtime
from sglang_exl3.synth.cartridge_writer import StageSpec, write_cartridge

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cart-server")
    base = msrt_base(root, seed=4)
    return base, write_cartridge(base, root / "c", [StageSpec("r", 2, 8.0)], seed=6)


class Tokenizer:
    """What the sequence reads from SGLang's TokenizerManager."""

    def __init__(self, scheduler, idle: bool = True):
        from sglang.srt.utils.aio_rwlock import RWLock

        from sglang_exl3.integration.cartridge_server import handle_request

        self.model_update_lock, self.is_pause_cond, self.is_pause = RWLock(), asyncio.Condition(), False
        self.rid_to_state, self.idle, self.flushes, self.requests = {}, idle, 0, []

        async def communicate(req):
            self.requests.append(req.action)
            return [handle_request(scheduler, req)]
        self.exl3_cartridge_communicator = communicate

    def auto_create_handle_loop(self):
        pass

    async def flush_cache(self, timeout_s=None):
        from sglang.srt.managers.io_struct import FlushCacheReqOutput

        self.flushes += 1
        return FlushCacheReqOutput(success=self.idle, message="" if self.idle else "Timed out waiting for idle state.")


@pytest.fixture
def served(ckpts, monkeypatch):
    monkeypatch.setenv("SGLANG_EXL3_CARTRIDGES", "recapture")
    monkeypatch.setenv("SGLANG_EXL3_TEST_CARTRIDGE_FAULTS", "1")
    sglang_runtime()
    model, _ = load_as_server(ckpts[0])
    runner = SimpleNamespace(model=model, decode_cuda_graph_runner=None, prefill_cuda_graph_runner=None)
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner), tp_cpu_group=None,
                                flush_cache=lambda empty_cache=True: True)
    return model, scheduler


def _experts(model):
    return [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]


async def _lock_is_free(tm) -> bool:
    return not await tm.model_update_lock.is_locked()


def test_load_status_deactivate(ckpts, served):
    from sglang_exl3.integration import cartridge_server as cs

    model, scheduler = served
    tm = Tokenizer(scheduler)

    async def run():
        loaded = await cs.load_cartridge(tm, str(ckpts[1]))
        assert loaded["status"] == "loaded" and loaded["updated_layers"] == [2] and loaded["pause_ms"] >= 0
        assert (await cs.cartridge_status(tm))["active"] == [True]
        assert (await cs.deactivate_cartridge(tm))["updated_layers"] == [2]
        assert (await cs.cartridge_status(tm))["active"] == [False]
        return await _lock_is_free(tm)

    assert asyncio.run(run())
    assert tm.requests == ["stage", "activate", "status", "status", "deactivate", "status"]
    assert all(getattr(e, "exl3_cartridge", None) is None for e in _experts(model))


def test_deactivating_with_nothing_active_does_not_pause(served):
    from sglang_exl3.integration import cartridge_server as cs

    tm = Tokenizer(served[1])
    assert asyncio.run(cs.deactivate_cartridge(tm))["updated_layers"] == [0]
    assert tm.flushes == 0 and tm.requests == ["status"]


def test_a_failed_drain_discards_the_staged_copy(ckpts, served):
    from sglang_exl3.integration import cartridge_server as cs

    model, scheduler = served
    tm = Tokenizer(scheduler, idle=False)

    async def run():
        with pytest.raises(cs.CartridgeRequestError, match="did not become idle .* nothing was swapped"):
            await cs.load_cartridge(tm, str(ckpts[1]))
        await asyncio.gather(*cs._PENDING)
        return await _lock_is_free(tm)

    assert asyncio.run(run())
    assert tm.requests == ["stage", "discard"] and scheduler.exl3_cartridge_steps.runtime.staged is None


def test_cancelled_while_draining_discards_and_releases(ckpts, served):
    """A request in flight holds the reader lock, so the load waits in the drain; cancelling it there re-raises
    CancelledError, discards the staged copy and leaves no writer behind."""
    from sglang_exl3.integration import cartridge_server as cs

    model, scheduler = served
    tm = Tokenizer(scheduler)

    async def run():
        await tm.model_update_lock.acquire_reader()  # a generate request in flight
        load = asyncio.create_task(cs.load_cartridge(tm, str(ckpts[1])))
        while tm.requests != ["stage"] or tm.model_update_lock._waiting_writers == 0:
            await asyncio.sleep(0.01)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        await asyncio.gather(*cs._PENDING)
        await tm.model_update_lock.release_reader()
        return await _lock_is_free(tm)

    assert asyncio.run(run())
    assert tm.requests == ["stage", "discard"] and scheduler.exl3_cartridge_steps.runtime.staged is None
    assert all(getattr(e, "exl3_cartridge", None) is None for e in _experts(model))


def test_a_failed_activation_answers_the_primary_error_and_serves_the_base(ckpts, served):
    from sglang_exl3.integration import cartridge_server as cs

    model, scheduler = served
    tm = Tokenizer(scheduler)

    async def run():
        with pytest.raises(cs.CartridgeRequestError, match="rolled back to the base: injected fault at commit"):
            await cs.load_cartridge(tm, str(ckpts[1]), inject_fault="commit")
        return await _lock_is_free(tm)

    assert asyncio.run(run())
    assert all(getattr(e, "exl3_cartridge", None) is None for e in _experts(model))
    with pytest.raises(cs.CartridgeRequestError, match="inject_fault 'nowhere' needs"):
        asyncio.run(cs.load_cartridge(tm, str(ckpts[1]), inject_fault="nowhere"))


def test_draft_layers_take_no_cartridge(served):
    from sglang_exl3.layers.cartridge_runtime import CartridgeRuntime

    model, _ = served
    experts = _experts(model)
    experts[0].exl3_role = "draft"
    try:
        assert list(CartridgeRuntime(model).layers) == ["model.layers.1.mlp.experts"]
    finally:
        experts[0].exl3_role = "target"


def test_committing_before_preparing_is_refused(served):
    from sglang_exl3.format.cartridge_manifest import CartridgeError
    from sglang_exl3.layers.cartridge_runtime import CartridgeRuntime

    with pytest.raises(CartridgeError, match="no cartridge is prepared"):
        CartridgeRuntime(served[0]).commit()


def test_an_empty_batch_runs(ckpts, served):
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from sglang_exl3.layers import cartridge_swap as swap
    from sglang_exl3.layers.cartridge_runtime import CartridgeRuntime

    model, _ = served
    steps = swap.SwapSteps(CartridgeRuntime(model), lambda: None, None)
    swap.stage(steps, str(ckpts[1]))
    swap.activate(steps)
    experts = _experts(model)[0]
    routing = StandardTopKOutput(torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 4))
    empty = StandardDispatchOutput(hidden_states=torch.zeros(0, 256, dtype=torch.bfloat16), hidden_states_scale=None,
                                   topk_output=routing)
    assert experts.quant_method.apply(experts, empty).hidden_states.shape == (0, 256)
    swap.deactivate(steps)
