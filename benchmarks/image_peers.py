"""Image questions at batch 1: time to first token and tok/s, vlmspec against transformers and llama.cpp's mtmd.

``python -m benchmarks.vs_peers --images N`` runs this: N open questions about scikit-image
photographs (none of them a picture the drafter trained on), greedy, ``--max-new-tokens``:

* transformers ``generate()`` (the time of its first token through a streamer);
* vlmspec's target alone and vlmspec's defaults (``SpecEngine.stream``: the first text);
* llama.cpp's multimodal path: the reference target's whole folder converted by llama.cpp's own
  ``convert_hf_to_gguf.py`` (its qwen2vl graph, M-RoPE) and its vision tower with ``--mmproj``,
  served by ``llama-server --mmproj``. The prompt is vlmspec's own chat-template text with the
  image (``<|vision_start|>``, its pad tokens, ``<|vision_end|>``, which mtmd writes itself)
  replaced by the server's media marker, and the picture at the size vlmspec's
  processor gave it, so both engines see the same pixels and text. Where a step fails (conversion,
  loading, a request), the row is reported as not run, with llama.cpp's own error.

Every timing starts before the inputs are processed (the picture's PNG encoding for llama.cpp).
Identity is against vlmspec's target alone, with the tie rule of ``benchmarks/identity.py``; the
prompt lengths in tokens are reported per engine (llama.cpp counts the image's tokens itself).
"""

from __future__ import annotations

import base64
import io
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import llama_cpp_peer
from benchmarks.common import markdown_table, peer_logs_dir, prepare_out_dir, run_order, write_json, write_text
from benchmarks.identity import identity_report
from benchmarks.spec.workloads import skimage_open_tasks

ALONE = "vlmspec target alone (fast runner)"
LLAMA = "llama.cpp multimodal (qwen2vl GGUF + mmproj)"


def run_images(args) -> Path:
    from vlmspec import SpecEngine
    from vlmspec.loading import load_proposer, load_target
    from vlmspec.reference import machine_sps_table, reference_drafter_dir
    from vlmspec.scheduling.factory import build_scheduler

    out = prepare_out_dir(args.out)
    tasks = skimage_open_tasks(args.images, max_side=args.image_max_side)
    target = load_target("reference", dtype=args.dtype)
    scheduler = build_scheduler("sps", sps=machine_sps_table(target), calibration=reference_drafter_dir("reference"))
    engine = SpecEngine(target, load_proposer("reference", target), scheduler)
    inputs = [target.build_inputs(list(t.images), t.prompt) for t in tasks]

    def hf(i: int) -> dict:
        streamer = FirstToken()
        tick = time.perf_counter()
        x = target.build_inputs(list(tasks[i].images), tasks[i].prompt)
        tokens = target.generate_greedy(x, args.max_new_tokens, streamer=streamer)
        return {"tokens": tokens, "wall_s": time.perf_counter() - tick, "ttft_s": (streamer.first or tick) - tick}

    def vlmspec(speculative: bool):
        def run(i: int) -> dict:
            tick, first = time.perf_counter(), None
            stream = engine.stream(
                list(tasks[i].images), tasks[i].prompt, max_new_tokens=args.max_new_tokens, speculative=speculative
            )
            for _ in stream:
                first = first or time.perf_counter()
            done = time.perf_counter()
            return {"tokens": list(stream.result.token_ids), "wall_s": done - tick, "ttft_s": (first or done) - tick}

        return run

    variants = {
        "transformers generate()": hf,
        ALONE: vlmspec(False),
        "vlmspec defaults: n-gram + corpus + DSpark, drafting policy, SPS": vlmspec(True),
    }
    skipped: dict[str, str] = {}
    server = None if args.no_llama_cpp else start_multimodal_server(args, out, skipped)
    if server is not None:
        variants[LLAMA] = llama_image_run(server, target, tasks, inputs, args.max_new_tokens, skipped)
    results: dict[str, dict[str, list]] = {name: {"tokens": [], "wall_s": [], "ttft_s": []} for name in variants}
    try:
        for name, run in list(variants.items()):  # warm-up; a peer that fails here is left out, with its error
            try:
                run(0)
            except Exception as err:  # noqa: BLE001
                if name != LLAMA:
                    raise
                skipped[name] = f"request failed: {err!r}"[:300]
                del variants[name], results[name]
        for i in range(len(tasks)):
            for name in run_order(list(variants), i):
                try:
                    answer = variants[name](i)
                except Exception as err:  # noqa: BLE001 - a peer's failure is reported, the others go on
                    skipped.setdefault(name, f"request failed: {err!r}"[:300])
                    continue
                for key in ("tokens", "wall_s", "ttft_s"):
                    results[name][key].append(answer[key])
                if "prompt_n" in answer:
                    results[name].setdefault("prompt_tokens", []).append(answer["prompt_n"])
            print(f"[vs-peers images] question {i + 1}/{len(tasks)} done", flush=True)
    finally:
        if server is not None:
            server.stop()
    lengths = [x.length for x in inputs]
    text = report(target, inputs, results, skipped, lengths, args)
    print(text)
    write_text(out / "images.md", text)
    write_json(
        out / "images.json", {"args": vars(args), "skipped": skipped, "results": results, "prompt_tokens": lengths}
    )
    return out


