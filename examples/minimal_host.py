"""A minimal host engine around vlmspec's step API, in the shape of nano-vllm (add_request / step / is_finished).

The host owns the queue, the batching policy and the KV memory; vlmspec owns drafting,
scheduling and acceptance. Here the host's "model runner" keeps one transformers cache
per sequence and runs each sequence's verification forward on its own (a real host runs
one batched forward over its paged KV; vlmspec's BatchEngine does it with a ragged batch).
The step itself is the same four calls for any host:

    drafts = decoder.propose(requests)          # one drafter call for every running sequence
    plan = decoder.plan(requests, drafts, room) # the scheduler picks each sequence's verified drafts
    logits, features = <the host's forward over plan.input_ids>
    accepted = decoder.accept(requests, plan, logits, features); <roll back to accepted.keep>

Run:  python examples/minimal_host.py   (a tiny random Qwen2-VL; checks the outputs against the target alone)
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

from vlmspec import SpecEngine, load_target
from vlmspec.drafters import PromptLookup
from vlmspec.serving import SpecDecoder, SpecRequest
from vlmspec.targets.adapter import RequestState, prefill_output


@dataclass
class Sequence:
    """The host's view of a request: vlmspec's SpecRequest plus the host's own KV state."""

    seq_id: int
    request: SpecRequest
    inputs: object  # the processor's inputs until the prefill
    kv: RequestState | None = None  # this host keeps a transformers cache per sequence


class MiniEngine:
    def __init__(self, target, proposer=None, scheduler=None, max_running: int = 4) -> None:
        self.target = target
        self.decoder = SpecDecoder(proposer, scheduler, vocab_size=target.vocab_size)
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: dict[int, Sequence] = {}
        self._ids = itertools.count()

    def add_request(self, prompt: str, images=None, **sampling) -> int:
        request = self.decoder.new_request(
            eos_token_ids=self.target.eos_token_ids,
            tokenizer=self.target.tokenizer,
            device=self.target.device,
            **sampling,
        )
        seq = Sequence(next(self._ids), request, self.target.build_inputs(images, prompt))
        self.waiting.append(seq)
        return seq.seq_id

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> None:
        self._schedule_prefills()
        if self.running:
            self._decode_step()
        for seq in [s for s in self.running if s.request.finished]:
            self.running.remove(seq)
            self.finished[seq.seq_id] = seq

    def _schedule_prefills(self) -> None:
        layers, rule = self.decoder.proposer.feature_layers, self.decoder.proposer.position_rule
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            seq.kv, step = self.target.prefill(seq.inputs, feature_layers=layers, position_rule=rule)
            self.decoder.start(
                seq.request, prefill_output(seq.inputs, step, seq.kv.rope_delta)
            )  # draws the first token
            if seq.request.finished:  # max_new_tokens=1 or an immediate EOS
                self.finished[seq.seq_id] = seq
            else:
                self.running.append(seq)

    def _decode_step(self) -> None:
        requests = [seq.request for seq in self.running]
        room = [self.target.max_context - seq.kv.length - 1 for seq in self.running]  # the KV space left
        plan = self.decoder.plan(requests, self.decoder.propose(requests), room)
        logits, features = self._run_model(plan)
        accepted = self.decoder.accept(requests, plan, logits, features)
        for seq, keep in zip(self.running, accepted.keep.tolist()):
            self.target.rollback(seq.kv, keep=keep)  # drop the rejected drafts from this sequence's KV

    def _run_model(self, plan):
        """The host's verification forward: logits [R, 1 + w, V] and features [R, 1 + w, m * d] (or None)."""
        rows = len(self.running)
        width = plan.input_ids.shape[1]
        logits = torch.zeros(rows, width, self.target.vocab_size)
        features = None
        for row, seq in enumerate(self.running):
            n = int(plan.num_inputs[row])
            step = self.target.verify(seq.kv, plan.input_ids[row, :n])
            logits[row, :n] = step.logits
            if step.features is not None:
                features = (
                    features if features is not None else step.features.new_zeros(rows, width, step.features.shape[-1])
                )
                features[row, :n] = step.features
        return logits, features


def main(target=None) -> None:
    target = target or load_target("tiny:qwen2_vl")
    engine = MiniEngine(target, PromptLookup(max_draft_tokens=4), max_running=2)
    prompts = ["Repeat: one two three, one two three, one two three.", "Write a haiku about rain.", "Hi"]
    ids = [engine.add_request(p, max_new_tokens=16) for p in prompts]
    ids.append(engine.add_request("Tell me a story.", max_new_tokens=12, temperature=0.8, seed=3))
    steps = 0
    while not engine.is_finished():
        engine.step()
        steps += 1
    alone = SpecEngine(target)
    for seq_id, prompt in zip(ids, prompts):
        request = engine.finished[seq_id].request
        assert request.tokens == alone.generate(None, prompt, max_new_tokens=16, speculative=False).token_ids
        print(f"{prompt!r}: {len(request.tokens)} tokens, tau {request.stats.tau:.2f}")
    print(f"{len(ids)} requests in {steps} steps; greedy outputs equal the target alone")


if __name__ == "__main__":
    main()
