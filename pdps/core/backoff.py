"""How long to pause between tries: the one backoff policy of pdps.

The policy is a value; :class:`pdps.runtime.retry.Retry` is the one loop that sleeps
by it. No clock and no randomness here: the caller passes ``draw``.
"""

from __future__ import annotations

import math

import attrs


def _positive(_: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"Backoff.{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class Backoff:
    """No pause after the first ``immediate`` consecutive failures, then ``first``
    seconds, growing by ``factor`` up to ``longest``.

    ``jitter`` (0 to 1) shortens each pause by up to that fraction, so that clients that
    failed together (a round's trainers losing one compare-and-set) do not all come
    back together.
    """

    first: float = attrs.field(default=0.05, validator=_positive)
    longest: float = attrs.field(default=2.0, validator=_positive)
    factor: float = attrs.field(default=2.0, validator=_positive)
    immediate: int = 0
    jitter: float = attrs.field(default=0.0, validator=attrs.validators.and_(attrs.validators.ge(0.0), attrs.validators.le(1.0)))

    def pause(self, failures: int, draw: float = 0.0) -> float:
        """The pause after the ``failures``-th consecutive failure (counting from 1);
        ``draw`` is a number in [0, 1) from the caller's random source."""
        n = failures - self.immediate
        if n <= 0:
            return 0.0
        if self.factor <= 1 or self.first >= self.longest:
            base = min(self.first, self.longest)
        else:  # cap the exponent: factor ** n overflows a float long before n is large
            growth = math.log(self.longest / self.first, self.factor)
            base = self.longest if n - 1 >= growth else self.first * self.factor ** (n - 1)
        return base * (1.0 - self.jitter * draw)