class FirstToken:
    """A ``generate()`` streamer that notes when the first new token arrives (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


# ---------------------------------------------------------------------------------- llama.cpp
def start_multimodal_server(args, out: Path, skipped: dict[str, str]):
    """``llama-server --mmproj`` on the reference target's own conversion, or None with the reason in ``skipped``."""
    try:
        llama_cpp = llama_cpp_peer.locate_llama_cpp(args.llama_cpp)
        text, mmproj = llama_cpp_peer.reference_multimodal_ggufs(args.dtype, llama_cpp)
        server_args = llama_cpp_peer.server_args(text, args.threads, extra=("--mmproj", str(mmproj)))
        binary = llama_cpp.binary("llama-server")
        return llama_cpp_peer.LlamaServer(
            binary, server_args, work_dir=peer_logs_dir(out, "llama-cpp"), name="mtmd"
        ).start()
    except (ValueError, RuntimeError, OSError) as err:
        skipped[LLAMA] = " ".join(str(err).split())[:600]
        print(f"[vs-peers images] {LLAMA} not run: {skipped[LLAMA]}", flush=True)
        return None


def llama_image_run(server, target, tasks, inputs, max_new_tokens: int, skipped: dict[str, str]):
    """A run function: vlmspec's prompt text with the image tokens replaced by the media marker, the same pixels."""
    marker = server.props().get("media_marker", "<__media__>")
    prompts = [multimodal_prompt(target, x, marker) for x in inputs]

    def run(i: int) -> dict:
        tick = time.perf_counter()
        sizes = _pixel_sizes(target, inputs[i])
        pictures = [png_base64(image, size) for image, size in zip(tasks[i].images, sizes)]
        sent = time.perf_counter()
        answer = server.stream({"prompt": {"prompt_string": prompts[i], "multimodal_data": pictures}}, max_new_tokens)
        answer["ttft_s"] += sent - tick
        answer["wall_s"] = time.perf_counter() - tick
        answer["prompt_n"] = answer["timings"].get("prompt_n")
        return answer

    return run


def multimodal_prompt(target, x, marker: str) -> str:
    """The prompt's text with each image (``<|vision_start|>``, its pad tokens, ``<|vision_end|>``) replaced by
    ``marker``: llama.cpp's mtmd writes those two tokens around a Qwen-VL image itself."""
    ids = x.input_ids[0].tolist()
    pad = target.model.config.image_token_id
    begin, finish = (target.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    pieces, text_start, i = [], 0, 0
    while i < len(ids):
        if ids[i] != pad:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == pad:
            j += 1
        cut, resume = i - int(i > 0 and ids[i - 1] == begin), j + int(j < len(ids) and ids[j] == finish)
        pieces += [target.tokenizer.decode(ids[text_start:cut], skip_special_tokens=False), marker]
        text_start = i = resume
    pieces.append(target.tokenizer.decode(ids[text_start:], skip_special_tokens=False))
    return "".join(pieces)


def _pixel_sizes(target, x) -> list[tuple[int, int] | None]:
    """Each image's (height, width) after vlmspec's processor (grid x patch size), to send llama.cpp those pixels."""
    grid = x.model_kwargs.get("image_grid_thw")
    if grid is None:
        return [None] * x.num_images
    patch = target.model.config.vision_config.patch_size
    return [(int(h) * patch, int(w) * patch) for _, h, w in grid.tolist()]


def png_base64(image, size: tuple[int, int] | None) -> str:
    if size is not None and (image.height, image.width) != size:
        image = image.resize((size[1], size[0]))
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


# ---------------------------------------------------------------------------------- report
def report(target, inputs, results: dict, skipped: dict[str, str], lengths: list[int], args) -> str:
    rows = []
    alone = results[ALONE]["tokens"]
    for name, r in results.items():
        if not r["tokens"]:
            continue
        picked = list(range(len(r["tokens"])))
        same = identity_report(
            target, [inputs[i] for i in picked], [alone[i] for i in picked], r["tokens"], args.tie_margin
        )
        prompt = r.get("prompt_tokens") or lengths
        rows.append(
            [
                name,
                sum(len(t) for t in r["tokens"]) / sum(r["wall_s"]),
                statistics.median(r["ttft_s"]),
                statistics.median(prompt),
                f"{same['identical']}/{len(picked)} (+{same['ties']})",
                "; ".join(f"at {d['position']}, margin {d['top2_margin']:.3g}" for d in same["divergences"]) or "-",
            ]
        )
        r["identity_to_target_alone"] = same
    headers = [
        "engine",
        "tok/s",
        "TTFT median s",
        "prompt tokens (median)",
        "= target alone (+ ties)",
        "first differences",
    ]
    notes = "".join(f"\n- {peer}: not run: {why}" for peer, why in skipped.items())
    return (
        f"reference target, {args.dtype}, {len(inputs)} image questions (scikit-image photographs, longest side "
        f"{args.image_max_side}), {args.max_new_tokens} new tokens, batch 1, greedy; tok/s and TTFT from the "
        f"request (input processing included){notes}\n\n{markdown_table(headers, rows)}\n"
    )
