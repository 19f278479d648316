"""Expert cartridges in a running SGLang server (SGLANG_EXL3_CARTRIDGES=recapture|resident): one typed control
request, the scheduler handler that runs it on every TP rank, the tokenizer-side sequence, and the HTTP endpoints.

The path mirrors `/update_weights_from_disk` (shared/reference/sglang.md §7): the tokenizer manager sends
`Exl3CartridgeReqInput` through a FanOutCommunicator; each scheduler handles it between forward steps
(layers/cartridge_swap.py). A load is two requests:
1. `stage` while serving continues: staging, hashing and folding (nothing live changes; any rank failing discards on
   all);
2. `activate` under the model-update writer lock -- in-flight requests finish, new ones wait -- which commits,
   flushes the prefix cache and recaptures the graphs (recapture mode), or rolls every rank back to the base.
`deactivate` runs drained too. The lock is released whatever happens; a cancellation or a failed drain is re-raised
after the staged copy is discarded, if the activation was never sent.

Endpoints (registered only when the knob is on; unauthenticated, they read server-local paths and change outputs:
expose them only to trusted clients): POST /load_exl3_cartridge {"adapter_path"} and /deactivate_exl3_cartridge ->
200 or 400 {"error"}; GET /exl3_cartridge_status; 501 where the server has no cartridge control channel.
Python: `await load_cartridge(engine.tokenizer_manager, path)`, `deactivate_cartridge`, `cartridge_status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from fastapi import Request
from fastapi.responses import JSONResponse
from sglang.srt.managers.io_struct import BaseReq

from sglang_exl3 import knobs

logger = logging.getLogger(__name__)
COMMUNICATOR = "exl3_cartridge"
ACTIONS = ("stage", "activate", "deactivate", "status", "discard")


class Exl3CartridgeReqInput(BaseReq, kw_only=True):
    action: str
    adapter_path: str = ""
    inject_fault: str = ""


class Exl3CartridgeReqOutput(BaseReq, kw_only=True):
    success: bool
    message: str = ""
    updated_layers: int = 0
    swap_ms: float = 0.0
    status_json: str = ""


class CartridgeRequestError(ValueError):
    """A cartridge request that failed and changed nothing the server serves (HTTP 400)."""


def register_types() -> None:
    """In every process: msgpack must decode the request and reply types, and the tokenizer manager must build a
    communicator for them (its spec list is read when it starts, after the plugins ran)."""
    from sglang.srt.managers import io_struct, tokenizer_control_mixin

    io_struct.hook_custom_types(Exl3CartridgeReqInput, Exl3CartridgeReqOutput)
    specs = tokenizer_control_mixin._COMMUNICATOR_SPECS
    if not any(spec[0] == COMMUNICATOR for spec in specs):
        specs.append((COMMUNICATOR, Exl3CartridgeReqOutput))


# -- scheduler side ------------------------------------------------------------------------------------------------

def add_scheduler_handler(result, scheduler, *args, **kwargs):
    """AFTER `Scheduler.init_request_dispatcher`: route cartridge requests to `handle_request`."""
    from sglang.utils import TypeBasedDispatcher

    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(Exl3CartridgeReqInput, lambda req: handle_request(scheduler, req))])
    return result


def _steps(scheduler):
    steps = getattr(scheduler, "exl3_cartridge_steps", None)
    if steps is not None:
        return steps
    import torch

    from sglang_exl3.layers.cartridge_runtime import CartridgeRuntime
    from sglang_exl3.layers.cartridge_swap import SwapSteps

    mode = knobs.get("CARTRIDGES")
    runner = scheduler.tp_worker.model_runner

    def flush():
        if not scheduler.flush_cache(empty_cache=False):
            raise RuntimeError("the prefix cache could not be flushed: requests were still running after the drain")

    def recapture():
        if getattr(runner, "decode_cuda_graph_runner", None) is not None:
            runner.init_decode_cuda_graph()
        if getattr(runner, "prefill_cuda_graph_runner", None) is not None:
            runner.init_prefill_cuda_graph()

    ranks = torch.distributed.get_world_size(group=scheduler.tp_cpu_group)

    def agree(ok: bool) -> bool:
        if ranks == 1:
            return ok
        votes = [None] * ranks
        torch.distributed.all_gather_object(votes, ok, group=scheduler.tp_cpu_group)
        return all(votes)

    steps = SwapSteps(CartridgeRuntime(runner.model, mode=mode), flush,
                      recapture if mode == "recapture" else None, agree)
    scheduler.exl3_cartridge_steps = steps
    return steps


def handle_request(scheduler, req: Exl3CartridgeReqInput) -> Exl3CartridgeReqOutput:
    """One cartridge request on one rank. A failed swap answers success=False with the base served;
    CartridgeRestoreError (the base could not be restored) is not caught: the scheduler stops."""
    from sglang_exl3.format.cartridge_manifest import CartridgeError
    from sglang_exl3.layers import cartridge_swap as swap

    fault = req.inject_fault or None
    try:
        if knobs.get("CARTRIDGES") == "off":
            raise CartridgeError("expert cartridges are off; start the server with SGLANG_EXL3_CARTRIDGES=recapture "
                                 "or resident")
        if fault is not None and (not knobs.get("TEST_CARTRIDGE_FAULTS") or fault not in swap.FAULT_POINTS):
            raise CartridgeError(f"inject_fault {fault!r} needs SGLANG_EXL3_TEST_CARTRIDGE_FAULTS=1 and one of "
                                 f"{swap.FAULT_POINTS}")
        steps = _steps(scheduler)
        if req.action == "stage":
            return Exl3CartridgeReqOutput(success=True, updated_layers=swap.stage(steps, req.adapter_path, fault))
        if req.action == "activate":
            updated, ms = swap.activate(steps, fault)
            return Exl3CartridgeReqOutput(success=True, updated_layers=updated, swap_ms=ms)
        if req.action == "deactivate":
            updated, ms = swap.deactivate(steps)
            return Exl3CartridgeReqOutput(success=True, updated_layers=updated, swap_ms=ms)
        if req.action == "discard":
            steps.runtime.discard()
            return Exl3CartridgeReqOutput(success=True)
        if req.action == "status":
            return Exl3CartridgeReqOutput(success=True, status_json=json.dumps(steps.runtime.status()))
        raise CartridgeError(f"unknown cartridge action {req.action!r}; one of {ACTIONS}")
    except swap.CartridgeRestoreError:
        raise
    except (CartridgeError, swap.CartridgeSwapError, TimeoutError, OSError) as e:
        logger.warning("EXL3 cartridge %s failed: %s", req.action, e)
        return Exl3CartridgeReqOutput(success=False, message=str(e))
    except Exception as e:  # a bug must not take the server down with it: the swap steps restore what they change
        logger.exception("EXL3 cartridge %s failed unexpectedly", req.action)
        return Exl3CartridgeReqOutput(success=False, message=f"{type(e).__name__}: {e}")


# -- tokenizer side ------------------------------------------------------------------------------------------------

async def _call(tm, action: str, **fields) -> list[Exl3CartridgeReqOutput]:
    communicator = getattr(tm, f"{COMMUNICATOR}_communicator", None)
    if communicator is None:
        raise NotImplementedError("this server has no EXL3 cartridge control channel (the plugin's communicator is "
                                  "registered only in SGLang's Python HTTP server and Engine)")
    tm.auto_create_handle_loop()
    results = await communicator(Exl3CartridgeReqInput(action=action, **fields))
    failed = [r.message for r in results if not r.success]
    if failed:
        raise CartridgeRequestError("; ".join(dict.fromkeys(failed)))
    return results


DRAIN_IDLE_TIMEOUT_S = 60.0


@contextlib.asynccontextmanager
async def _drained(tm):
    """In-flight requests finish and new ones wait (the model-update writer lock), unless generation is paused; then
    SGLang's own flush, which waits until the scheduler is idle (its last batch retired), so that the swap's flush of
    the prefix cache on every rank finds nothing running."""
    async with tm.is_pause_cond:
        paused = tm.is_pause
    async with (contextlib.nullcontext() if paused else tm.model_update_lock.writer_lock):
        idle = await tm.flush_cache(timeout_s=DRAIN_IDLE_TIMEOUT_S)
        if not idle.success:
            raise CartridgeRequestError(f"the server did not become idle within {DRAIN_IDLE_TIMEOUT_S:.0f} s of the "
                                        f"drain ({idle.message}); nothing was swapped")
        yield


async def load_cartridge(tm, adapter_path: str, inject_fault: str = "") -> dict:
    staged = await _call(tm, "stage", adapter_path=adapter_path, inject_fault=inject_fault)
    activated, in_flight = False, len(getattr(tm, "rid_to_state", ()))  # requests the drain waits for
    try:
        t0 = time.perf_counter()
        async with _drained(tm):
            t1 = time.perf_counter()
            activated = True
            results = await _call(tm, "activate", inject_fault=inject_fault)
            t2 = time.perf_counter()
    except BaseException:  # cancelled, or the drain failed: the ranks still hold the staged copy unless activated
        if not activated:
            _background(_call(tm, "discard"))
        raise
    return {"status": "loaded", "updated_layers": [r.updated_layers for r in results],
            "staged_layers": [r.updated_layers for r in staged], "swap_ms": [r.swap_ms for r in results],
            "drain_ms": (t1 - t0) * 1e3, "pause_ms": (t2 - t1) * 1e3, "in_flight": in_flight}


async def deactivate_cartridge(tm) -> dict:
    """Back to the base, drained; with no cartridge active on any rank, nothing to do: no pause."""
    if not any((await cartridge_status(tm))["active"]):
        return {"status": "deactivated", "updated_layers": [0], "swap_ms": [0.0], "drain_ms": 0.0, "pause_ms": 0.0,
                "in_flight": 0}
    in_flight, t0 = len(getattr(tm, "rid_to_state", ())), time.perf_counter()
    async with _drained(tm):
        t1 = time.perf_counter()
        results = await _call(tm, "deactivate")
        t2 = time.perf_counter()
    return {"status": "deactivated", "updated_layers": [r.updated_layers for r in results],
            "swap_ms": [r.swap_ms for r in results], "drain_ms": (t1 - t0) * 1e3, "pause_ms": (t2 - t1) * 1e3,
            "in_flight": in_flight}


async def cartridge_status(tm) -> dict:
    states = [json.loads(r.status_json) for r in await _call(tm, "status")]
    return {"active": [s["active"] for s in states], "ranks": states}


_PENDING: set[asyncio.Task] = set()


def _background(coro) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _PENDING.add(task)
    task.add_done_callback(_PENDING.discard)


# -- HTTP ----------------------------------------------------------------------------------------------------------

async def _body(request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CartridgeRequestError(f"the request body is not UTF-8 JSON ({e})") from None
    if not isinstance(body, dict):
        raise CartridgeRequestError("the request body must be a JSON object")
    return body


def _respond(fn):
    async def endpoint(request: Request) -> JSONResponse:
        from sglang.srt.entrypoints.http_server import get_global_state

        try:
            return JSONResponse(await fn(get_global_state().tokenizer_manager, request))
        except CartridgeRequestError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        except NotImplementedError as e:
            return JSONResponse({"error": str(e)}, status_code=501)
    return endpoint


async def _load(tm, request) -> dict:
    body = await _body(request)
    path, fault = body.get("adapter_path"), body.get("inject_fault", "")
    if not isinstance(path, str) or not path:
        raise CartridgeRequestError('the body must be {"adapter_path": "<cartridge directory or shard>"}')
    if not isinstance(fault, str):
        raise CartridgeRequestError("inject_fault must be a string")
    return await load_cartridge(tm, path, fault)


async def _deactivate(tm, request) -> dict:
    await _body(request)
    return await deactivate_cartridge(tm)


async def _status(tm, request) -> dict:
    return await cartridge_status(tm)


def add_routes(*args, **kwargs):
    """BEFORE `_setup_and_run_http_server`, in the launcher's process: the endpoints, when the knob is on."""
    if knobs.get("CARTRIDGES") == "off":
        return None
    from sglang.srt.entrypoints.http_server import app

    if add_routes_to(app):
        logger.warning("EXL3 cartridge endpoints are on (SGLANG_EXL3_CARTRIDGES=%s): they are unauthenticated, read "
                       "server-local paths and change every output; expose this server only to trusted clients",
                       knobs.get("CARTRIDGES"))
    return None


def add_routes_to(app) -> bool:
    """The three endpoints on a FastAPI app (once); True if they were added."""
    if any(getattr(r, "path", None) == "/load_exl3_cartridge" for r in app.routes):
        return False
    app.add_api_route("/load_exl3_cartridge", _respond(_load), methods=["POST"])
    app.add_api_route("/deactivate_exl3_cartridge", _respond(_deactivate), methods=["POST"])
    app.add_api_route("/exl3_cartridge_status", _respond(_status), methods=["GET"])
    return True
