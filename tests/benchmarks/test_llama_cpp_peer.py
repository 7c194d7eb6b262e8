"""llama.cpp as a peer: the streamed client against a fake server, the concurrency and serving arguments, and
the image prompt that llama.cpp's multimodal path gets. (The real server runs in the slow tests.)"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import concurrency, image_peers, llama_cpp_peer, serving

MT_BENCH_MINI = Path(__file__).parents[1] / "fixtures" / "mt-bench-mini.jsonl"
CHUNKS = [
    {"content": "He", "tokens": [7], "stop": False},
    {"content": "llo", "tokens": [8, 9], "stop": False},
    {"content": "", "tokens": [], "stop": True, "timings": {"prompt_n": 3, "predicted_n": 3}},
]


class _FakeServer(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in CHUNKS:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    httpd.bodies = []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


def test_a_streamed_answer_collects_tokens_timings_and_the_first_tokens_time(fake_server, tmp_path):
    client = llama_cpp_peer.LlamaServer(Path("llama-server"), [], work_dir=tmp_path, name="fake")
    client.url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    answer = client.stream([1, 2, 3], 8)
    assert answer["tokens"] == [7, 8, 9] and answer["timings"]["predicted_n"] == 3
    assert 0 < answer["ttft_s"] <= answer["wall_s"]
    sent = fake_server.bodies[0]
    assert sent["stream"] is True and sent["prompt"] == [1, 2, 3] and sent["n_predict"] == 8


def test_the_server_command_names_its_slots():
    client = llama_cpp_peer.LlamaServer(Path("llama-server"), ["-m", "x"], work_dir=Path("/tmp"), name="n", parallel=16)
    at = client.command.index("-np")
    assert client.command[at + 1] == "16" and "--metrics" in client.command


def test_the_llama_cpp_variants_run_greedy_text_on_the_reference_target():
    args = concurrency.parse_args(["--variants", "alone,llama-cpp", "--workload", "text", "--modes", "greedy"])
    assert args.variant_list == ["alone", "llama-cpp"]
    with pytest.raises(SystemExit):
        concurrency.parse_args(["--variants", "alone,llama-cpp"])  # mixed workload, sampled mode
    args = serving.parse_args(["--variants", "alone,llama-cpp", "--workload", "text", "--concurrency", "16"])
    assert args.variant_list == ["alone", "llama-cpp"] and args.levels == [16]
    with pytest.raises(SystemExit):
        serving.parse_args(["--variants", "llama-cpp"])  # images in the mixed workload


def test_a_missing_llama_cpp_is_refused_with_the_build_command(tmp_path):
    with pytest.raises(ValueError, match="build_llama_cpp.sh"):
        llama_cpp_peer.locate_llama_cpp(tmp_path)


def test_an_image_prompt_replaces_the_image_and_its_markers_with_the_media_marker():
    pad, begin, end = 99, 97, 98  # mtmd writes <|vision_start|> and <|vision_end|> around the image itself
    special = {"<|vision_start|>": begin, "<|vision_end|>": end}
    tokenizer = SimpleNamespace(
        decode=lambda ids, skip_special_tokens=False: "".join(f"<{i}>" for i in ids),
        convert_tokens_to_ids=special.get,
    )
    target = SimpleNamespace(tokenizer=tokenizer, model=SimpleNamespace(config=SimpleNamespace(image_token_id=pad)))
    x = SimpleNamespace(input_ids=torch.tensor([[1, 2, begin, pad, pad, pad, end, 3, 4]]))
    assert image_peers.multimodal_prompt(target, x, "<M>") == "<1><2><M><3><4>"
    x = SimpleNamespace(input_ids=torch.tensor([[pad, pad, 5]]))  # no markers around it: only the pads go
    assert image_peers.multimodal_prompt(target, x, "<M>") == "<M><5>"


@pytest.mark.slow
def test_llama_server_with_slots_answers_concurrent_requests_like_batch_engine(tmp_path):
    root = Path(os.environ.get("LLAMA_CPP_DIR") or llama_cpp_peer.DEFAULT_LLAMA_CPP)
    if not any((root / d / "llama-server").is_file() for d in ("build/bin", "src/build/bin", "bin")):
        pytest.skip(
            f"no llama-server under {root}: build llama.cpp with `bash scripts/build_llama_cpp.sh` (docs/llama-cpp.md)"
        )
    argv = ["--variants", "alone,llama-cpp", "--workload", "text", "--modes", "greedy", "--concurrency", "2"]
    argv += ["--max-new-tokens", "6", "--prompt-set", str(MT_BENCH_MINI), "--out", str(tmp_path)]
    assert concurrency.main(argv) == 0
    cells = {c["variant"]: c for c in json.loads((tmp_path / "concurrency.json").read_text())["cells"]}
    peer = cells["llama-cpp"]
    assert peer["identical"] and peer["new_tokens"] == 12 and peer["ttft_p50_s"] > 0  # float32: the same tokens
