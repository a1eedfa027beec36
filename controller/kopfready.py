"""kopf's wait for its indexes, without waking every waiting object at each object indexed (shell, around kopf).

kopf runs no handler of an operator until every index of it is filled from the first listings (the cache's `synced`
relies on it, `controller.watchcache`): each listed object's worker indexes the object, drops its own toggle from
the operator's `ToggleSet` and waits on the set's condition until no toggle is left. kopf's set wakes every waiter
at each drop (`notify_all`), and each waiter takes the condition's lock in turn only to find the set still not
done: with N objects listed, about N²/2 wake-ups before the first handler runs. A restarted controller with
1,500 Services (about 10,000 objects) spent minutes of CPU in them, holding every listed object parsed meanwhile
(docs/benchmarks.md). The set's waiters wait only for its state (any or all of its toggles on), which adding or
dropping a toggle changes rarely (the last one dropped), so the set's `make_toggle`, `drop_toggle` and
`drop_toggles` are replaced by ones that wake the waiters only when the state changes. A toggle's own waiters
are woken by the toggle itself (`Toggle.turn_to`), as before.
"""
from __future__ import annotations

from collections.abc import Iterable

from kopf._cogs.aiokits.aiotoggles import Toggle, ToggleSet


async def make_toggle(self: ToggleSet, __val: bool = False, *, name: str | None = None) -> Toggle:
    toggle = Toggle(__val, name=name, condition=self._condition)
    async with self._condition:
        before = self.is_on()
        self._toggles.add(toggle)
        if self.is_on() != before:
            self._condition.notify_all()
    return toggle


async def drop_toggle(self: ToggleSet, toggle: Toggle) -> None:
    async with self._condition:
        before = self.is_on()
        self._toggles.discard(toggle)
        if self.is_on() != before:
            self._condition.notify_all()


async def drop_toggles(self: ToggleSet, toggles: Iterable[Toggle]) -> None:
    async with self._condition:
        before = self.is_on()
        self._toggles.difference_update(toggles)
        if self.is_on() != before:
            self._condition.notify_all()


def install() -> None:
    """Replace kopf's `ToggleSet` methods, once for the process."""
    ToggleSet.make_toggle = make_toggle          # type: ignore[method-assign]
    ToggleSet.drop_toggle = drop_toggle          # type: ignore[method-assign]
    ToggleSet.drop_toggles = drop_toggles        # type: ignore[method-assign]
