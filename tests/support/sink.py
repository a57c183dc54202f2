"""What a decode job's callbacks received (``Job.emit`` / ``Job.done``): shared by the decode batch's and the
engine process's tests."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tilert.contracts import TokenLogprobs
from tilert.decode.generate import Finish


@dataclass
class Sink:
    ids: list[int] = field(default_factory=list)
    finish: list[Finish | None] = field(default_factory=list)
    result: Finish | BaseException | None = None
    ended: threading.Event = field(default_factory=threading.Event)
    choices: dict[int, list[int]] = field(default_factory=dict)  # each choice's ids (a job of n choices)
    finishes: dict[int, Finish] = field(default_factory=dict)  # each choice's finish, once it sent it
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of the tokens emitted with theirs

    def emit(
        self, ids: list[int], finish: Finish | None, index: int = 0, logprobs: list[TokenLogprobs] | None = None
    ) -> None:
        self.ids.extend(ids)
        self.finish.append(finish)
        self.logprobs.extend(logprobs or [])
        self.choices.setdefault(index, []).extend(ids)
        if finish is not None:
            assert index not in self.finishes, f"choice {index} sent a second finish"
            self.finishes[index] = finish

    def done(self, result: Finish | BaseException) -> None:
        self.result = result
        self.ended.set()
