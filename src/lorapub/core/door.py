"""The core's one dialect for a pure machine's door: a :class:`Table` of handlers keyed by command type.

Each handler is ``(state, command: ThatCommand) -> Outcome``; :func:`on` pairs a command type with its
handler (mypy --strict refuses a handler of another command); a command no handler takes is InvalidInput.
The registry and the engine-side staging both dispatch through one.
See docs/design.md, "Shape".
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, TypeVar

import attrs

from lorapub.errors import InvalidInput

__all__ = ["Entry", "Table", "on"]

S = TypeVar("S")  # the machine's state
O = TypeVar("O")  # its outcome
C = TypeVar("C")  # one command type


@attrs.frozen
class Entry(Generic[S, O]):
    """One row of a table: ``command`` and the handler that takes it (made by :func:`on`)."""

    command: type
    handler: Callable[[S, Any], O]


def on(command: type[C], handler: Callable[[S, C], O]) -> Entry[S, O]:
    """The row for ``command``: ``handler`` takes the state and a ``command`` (checked by mypy)."""
    return Entry(command, handler)


class Table(Generic[S, O]):
    """A machine's handlers keyed by command type; calling it is the machine's door."""

    __slots__ = ("machine", "_rows")

    def __init__(self, machine: str, *rows: Entry[S, O]) -> None:
        self.machine = machine
        self._rows: dict[type, Callable[[S, Any], O]] = {}
        for row in rows:
            if row.command in self._rows:
                raise ValueError(f"{row.command.__name__} has two {machine} handlers")
            self._rows[row.command] = row.handler

    def __call__(self, state: S, command: object) -> O:
        """Apply ``command`` to ``state`` through its handler (InvalidInput: no handler takes it)."""
        handler = self._rows.get(type(command))
        if handler is None:
            raise InvalidInput(f"{command!r} is not a {self.machine} command")
        return handler(state, command)

    def __contains__(self, command: object) -> bool:
        return command in self._rows

    def __getitem__(self, command: type) -> Callable[[S, Any], O]:
        return self._rows[command]

    def __iter__(self) -> Iterator[type]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"<Table {self.machine}: {len(self._rows)} commands>"
