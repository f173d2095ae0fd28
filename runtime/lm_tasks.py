"""Offline lm-evaluation-harness tasks made from text on this machine (DESIGN 11).

`choice_task` writes a task folder that `lm_eval --include_path FOLDER --tasks NAME` reads without any
download: a multiple-choice item is the first 8 words of a sentence of the text, and its choices are the
sentence's next three words (the answer) and three other items' three words, in a seeded order.
`license_task` is that task over the GPL-3 text, held out from calibration (runtime.text_sets).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from passes.errors import UserError
from runtime.text_sets import EVALUATION_FILES

LICENSE_TASK = "license_mc"
CHOICES = 4
CONTEXT_WORDS = 8
SPAN_WORDS = 3


def sentences_of(text: str) -> list[str]:
    """Sentences (split after . ; :) of 12 to 40 words that start with a letter, whitespace collapsed."""
    found = [" ".join(s.split()) for s in re.split(r"(?<=[.;:])\s+", text)]
    return [s for s in found if 12 <= len(s.split()) <= 40 and s[0].isalpha()]


def choice_task(folder: Path, text: str, name: str, items: int, seed: int = 0) -> Path:
    """Write `folder`/items.jsonl and `folder`/`name`.yaml (module docstring); returns `folder`."""
    sentences = sentences_of(text)
    if not CHOICES <= items <= len(sentences):
        raise UserError(
            f"task {name}: asked for {items} items; the text has {len(sentences)} usable sentences "
            f"(12-40 words) and an item needs {CHOICES} of them"
        )
    rng = random.Random(seed)
    picked = rng.sample(sentences, items)
    end = CONTEXT_WORDS + SPAN_WORDS
    spans = [" ".join(s.split()[CONTEXT_WORDS:end]) for s in picked]
    rows = []
    for k, sentence in enumerate(picked):
        choices = [spans[(k + d) % items] for d in range(CHOICES)]  # the true span first
        order = rng.sample(range(CHOICES), CHOICES)
        context = " ".join(sentence.split()[:CONTEXT_WORDS])
        rows.append({"context": context, "choices": [choices[i] for i in order], "label": order.index(0)})
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: choices\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        encoding="utf-8",
    )
    return folder


def license_task(folder: Path, items: int = 8) -> Path:
    """`choice_task` named license_mc over /usr/share/common-licenses/GPL-3."""
    path = EVALUATION_FILES["prose"][0]
    if not path.is_file():
        raise UserError(f"{path} is missing here: name your own task (--tasks, --include-path)")
    return choice_task(folder, path.read_text(encoding="utf-8"), LICENSE_TASK, items)
