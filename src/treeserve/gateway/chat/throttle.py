"""Sign-in attempts per user name, for the chat's 429 on password guessing."""
from __future__ import annotations

import time

LOGIN_ATTEMPTS, LOGIN_WINDOW = 5, 300.0  # attempts per user name in the window before a 429


class LoginThrottle:
    """Sign-in attempts per user name in a sliding window, counted before the password is checked
    (so parallel guesses count too) and forgotten on success. A name is forgotten only once its
    window has passed; past `names` remembered names, new ones wait for room. Per process: several
    gateway processes each allow `limit`."""

    def __init__(self, limit: int = LOGIN_ATTEMPTS, window: float = LOGIN_WINDOW, names: int = 100_000):
        self.limit, self.window, self.names = limit, window, names
        self.attempts: dict[str, list[float]] = {}

    def attempt(self, user_id: str) -> int:
        """0 when this attempt may go ahead (and is counted), else the seconds to wait."""
        now = time.monotonic()
        recent = [t for t in self.attempts.get(user_id, ()) if now - t < self.window]
        if len(recent) >= self.limit:
            return int(self.window - (now - recent[0])) + 1
        if user_id not in self.attempts and len(self.attempts) >= self.names:
            self._forget_expired(now)
            if len(self.attempts) >= self.names:
                return int(self.window)
        self.attempts[user_id] = recent + [now]
        return 0

    def succeeded(self, user_id: str) -> None:
        self.attempts.pop(user_id, None)

    def _forget_expired(self, now: float) -> None:
        for name in [n for n, times in self.attempts.items() if now - times[-1] >= self.window]:
            del self.attempts[name]
