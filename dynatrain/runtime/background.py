"""One computation on a daemon thread, its value or its error handed to whoever waits for it."""

from __future__ import annotations

import threading
from typing import Any, Callable


class Background:
    """One computation on a daemon thread; `result()` waits for it and re-raises what it raised."""

    def __init__(self, key: Any, fn: Callable[[], Any], name: str) -> None:
        self.key = key
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # handed to the caller of result()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()

    def result(self, timeout: float | None = None) -> Any:
        """The value, waited for (at most ``timeout`` seconds: a TimeoutError after)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._thread.name} did not finish within {timeout:.1f}s")
        if self._error is not None:
            raise self._error
        return self._value

    @property
    def error(self) -> BaseException | None:
        """What it raised, once done (None while it runs or when it returned)."""
        return self._error
