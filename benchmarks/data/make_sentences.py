"""Writes sentences.txt: 480 varied English sentences for ``benchmarks/bench_prune.py`` (no downloads).

Deterministic (seed 0): ``python benchmarks/data/make_sentences.py`` rewrites the same file. Topics x
templates x word choices, so that the sentences range from near-paraphrases (same topic and template)
to unrelated ones -- pairwise similarities then have structure for a rank correlation to measure.
"""

from __future__ import annotations

import random
from pathlib import Path

TOPICS = {
    "cooking": (
        ["the chef", "my grandmother", "a young cook", "the baker", "our neighbour"],
        ["bakes", "stirs", "tastes", "slices", "seasons", "roasts"],
        ["fresh bread", "a pot of soup", "the tomatoes", "a lemon cake", "the garlic", "spiced lentils"],
        [
            "in the kitchen",
            "before dinner",
            "on a cold evening",
            "for the whole family",
            "at the market stall",
        ],
    ),
    "sport": (
        ["the striker", "a tired runner", "the goalkeeper", "our captain", "the young swimmer"],
        ["kicks", "chases", "catches", "throws", "trains with", "defends"],
        [
            "the ball",
            "a personal record",
            "the final whistle",
            "the trophy",
            "a rival team",
            "the relay baton",
        ],
        ["in the stadium", "during the match", "after a long season", "under heavy rain", "at the olympics"],
    ),
    "computing": (
        ["the programmer", "a new compiler", "the database", "our server", "the test suite"],
        ["compiles", "crashes on", "indexes", "caches", "rejects", "parses"],
        [
            "the source code",
            "a corrupted file",
            "every request",
            "the user input",
            "a large query",
            "the logs",
        ],
        ["at midnight", "after the update", "on the cloud cluster", "without warning", "in production"],
    ),
    "weather": (
        ["the storm", "a cold wind", "the morning fog", "heavy snow", "the summer sun"],
        ["covers", "floods", "freezes", "warms", "sweeps across", "hides"],
        [
            "the valley",
            "the coastal towns",
            "the old bridge",
            "the harbour",
            "the mountain roads",
            "the fields",
        ],
        ["all week", "since yesterday", "in early spring", "late at night", "before the harvest"],
    ),
    "music": (
        ["the pianist", "a street band", "the orchestra", "my sister", "the old singer"],
        ["plays", "rehearses", "records", "hums", "composes", "performs"],
        [
            "a slow waltz",
            "the new album",
            "an old folk song",
            "the symphony",
            "a jazz standard",
            "the encore",
        ],
        ["on stage", "in a small bar", "for the radio", "at the festival", "in the empty hall"],
    ),
    "medicine": (
        ["the doctor", "a nurse", "the surgeon", "the pharmacist", "our family physician"],
        ["examines", "treats", "prescribes", "monitors", "vaccinates", "operates on"],
        ["the patient", "a broken arm", "the infection", "the child", "a fever", "the heart valve"],
        [
            "at the clinic",
            "in the emergency room",
            "every morning",
            "during the night shift",
            "after the test",
        ],
    ),
    "travel": (
        ["the tourists", "a lone hiker", "the pilot", "our guide", "the family"],
        ["visits", "crosses", "books", "explores", "photographs", "leaves"],
        [
            "the ancient temple",
            "a crowded train station",
            "the desert",
            "a small island",
            "the museum",
            "the border",
        ],
        ["at dawn", "on the last day", "by bicycle", "with a heavy backpack", "during the holidays"],
    ),
    "finance": (
        ["the bank", "a small investor", "the central bank", "the accountant", "our company"],
        ["buys", "sells", "audits", "lends", "raises", "reports"],
        [
            "government bonds",
            "the quarterly profits",
            "a risky loan",
            "interest rates",
            "its shares",
            "the budget",
        ],
        ["this quarter", "after the crisis", "before the deadline", "on the stock exchange", "at a loss"],
    ),
}

QUESTIONS = ["why does {s} {v} {o} {p}?", "does {s} really {v} {o} {p}?", "when will {s} {v} {o}?"]
STATEMENTS = [
    "{S} {v3} {o} {p}.",
    "{P}, {s} {v3} {o}.",
    "{S} never {v3} {o} {p}.",
    "Everyone says that {s} {v3} {o} {p}.",
    "{S} {v3} {o}, and nobody is surprised.",
]


def base(verb: str) -> str:
    """``bakes`` -> ``bake``, ``trains with`` -> ``train with`` (enough for these verbs)."""
    head, _, rest = verb.partition(" ")
    if head.endswith("es") and head[-3] in "sxhz":
        head = head[:-2]
    elif head.endswith("s"):
        head = head[:-1]
    return f"{head} {rest}".strip()


def sentences(n: int = 480, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[str] = []
    topics = list(TOPICS.values())
    while len(out) < n:
        subj, verbs, objs, places = topics[len(out) % len(topics)]
        s, v, o, p = rng.choice(subj), rng.choice(verbs), rng.choice(objs), rng.choice(places)
        if rng.random() < 0.2:
            text = rng.choice(QUESTIONS).format(s=s, v=base(v), o=o, p=p)
            text = text[0].upper() + text[1:]
        else:
            text = rng.choice(STATEMENTS).format(
                S=s[0].upper() + s[1:], s=s, v=base(v), v3=v, o=o, p=p, P=p[0].upper() + p[1:]
            )
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("sentences.txt")
    path.write_text("\n".join(sentences()) + "\n", encoding="utf-8")
    print(f"wrote {path}")
