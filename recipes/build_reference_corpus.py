"""Build the reference pair's answer corpus: the target's own answers to training prompts, for corpus lookup.

Reads a target cache built by ``recipes/train_reference_drafters.sh`` (or any
``vlmspec train --cache`` build over the reference mix of ``recipes/reference_prompts.py``),
keeps the answer tokens of every sequence (its loss mask), and writes them as a
:class:`vlmspec.drafters.corpus_lookup.TokenCorpus`. The mix leaves out every question a
benchmark reports (the first GSM8K and MT-Bench entries, the benchmarks' images and code
and maths questions), so the corpus holds no answer to a benchmarked question.

Example (seconds; the committed corpus came from the cache of 1,979 greedy answers that
the lever A/B of recipes/README.md trained on)::

    python recipes/build_reference_corpus.py --cache ~/.cache/vlmspec/runs/ship-3x/cache \\
        --out vlmspec/assets/reference-drafter/corpus.npz
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm import tqdm

from vlmspec.drafters.corpus_lookup import TokenCorpus
from vlmspec.training.cache import TargetCache


def answers(cache: TargetCache):
    """The answer tokens of every cached sequence, in cache order."""
    for index in tqdm(range(len(cache)), desc="answers", unit="seq"):
        sequence = cache[index]
        yield sequence.input_ids[sequence.loss_mask].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="a complete target cache directory")
    parser.add_argument("--out", type=Path, default=Path("vlmspec/assets/reference-drafter/corpus.npz"))
    args = parser.parse_args()
    corpus = TokenCorpus.from_sequences(answers(TargetCache(args.cache)))
    corpus.save(args.out)
    print(f"{args.out}: {corpus.num_sequences:,} answers, {len(corpus) - corpus.num_sequences:,} tokens")


if __name__ == "__main__":
    main()
