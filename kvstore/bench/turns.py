"""`Turns`: requests of several concurrent drivers run one at a time, in rotation.

On a shared, noisy machine, modes run one after another see different background load. With
every mode's driver in its own thread taking turns request by request, each mode's requests
interleave with the others', so the noise falls on all of them alike and the ratios between
modes are fair, while no two requests ever compete for the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from gpu_engine.engine_client import GenerateResult


class Turns:
    """A rotation over `names`; `turn(name)` blocks until it is that name's turn."""

    def __init__(self, names: Sequence[str]) -> None:
        self._order = list(names)
        self._index = 0
        self._cond = threading.Condition()

    @contextmanager
    def turn(self, name: str) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._order[self._index] == name)
        try:
            yield
        finally:
            with self._cond:
                self._index = (self._index + 1) % len(self._order)
                self._cond.notify_all()

    def leave(self, name: str) -> None:
        """`name` has no more requests: the rotation skips it from now on."""
        with self._cond:
            gone = self._order.index(name)
            del self._order[gone]
            if gone < self._index:
                self._index -= 1
            if self._index >= len(self._order):
                self._index = 0
            if not self._order:  # keep `turn` well defined for nobody
                self._order, self._index = [""], 0
            self._cond.notify_all()


class TurnTakingEngine:
    """An `EngineClient` whose `generate` waits for its mode's turn."""

    def __init__(self, engine: Any, turns: Turns, name: str) -> None:
        self._engine = engine
        self._turns = turns
        self._name = name

    def generate(self, *args: Any, **kwargs: Any) -> GenerateResult:
        with self._turns.turn(self._name):
            result: GenerateResult = self._engine.generate(*args, **kwargs)
            return result

    def load(self) -> Any:
        return self._engine.load()
