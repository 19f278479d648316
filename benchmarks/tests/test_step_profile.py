"""benchmarks/step_profile.py: kernel names land in the intended categories (ours before cuBLAS's, whose names also
contain "gemm"), and a trace in the torch profiler's format sums to microseconds per step."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.step_profile import category, kernel_events, short_name, top_kernels, trace_breakdown


@pytest.mark.parametrize("kernel, want", [
    ("void (anonymous namespace)::gemm_ring_kernel<8, 2, 8, 8, 1>(__half const*, unsigned int const*, float*, int)",
     "exl3 GEMM"),
    ("void (anonymous namespace)::gemm_group_xs_kernel<8, 2, 1, 4>(__half const*, GroupSource const*)", "exl3 GEMM"),
    # the one-launch linear (rotations inside) and the wgmma ring: both once missed, filed as "other" / "dense GEMM"
    ("void (anonymous namespace)::linear_decode_kernel<8, 2, 1, 8, __nv_bfloat16>(__nv_bfloat16 const*, GroupSource "
     "const*, int, float*, int*, __nv_bfloat16*, int, int, int, int)", "exl3 GEMM"),
    ("void (anonymous namespace)::gemm_wg_kernel<8, 1, 2, 1>(__half const*, unsigned int const*, float*, int)",
     "exl3 GEMM"),
    ("void (anonymous namespace)::had_out_group_kernel<__nv_bfloat16>(float const*, GroupSource const*)",
     "exl3 rotations"),
    ("nvjet_hsh_128x64_64x4_1x2_h_bz_coopA_NTN", "dense GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "dense GEMM"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", "attention"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>", "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda>", "elementwise"
     " (casts, adds, copies)"),
    ("void some_unknown_kernel<1>()", "other"),
])
def test_kernel_categories(kernel, want):
    assert category(kernel) == want


def test_trace_breakdown_sums_per_step(tmp_path):
    events = [{"cat": "kernel", "name": "gemm_ring_kernel<8, 1, 8, 8, 1>", "ts": 100.0, "dur": 30.0},
              {"cat": "kernel", "name": "had_in_kernel<__nv_bfloat16>", "ts": 131.0, "dur": 2.0},
              {"cat": "kernel", "name": "nvjet_hsh_64x8", "ts": 140.0, "dur": 10.0},
              {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 90.0, "dur": 5.0},  # host side: not counted
              {"cat": "kernel", "name": "gemm_ring_kernel<8, 1, 8, 8, 1>", "ts": 200.0, "dur": 30.0},
              {"cat": "kernel", "name": "had_in_kernel<__nv_bfloat16>", "ts": 240.0, "dur": 2.0}]
    trace = tmp_path / "x-TP-0.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = trace_breakdown(kernel_events(trace), steps=2)
    assert got["exl3 GEMM"] == 30.0 and got["exl3 rotations"] == 2.0 and got["dense GEMM"] == 5.0
    assert got["kernels_total"] == 37.0 and got["span_us"] == 71.0 and got["kernel_count"] == 2.5
    assert list(got)[0] == "exl3 GEMM"  # largest first
    empty = tmp_path / "empty.trace.json"
    empty.write_text(json.dumps({"traceEvents": events[3:4]}))
    with pytest.raises(ValueError, match="no GPU kernel events"):
        kernel_events(empty)


def test_top_kernels_name_the_variants_with_launches_and_time_per_launch(tmp_path):
    sig = "(float const*, GroupSource const*, int)"
    events = [{"cat": "kernel", "name": f"void (anonymous namespace)::had_out_group_kernel<__half>{sig}",
               "ts": 0.0, "dur": 6.0},
              {"cat": "kernel", "name": f"void (anonymous namespace)::had_out_group_kernel<__nv_bfloat16>{sig}",
               "ts": 10.0, "dur": 3.0},
              {"cat": "kernel", "name": f"void (anonymous namespace)::had_out_group_kernel<__half>{sig}",
               "ts": 20.0, "dur": 2.0},
              {"cat": "kernel", "name": "nvjet_hsh_64x8", "ts": 30.0, "dur": 1.0}]
    trace = tmp_path / "x.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = top_kernels(kernel_events(trace), steps=2, top=2)
    assert [k["kernel"] for k in got] == ["had_out_group_kernel<__half>", "had_out_group_kernel<__nv_bfloat16>"]
    assert got[0] == {"kernel": "had_out_group_kernel<__half>", "category": "exl3 rotations", "us_per_step": 4.0,
                      "launches_per_step": 1.0, "us_per_launch": 4.0}
    assert short_name("void flashinfer::norm::RMSNormKernel<8u, float>(float*, int)") == \
        "flashinfer::norm::RMSNormKernel<8u, float>"
    assert short_name("nvjet_hsh_64x8") == "nvjet_hsh_64x8"


def test_e2e_files_categories_and_top_kernels_apart():
    from benchmarks.e2e import kernel_rows, profile_rows
    kernel = {"kernel": "had_in_kernel<__half>", "category": "exl3 rotations", "us_per_step": 4.123,
              "launches_per_step": 2.0, "us_per_launch": 2.0615}
    rows = [{"model": "exl3-4bpw", "profile": {64: {"exl3 rotations": 4.123}}, "profile_kernels": {64: [kernel]}}]
    assert profile_rows(rows) == [{"model": "exl3-4bpw", "batch": 64, "category": "exl3 rotations",
                                   "us_per_step": 4.12}]
    assert kernel_rows(rows) == [{"model": "exl3-4bpw", "batch": 64, "kernel": "had_in_kernel<__half>",
                                  "category": "exl3 rotations", "us_per_step": 4.12, "launches_per_step": 2.0,
                                  "us_per_launch": 2.06}]


def test_e2e_merge_joins_calls_of_one_shape(tmp_path, monkeypatch):
    """The EXL3 server and its twin measured in two calls (--skip-bf16, then --twin-only) become one table with
    both rows and every serving column, and the profiles of the rows that have them; runs of another shape or GPU
    are refused."""
    import json

    import pytest

    from benchmarks import common, e2e

    out = tmp_path / "results"
    monkeypatch.setattr(common, "RESULTS", out)
    head = {"command": "e2e.py --skip-bf16", "gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
            "shape": "llama3-8b (random trellis)"}
    exl3 = {"model": "exl3-4bpw", "decode_bs1_tok_s": 239.2, "serving_c1_out_tok_s": 226.9,
            "profile": {1: {"exl3 GEMM": 3385.5}}, "profile_kernels": {1: []}}
    twin = {"model": "bf16", "decode_bs1_tok_s": 199.5, "serving_c1_out_tok_s": 190.1, "serving_c1_itl_ms": 5.2}
    runs = []
    for i, (cmd, row) in enumerate((("--skip-bf16", exl3), ("--twin-only", twin))):
        runs.append(tmp_path / f"run{i}.json")
        runs[-1].write_text(json.dumps({"header": dict(head, command=f"e2e.py {cmd}"), "rows": [row]}))
    assert e2e.merge(runs) == 0
    merged = json.loads((out / "e2e-h200.json").read_text())
    assert [r["model"] for r in merged["rows"]] == ["exl3-4bpw", "bf16"]
    assert merged["header"]["command"] == "e2e.py --skip-bf16 ; e2e.py --twin-only"
    table = (out / "e2e-h200.md").read_text()
    assert "serving_c1_out_tok_s | serving_c1_itl_ms |" in table and "| bf16 |" in table
    assert "3385.50" in (out / "e2e-profile-h200.md").read_text()
    runs[1].write_text(json.dumps({"header": dict(head, shape="qwen3-30b-a3b (random trellis)"), "rows": [twin]}))
    with pytest.raises(SystemExit, match="one shape"):
        e2e.merge(runs)


def test_e2e_prompts_stay_inside_the_vocabulary():
    from benchmarks.e2e import prompt_ids
    small = prompt_ids(64, 2048, 101, 7, vocab=8192)  # the spec-target shape
    assert len(small) == 64 and {len(p) for p in small} == {2048}
    assert min(map(min, small)) >= 100 and max(map(max, small)) < 8192
    assert max(map(max, prompt_ids(64, 32, 37, 11, vocab=128256))) < 120100


def test_e2e_variant_splits_environment_from_server_flags():
    """A --variant's VAR=VALUE items go to the server's environment, its --flag=VALUE items to its command line, and a
    malformed item stops the run naming it."""
    from benchmarks.e2e import variant_settings

    env, flags = variant_settings("SGLANG_EXL3_DEV_PDL=0,--max-total-tokens=424000")
    assert env == {"SGLANG_EXL3_DEV_PDL": "0"} and flags == ["--max-total-tokens", "424000"]
    assert variant_settings("A=1,B=x=y") == ({"A": "1", "B": "x=y"}, [])
    with pytest.raises(SystemExit, match="'SGLANG_EXL3_DEV_PDL'"):
        variant_settings("SGLANG_EXL3_DEV_PDL")


def test_streamed_tokens_reads_sglangs_stream_lines():
    """Lines as SGLang's /generate streams them (its own serializer, `data: ` framing, the [DONE] end): the completion
    tokens so far, nothing for separators and the end, and an error inside the stream raised."""
    from sglang.srt.utils.json_response import dumps_json

    from benchmarks.step_profile import streamed_tokens

    chunk = {"text": " the", "output_ids": [11, 12, 13], "meta_info": {"id": "a", "completion_tokens": 3,
                                                                          "prompt_tokens": 32}}
    assert streamed_tokens(b"data: " + dumps_json(chunk) + b"\n\n") == 3
    assert streamed_tokens(b"\n") is None and streamed_tokens(b"data: [DONE]\n\n") is None
    error = {"error": {"message": "bad input", "type": "invalid_request_error", "code": 400, "retryable": False}}
    with pytest.raises(RuntimeError, match="bad input"):
        streamed_tokens(b"data: " + dumps_json(error) + b"\n\n")


def test_stream_generate_signals_the_lead_while_the_stream_goes_on():
    """A local endpoint streaming in SGLang's framing (chunked transfer, one `data:` line per step, then [DONE]): the
    lead event is set at the lead token while the request still runs, and the call returns the final count. (SGLang's
    server itself needs a GPU.)"""
    import http.server
    import threading

    from sglang.srt.utils.json_response import dumps_json

    from benchmarks.step_profile import stream_generate

    release = threading.Event()

    class Streaming(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["stream"] is True and body["input_ids"] == [1, 2, 3]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for n in range(1, 7):
                if n == 4:
                    release.wait(10)  # the client must have seen the lead before the stream goes on
                line = b"data: " + dumps_json({"meta_info": {"completion_tokens": n}}) + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            done = b"data: [DONE]\n\n"
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Streaming)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reached, result = threading.Event(), {}
        base = f"http://127.0.0.1:{server.server_address[1]}"
        worker = threading.Thread(target=lambda: result.update(n=stream_generate(base, {"input_ids": [1, 2, 3]}, 3,
                                                                                 reached)))
        worker.start()
        assert reached.wait(10) and "n" not in result  # at the lead, mid-stream
        release.set()
        worker.join(10)
        assert result["n"] == 6
    finally:
        release.set()
        server.shutdown()
