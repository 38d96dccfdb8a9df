"""Prompt sets for the speculative-decoding benchmarks (bench/bench_memlimit.py --prompt-set).

Two kinds of work, because drafts predict them very differently:
  * "chat": open-ended questions and requests; the answer is new text, so drafts from the context
    (prompt lookup) rarely predict and the self-draft carries speculation;
  * "code": code editing in which the answer restates the given code with changes (type hints, a
    rename, a bug fix, a docstring), so long runs of the answer are already in the context;
  * "prose": editing and questions about a given passage of prose (fix the grammar, shorten it, make
    it formal, answer from it): between the two, the answer partly restates the context. Kept apart
    from the other two as a set the speculative controller was not tuned on.

Each prompt is one user message; the worker applies the model's chat template (llama.cpp's, through
llama-cpp-python's create_chat_completion formatting) and decodes greedily.
"""

from __future__ import annotations

from typing import Dict, List

_INTERVALS = """def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
"""

_WORDS = """def count_words(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.split():
                word = word.lower().strip(".,;:!?")
                counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(path, n=10):
    counts = count_words(path)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return ranked[:n]
"""

_CACHE = """class LruCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key):
        if key not in self.items:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)
"""

_STATS = """def summarize(values):
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n
    ordered = sorted(values)
    if n % 2:
        median = ordered[n // 2]
    else:
        median = (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {"n": n, "mean": mean, "std": var ** 0.5, "median": median}
"""

_HARBOUR = (
    "The old harbour was quiet that morning. A few fishing boats was tied to the pier, their paint "
    "peeling after years of salt and wind. Maria walked along the water with her dog, who stopped every "
    "few steps to sniff at the ropes and the nets that the fishermen had left to dry. She thought about "
    "the letter she had recieved the day before, and about whether she should finally sell the house "
    "her grandmother had left her."
)

_MEETING = (
    "The team agreed to move the product launch from March to May. The main reasons were the delays "
    "in the payment integration and the results of the user study, which showed that new users "
    "struggled with the setup screen. Priya will redesign the setup flow by the end of February, and "
    "Tom will work with the payment provider to fix the remaining issues. The marketing budget stays "
    "the same, but the campaign will start two weeks before the new launch date."
)

_GARDEN = (
    "Tomatoes need at least six hours of direct sun a day and soil that drains well. Water them deeply "
    "but not too often, so that the roots grow down instead of staying near the surface. When the plants "
    "are about thirty centimetres tall, tie them to a stake or a cage. Remove the small shoots that grow "
    "between the main stem and the branches if you want fewer but larger fruits."
)

PROMPT_SETS: Dict[str, List[str]] = {
    "chat": [
        "What are three good habits for staying focused while studying? Explain each briefly.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain to a ten-year-old why the sky is blue.",
        "I am planning a three-day trip to a city I have never visited. How should I plan it?",
        "What is the difference between weather and climate? Give examples.",
        "Give me some advice for my first week at a new job.",
    ],
    "code": [
        "Add type hints to this function and return the whole function:\n\n" + _INTERVALS,
        "Rename the variable `merged` to `result` in this function and return the whole function:\n\n" + _INTERVALS,
        "Fix the bug in this code (empty words must not be counted) and return the corrected code:\n\n" + _WORDS,
        "Add a docstring to every method of this class and return the whole class:\n\n" + _CACHE,
        "Make `get` and `put` O(1) by using collections.OrderedDict; return the whole class:\n\n" + _CACHE,
        "Raise a ValueError for an empty list in this function and return the whole function:\n\n" + _STATS,
    ],
    "prose": [
        "Fix the spelling and grammar mistakes in this paragraph and return the corrected paragraph:\n\n" + _HARBOUR,
        "Rewrite this paragraph in the present tense:\n\n" + _HARBOUR,
        "Turn these meeting notes into a short, formal email to the whole company:\n\n" + _MEETING,
        "According to these notes, who is responsible for what, and by when?\n\n" + _MEETING,
        "Rewrite these instructions as a numbered list of steps:\n\n" + _GARDEN,
        "Summarize this advice in two sentences:\n\n" + _GARDEN,
    ],
}


def prompt_set(name: str) -> List[str]:
    try:
        return PROMPT_SETS[name]
    except KeyError:
        raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}") from None
