"""The benchmarks' peer processes (launch, wait for /health, stop) and the identity rule of the peer tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from benchmarks import llama_cpp_peer
from benchmarks.identity import identity_report, top2_margin
from benchmarks.peer_process import PeerNotReady, PeerProcess, free_port

# A stand-in server: /health answers 503 ("loading", as llama-server does) for its first 0.3 s, then 200.
HEALTH_SERVER = """
import http.server, json, sys, time
start = time.monotonic()
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ready = time.monotonic() - start > 0.3
        self.send_response(200 if ready else 503)
        self.end_headers()
        self.wfile.write(json.dumps({"status": "ok" if ready else "loading"}).encode())
    def log_message(self, *args):
        pass
print("listening", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_server_is_ready_once_health_answers_and_stops_on_exit(tmp_path):
    port = free_port()
    peer = PeerProcess(
        "stand-in", [sys.executable, "-c", HEALTH_SERVER, str(port)], port=port, log_path=tmp_path / "s.log"
    )
    with peer as running:
        assert running.url == f"http://127.0.0.1:{port}" and running.process.poll() is None
    assert peer.process.poll() is not None  # stopped
    assert "listening" in (tmp_path / "s.log").read_text()


def test_a_server_that_exits_raises_with_its_log(tmp_path):
    command = [sys.executable, "-c", "print('no model at that path'); raise SystemExit(3)"]
    with pytest.raises(PeerNotReady, match=r"exited with 3: no model at that path"):
        PeerProcess("broken", command, port=free_port(), log_path=tmp_path / "b.log").start()


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    peer = PeerProcess(
        "mute", [sys.executable, "-c", "import time; time.sleep(60)"], port=free_port(), log_path=tmp_path / "m.log"
    )
    with pytest.raises(PeerNotReady, match="did not answer /health within 1 s"):
        peer.start(timeout=1.0)
    assert peer.process.poll() is not None


def test_llama_server_listens_where_it_is_told_else_on_a_free_port():
    given = llama_cpp_peer.LlamaServer(Path("llama-server"), [], work_dir=Path("/tmp"), name="n", port=12345)
    assert given.command[given.command.index("--port") + 1] == "12345" and given.url.endswith(":12345")
    picked = llama_cpp_peer.LlamaServer(Path("llama-server"), [], work_dir=Path("/tmp"), name="n")
    assert picked.port > 0 and picked.log_path == Path("/tmp/n.log")


@torch.inference_mode()
def _margin_of(target, kwargs: dict) -> float:
    best = torch.topk(target.model(**kwargs).logits[0, -1].float(), 2).values
    return float(best[0] - best[1])


def test_the_top2_margin_follows_the_prompt_and_the_prefix(make_target, astronaut):
    target = make_target("qwen2_vl")
    picture = astronaut.resize((56, 56))
    for images in (None, [picture]):  # a text prompt and one with an image: the pixels go into the forward
        x = target.build_inputs(images, "What is this?")
        prefix = [11, 12, 13]
        whole = torch.tensor(x.input_ids[0].tolist() + prefix)
        expected = _margin_of(target, target.sequence_inputs(whole, images).model_kwargs)
        assert top2_margin(target, x, prefix) == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_identity_counts_equal_answers_and_ties_at_the_first_difference(make_target):
    target = make_target("qwen2_vl")
    inputs = [target.build_inputs(None, prompt) for prompt in ("one", "two", "three")]
    reference = [[5, 6, 7], [5, 6, 7], [5, 6]]
    tokens = [[5, 6, 7], [5, 9, 7], [5, 6, 8]]  # the same; differs at 1; longer than the reference (at 2)
    margin_at_1 = top2_margin(target, inputs[1], [5])
    margin = margin_at_1 + 1e-3  # the first difference is a tie; the second one is if its margin is smaller
    report = identity_report(target, inputs, reference, tokens, margin=margin)
    assert report["identical"] == 1 and [d["position"] for d in report["divergences"]] == [1, 2]
    assert report["divergences"][0]["top2_margin"] == pytest.approx(margin_at_1)
    assert report["ties"] == 1 + int(top2_margin(target, inputs[2], [5, 6]) < margin)
    assert identity_report(target, inputs, reference, tokens, margin=0.0)["ties"] == 0
