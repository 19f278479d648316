"""The swap transaction on served models (SGLang's Qwen3-MoE class on the CPU, the real cartridge runtime): the
order of its steps, every injected failure rolled back to outputs bit-identical to the base, a failed restore that
stops the server, TP all-or-nothing (two ranks voting from two threads, one failing), resident slots switched in
place; and the server glue that needs no running scheduler: the request types through SGLang's msgpack, the
dispatcher hook, the HTTP bodies and status codes."""

from __future__ import annotations

import threading

import pytest
import torch

from sglang_cpu import load_as_server, msrt_base, sglang_runtime
from sglang_exl3.layers import cartridge_swap as swap
from sglang_exl3.layers.cartridge_runtime import CartridgeRuntime
from sglang_exl3.synth.cartridge_writer import StageSpec, write_cartridge

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("swap")
    base = msrt_base(root, seed=9)
    return {"base": base, "cart": write_cartridge(base, root / "c", [StageSpec("r", 2, 8.0)], seed=5)}


def _outputs(model, seed=0):
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(4)])
    w = torch.softmax(torch.randn(4, 2, generator=g), -1)
    out = StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                 topk_output=StandardTopKOutput(w, ids, torch.zeros(4, 4)))
    return [layer.mlp.experts.quant_method.apply(layer.mlp.experts, out).hidden_states
            for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Recorder:
    """The transaction's SGLang-side steps (prefix-cache flush, graph recapture) as calls to record, failing on
    demand: on the CPU there are no graphs to capture."""

    def __init__(self, fail_recapture_after: int | None = None):
        self.calls, self.fail_after = [], fail_recapture_after

    def flush(self):
        self.calls.append("flush")

    def recapture(self):
        self.calls.append("recapture")
        if self.fail_after is not None and self.calls.count("recapture") > self.fail_after:
            raise RuntimeError("capture failed")


@pytest.fixture
def model(ckpts):
    sglang_runtime()
    return load_as_server(ckpts["base"])[0]


def test_a_swap_stages_commits_flushes_and_recaptures(ckpts, model):
    base = _outputs(model)
    rec = Recorder()
    steps = swap.SwapSteps(CartridgeRuntime(model), rec.flush, rec.recapture)
    assert swap.stage(steps, str(ckpts["cart"])) == 2 and rec.calls == []  # staging touches nothing live
    assert _same(_outputs(model), base)
    updated, ms = swap.activate(steps)
    assert updated == 2 and ms >= 0 and rec.calls == ["flush", "recapture"]
    assert steps.runtime.staged is None  # the private copy is gone
    assert not _same(_outputs(model), base)
    assert swap.deactivate(steps)[0] == 2 and rec.calls[-2:] == ["flush", "recapture"]
    assert _same(_outputs(model), base)


@pytest.mark.parametrize("fault", ["commit", "recapture"])
def test_a_failure_after_the_pause_restores_the_base_exactly(ckpts, model, fault):
    base = _outputs(model)
    rec = Recorder()
    steps = swap.SwapSteps(CartridgeRuntime(model), rec.flush, rec.recapture)
    swap.stage(steps, str(ckpts["cart"]))
    with pytest.raises(swap.CartridgeSwapError, match=f"rolled back to the base: injected fault at {fault}"):
        swap.activate(steps, fault)
    assert _same(_outputs(model), base) and not steps.runtime.status()["active"]
    assert rec.calls[-2:] == ["flush", "recapture"]  # the base's graphs were captured again
    assert steps.runtime.staged is None


def test_a_failure_while_preparing_changes_nothing(ckpts, model):
    base = _outputs(model)
    rec = Recorder()
    steps = swap.SwapSteps(CartridgeRuntime(model), rec.flush, rec.recapture)
    with pytest.raises(swap.CartridgeSwapError, match="not staged: injected fault at prepare"):
        swap.stage(steps, str(ckpts["cart"]), "prepare")
    assert rec.calls == [] and steps.runtime.staged is None and _same(_outputs(model), base)


def test_a_failed_restore_stops_the_server(ckpts, model):
    rec = Recorder(fail_recapture_after=0)
    steps = swap.SwapSteps(CartridgeRuntime(model), rec.flush, rec.recapture)
    swap.stage(steps, str(ckpts["cart"]))
    with pytest.raises(swap.CartridgeRestoreError, match="restoring the base .* failed: capture failed"):
        swap.activate(steps)


def test_tp_ranks_commit_all_or_none(ckpts):
    """Two TP ranks vote after each step; rank 1's recapture fails, so rank 0, which succeeded, restores too."""
    from sglang.srt.runtime_context import get_parallel

    sglang_runtime()
    models = []
    for rank in range(2):
        with get_parallel().override(moe_tp_size=2, moe_tp_rank=rank):
            models.append(load_as_server(ckpts["base"])[0])
    base = [_outputs(m) for m in models]
    votes, barrier = {}, threading.Barrier(2)

    def agree_for(rank):
        def agree(ok):
            votes[rank] = ok
            barrier.wait()
            result = all(votes.values())
            barrier.wait()
            return result
        return agree

    errors = {}

    def run(rank):
        rec = Recorder(fail_recapture_after=0 if rank == 1 else None)
        steps = swap.SwapSteps(CartridgeRuntime(models[rank]), rec.flush, rec.recapture, agree_for(rank))
        try:
            swap.stage(steps, str(ckpts["cart"]))
            swap.activate(steps)
        except Exception as e:
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(errors.get(0), swap.CartridgeSwapError) and "another TP rank failed" in str(errors[0])
    assert isinstance(errors.get(1), swap.CartridgeRestoreError)  # its restore recapture fails too: it stops
    assert _same(_outputs(models[0]), base[0])


def test_resident_slots_switch_in_place(ckpts, monkeypatch):
    monkeypatch.setenv("SGLANG_EXL3_CARTRIDGES", "resident")
    sglang_runtime()
    model = load_as_server(ckpts["base"])[0]
    layers = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    addresses = [[w.data_ptr() for w in layer.exl3_cartridge.weights] for layer in layers]
    base = _outputs(model)
    steps = swap.SwapSteps(CartridgeRuntime(model, mode="resident"), lambda: None, None)
    swap.stage(steps, str(ckpts["cart"]))
    assert swap.activate(steps)[0] == 2
    assert [[w.data_ptr() for w in layer.exl3_cartridge.weights] for layer in layers] == addresses
    assert not _same(_outputs(model), base)
    swap.deactivate(steps)
    assert _same(_outputs(model), base)  # the base decoded back into the slots, bit for bit
    swap.stage(steps, str(ckpts["cart"]))
    with pytest.raises(swap.CartridgeSwapError):
        swap.activate(steps, "commit")  # fails after the first layer was overwritten
    assert _same(_outputs(model), base)


# -- server glue -----------------------------------------------------------------------------------------------------

def test_request_types_travel_through_sglangs_msgpack():
    from sglang.srt.managers import io_struct, tokenizer_control_mixin

    from sglang_exl3.integration import cartridge_server as cs

    cs.register_types()
    req = cs.Exl3CartridgeReqInput(action="stage", adapter_path="/x", inject_fault="commit")
    assert io_struct.msgpack_decode(io_struct.msgpack_encode(req)) == req
    out = cs.Exl3CartridgeReqOutput(success=False, message="m", updated_layers=3, swap_ms=1.5)
    assert io_struct.msgpack_decode(io_struct.msgpack_encode(out)) == out
    assert (cs.COMMUNICATOR, cs.Exl3CartridgeReqOutput) in tokenizer_control_mixin._COMMUNICATOR_SPECS


def test_the_scheduler_hook_adds_the_handler_to_sglangs_dispatcher():
    from types import SimpleNamespace

    from sglang.utils import TypeBasedDispatcher

    from sglang_exl3.integration import cartridge_server as cs

    holder = SimpleNamespace(_request_dispatcher=TypeBasedDispatcher([(int, lambda r: "int")]))
    cs.add_scheduler_handler(None, holder)
    reply = holder._request_dispatcher(cs.Exl3CartridgeReqInput(action="status"))
    assert not reply.success and "SGLANG_EXL3_CARTRIDGES=recapture or resident" in reply.message  # knob off


@pytest.mark.parametrize(("body", "status", "match"), [
    (b"\xff\xfe", 400, "not UTF-8 JSON"),
    (b"{", 400, "not UTF-8 JSON"),
    (b"[1]", 400, "must be a JSON object"),
    (b"{}", 400, "adapter_path"),
    (b'{"adapter_path": 3}', 400, "adapter_path"),
    (b'{"adapter_path": "/c", "inject_fault": 1}', 400, "inject_fault must be a string"),
    (b'{"adapter_path": "/c"}', 501, "no EXL3 cartridge control channel"),
])
def test_load_endpoint_bodies_and_codes(monkeypatch, body, status, match):
    """The endpoints as FastAPI serves them (a fresh app, the routes the plugin adds to SGLang's): the body's parsing
    and the codes; 501 from a tokenizer manager without the plugin's communicator."""
    from types import SimpleNamespace

    import sglang.srt.entrypoints.http_server as http_server
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sglang_exl3.integration import cartridge_server as cs

    monkeypatch.setattr(http_server, "_global_state", SimpleNamespace(tokenizer_manager=SimpleNamespace()))
    app = FastAPI()
    assert cs.add_routes_to(app) and not cs.add_routes_to(app)
    client = TestClient(app)
    response = client.post("/load_exl3_cartridge", content=body)
    assert response.status_code == status
    assert match in response.json()["error"]
    assert client.get("/exl3_cartridge_status").status_code == 501
    assert client.post("/deactivate_exl3_cartridge", content=b"{").status_code == 400
