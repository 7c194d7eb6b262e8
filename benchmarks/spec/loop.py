"""The benchmark loop: every variant on every task, interleaved question by question, fastest of ``repeats`` kept."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.common import log, progress, run_order, set_postfix
from benchmarks.spec.aggregate import aggregate_speedup
from benchmarks.spec.peers import Peer, describe_error, run_hf
from benchmarks.spec.runs import QuestionResult, RunRecord, Settings, first_difference, run_engine
from benchmarks.spec.workloads import Task, score


class Benchmark:
    """Runs tasks through every variant, interleaved, and collects ``QuestionResult``s."""

    def __init__(
        self, engine, settings: Settings, peers: Sequence[Peer] = (), *, repeats: int = 1, show_progress: bool = True
    ) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        self.engine = engine
        self.settings = settings
        self.peers = list(peers)
        self.repeats = repeats
        self.show_progress = show_progress
        self.results: list[QuestionResult] = []

    def variants(self) -> list[str]:
        return ["target", "vlmspec"] + [p.name for p in self.peers if p.active]

    def warm_up(self, task: Task, rounds: int) -> None:
        """Untimed runs of every variant (first calls pay one-off costs); a peer that fails here is refused."""
        for _ in range(rounds):
            for variant in self.variants():
                self._run(variant, task, self.settings.seed, warmup=True)

    def run(self, tasks: Sequence[Task]) -> list[QuestionResult]:
        bar = progress(tasks, total=len(tasks), desc="questions", enabled=self.show_progress)
        for step, task in enumerate(bar):
            self.results.append(self.run_task(task, step))
            set_postfix(bar, self._postfix())
        return self.results

    def run_task(self, task: Task, step: int) -> QuestionResult:
        """Every variant on ``task``, in interleaved order (``run_order``), ``repeats`` times; the fastest run of each is kept."""
        seed = self.settings.seed + step
        runs: dict[str, RunRecord] = {}
        for repeat in range(self.repeats):
            for variant in run_order(self.variants(), step + repeat):
                record = self._run(variant, task, seed)
                if record is not None and (variant not in runs or record.seconds < runs[variant].seconds):
                    runs[variant] = record
        result = QuestionResult(task, runs, first_difference(runs["target"].token_ids, runs["vlmspec"].token_ids))
        for name, record in runs.items():
            result.predictions[name], result.correct[name] = score(task, record.text)
        if not result.identical and self.settings.greedy:
            log(describe_difference(result))
        return result

    def _run(self, variant: str, task: Task, seed: int, warmup: bool = False) -> RunRecord | None:
        if variant in ("target", "vlmspec"):
            try:
                return run_engine(self.engine, task, self.settings, speculative=variant == "vlmspec", seed=seed)
            except Exception as err:
                raise RuntimeError(f"vlmspec failed on question {task.qid} ({variant}): {describe_error(err)}") from err
        peer = next(p for p in self.peers if p.name == variant)
        if not peer.active:
            return None
        try:
            return run_hf(self.engine, task, self.settings, peer, seed=seed)
        except Exception as err:  # noqa: BLE001 - transformers refusing a configuration is a finding
            where = "during warm-up" if warmup else f"on question {task.qid}"
            peer.refuse(f"{describe_error(err)} ({where})")
            log(f"[{peer.name}] refused {where}: {peer.detail}")
            return None

    def _postfix(self) -> str:
        diffs = sum(not r.identical for r in self.results)
        speed = aggregate_speedup(self.results)
        return f"diffs={diffs} speedup={speed:.2f}x" if speed else f"diffs={diffs}"


def describe_difference(result: QuestionResult) -> str:
    """A readable report of where vlmspec's output left the target's, for one question."""
    i = result.first_difference
    target, spec = result.runs["target"], result.runs["vlmspec"]
    return (
        f"DIFFERENCE in {result.task.qid} ({result.task.workload}) at generated token {i}: "
        f"target {target.token_ids[i : i + 5]} vs vlmspec {spec.token_ids[i : i + 5]}\n"
        f"  prompt:  {_shorten(result.task.prompt, 160)}\n"
        f"  target:  {_shorten(target.text, 160)}\n"
        f"  vlmspec: {_shorten(spec.text, 160)}"
    )


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."
