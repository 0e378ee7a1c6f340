"""The demo's training text: generated, deterministic, small, and free of licensing questions.

A tiny grammar writes sentences about machines and training runs; a char-level model learns the
spelling and the sentence shapes within a few dozen steps, so the loss visibly falls in a demo.

>>> text = corpus_text()
>>> len(text) > 10_000 and set(text) <= set(VOCAB)
True
>>> decode(encode("the gpu.")) == "the gpu."
True
"""

from __future__ import annotations

import functools
import random

#: fixed alphabet, so the vocabulary does not depend on the generated text.
VOCAB = "\n .,abcdefghijklmnopqrstuvwxyz"
_INDEX = {c: i for i, c in enumerate(VOCAB)}

_SUBJECTS = ["the gpu", "a rank", "the machine", "the pipeline", "every worker", "the standby", "the job"]
_VERBS = ["trains", "saves", "loads", "sends", "waits for", "reduces", "checks", "restarts"]
_OBJECTS = ["the weights", "a checkpoint", "the gradients", "its peer", "the next batch", "the loss"]
_TAILS = ["", " quickly", " again", " after a fault", " at every step", " on the backup machine"]


@functools.cache
def corpus_text(sentences: int = 600, seed: int = 7) -> str:
    """``sentences`` generated sentences (about 30 characters each), a paragraph every eight."""
    rnd = random.Random(seed)
    out = []
    for i in range(sentences):
        s = f"{rnd.choice(_SUBJECTS)} {rnd.choice(_VERBS)} {rnd.choice(_OBJECTS)}{rnd.choice(_TAILS)}."
        out.append(s + ("\n" if i % 8 == 7 else " "))
    return "".join(out)


def encode(text: str) -> list[int]:
    return [_INDEX[c] for c in text]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)
